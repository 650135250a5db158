r"""Robust aggregation: rules that bound what a few hostile clients can do to the global model
(docs/security.md, "Robust aggregation", describes each rule and its references). Pure
functions over the clients' models; no Lightning here.

Each rule reads the clients' updates :math:`\Delta_k = w_k - \bar w` (every floating field
of the model as one vector) and returns the next global model and the clients it set aside
(``comm.suspicious``): ``median`` and ``trimmed_mean`` (Yin et al., ICML 2018), ``krum``
(multi-Krum, Blanchard et al., NeurIPS 2017), ``screen`` (norm-and-direction screening
against a reference and the peers) and ``centered_clip`` (Karimireddy, He and Jaggi, ICML
2021, Eq. 2: :math:`v \leftarrow v + \frac1n \sum_k \mathrm{clip}_\tau(\Delta_k - v)`).
``auto``, the default (:data:`PRESETS`), steps aside where it cannot run, and a run in which
it sets no client aside is bit for bit the run without it.

The rules mirror Flower's ``FedMedian``, ``FedTrimmedAvg`` and ``Krum`` (the tests compare
them with Flower's ``aggregate_*``), written over torch state dicts so that the core server
needs no optional dependency and keeps every field's dtype."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedlightning.errors import ConfigError
from fedlightning.messages import ClientUpdate
from fedlightning.server.aggregate import fedavg, model_state

PEER_VOTERS = 5  # the fewest clients a peer vote is taken among
RULES = ("none", "median", "trimmed_mean", "krum", "screen", "centered_clip")
REFERENCES = ("median", "previous")
MEASURES = ("cosine", "sign")
# named settings of ``federation.robust``: ``auto``, the default, screens against the
# previous global update and steps aside where it cannot run
PRESETS = {
    "auto": {
        "rule": "screen",
        "measure": "sign",
        "cosine": 0.0,
        "relative": 0.5,
        "peers": 0.0,
        "auto": True,
    }
}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RobustRule:
    """``federation.robust``: the rule and its parameters (defaults: docs/security.md).

    Args:
        rule: one of :data:`RULES` (``none``: FedAvg, unchanged).
        trim: ``trimmed_mean``: the fraction cut at each end, in ``[0, 0.5)``.
        byzantine: ``krum``: :math:`f`, the hostile clients it assumes.
        keep: ``krum``: the clients averaged (``None``: :math:`n - f`).
        cosine: ``screen``: the least ``measure`` to the reference a client may have.
        norm_ratio: ``screen``: the most a client's update norm may exceed the median norm,
            as a factor (``None``: no norm screen).
        reference: ``screen``: ``median`` (the coordinate-wise median update) or ``previous``
            (the previous global update; the median in a round without one).
        measure: ``screen``: ``cosine`` or ``sign`` (:func:`sign_agreement`, in [-1, 1]).
        relative: ``screen``: the threshold is also this fraction of the round's median
            ``measure`` (the larger of the two; ``None``: ``cosine`` alone).
        peers: ``screen``: a client whose ``measure`` to more than half of the others is
            below this by more than chance, while those others agree among themselves above it
            by more than chance, is set aside (:func:`peer_outvoted`; ``None``: no peer test).
        tau: ``centered_clip``: the clipping radius :math:`\tau` (``None``: the median norm
            of the round's deviations from the centre).
        iters: ``centered_clip``: the clipping iterations :math:`L`.
        auto: the default's manners: where the rule cannot run (secure sums, an aggregation
            that is not FedAvg's, a temporal run) it steps aside with one log line instead of
            being refused, and ``suspicious`` is reported once it has set a client aside."""

    rule: str = "none"
    trim: float = 0.2
    byzantine: int = 1
    keep: int | None = None
    cosine: float = 0.0
    norm_ratio: float | None = None
    reference: str = "median"
    measure: str = "cosine"
    relative: float | None = None
    peers: float | None = None
    tau: float | None = None
    iters: int = 3
    auto: bool = False

    @property
    def on(self) -> bool:
        return self.rule != "none"

    @property
    def remembers(self) -> bool:
        """Whether the rule reads the previous global update (which the server then keeps,
        and checkpoints)."""
        return self.rule == "centered_clip" or (
            self.rule == "screen" and self.reference == "previous"
        )

    def steps_aside(self, fedavg_aggregation: bool, secure: bool, temporal: bool = False) -> bool:
        """Whether the default steps aside for this run (where it cannot run: under secure
        sums, an aggregation that is not FedAvg's, a temporal run), with one log line; a
        rule set by hand never does (the program refuses it where it cannot run)."""
        why = cannot_run(fedavg_aggregation, secure)
        if not self.auto or (why is None and not temporal):
            return False
        if why is None:  # by design, not a conflict: a quiet line
            log.debug("federation.robust=auto steps aside: the default screens graph runs")
        else:
            log.info("federation.robust=auto steps aside: %s", why)
        return True


def cannot_run(fedavg_aggregation: bool, secure: bool) -> str | None:
    """Why a robust rule cannot run (``None``: it can)."""
    if secure:
        return "federation.secure_sum=true hides each client's update"
    if not fedavg_aggregation:
        return "this method aggregates otherwise than FedAvg"
    return None


def robust_rule(raw: Any) -> RobustRule:
    """``federation.robust`` (``None``, a rule name, or a mapping of :class:`RobustRule`'s
    fields) as a :class:`RobustRule`; ``ValueError`` naming the key otherwise."""
    if raw is None or isinstance(raw, str):
        raw = PRESETS.get(raw or "none", {"rule": raw or "none"})
    if not hasattr(raw, "items"):
        raise ValueError(f"federation.robust: expected a rule name or a mapping, got {raw!r}")
    if raw.get("rule") in PRESETS:  # a preset with some of its fields set by hand
        raw = {**PRESETS[raw["rule"]], **{k: v for k, v in raw.items() if k != "rule"}}
    known = set(RobustRule.__dataclass_fields__)
    extra = sorted(set(raw) - known)
    if extra:
        raise ValueError(f"federation.robust.{extra[0]}: unknown key (keys: {sorted(known)})")
    rule = RobustRule(**dict(raw.items()))
    if rule.rule not in RULES:
        names = [*RULES, *PRESETS]
        raise ValueError(f"federation.robust.rule: one of {names}, got {rule.rule!r}")
    if rule.reference not in REFERENCES:
        raise ValueError(
            f"federation.robust.reference: one of {list(REFERENCES)}, got {rule.reference!r}"
        )
    if rule.measure not in MEASURES:
        raise ValueError(
            f"federation.robust.measure: one of {list(MEASURES)}, got {rule.measure!r}"
        )
    if rule.relative is not None and not 0.0 <= float(rule.relative) <= 1.0:
        raise ValueError(f"federation.robust.relative: expected [0, 1], got {rule.relative!r}")
    if rule.tau is not None and not float(rule.tau) > 0:
        raise ValueError(f"federation.robust.tau: expected > 0, got {rule.tau!r}")
    if int(rule.iters) < 1:
        raise ValueError(f"federation.robust.iters: expected >= 1, got {rule.iters!r}")
    if not 0.0 <= float(rule.trim) < 0.5:
        raise ValueError(f"federation.robust.trim: expected [0, 0.5), got {rule.trim!r}")
    if int(rule.byzantine) < 0 or (rule.keep is not None and int(rule.keep) < 1):
        raise ValueError("federation.robust.byzantine >= 0 and federation.robust.keep >= 1")
    if not -1.0 <= float(rule.cosine) <= 1.0:
        raise ValueError(f"federation.robust.cosine: expected [-1, 1], got {rule.cosine!r}")
    if rule.peers is not None and not -1.0 <= float(rule.peers) <= 1.0:
        raise ValueError(f"federation.robust.peers: expected [-1, 1], got {rule.peers!r}")
    if rule.norm_ratio is not None and not float(rule.norm_ratio) >= 1.0:
        raise ValueError(f"federation.robust.norm_ratio: expected >= 1, got {rule.norm_ratio!r}")
    return rule


def robust_setting(
    raw: Any, fedavg_aggregation: bool, secure: bool, temporal: bool = False
) -> RobustRule | None:
    """``federation.robust`` for a run: its rule, or ``None`` (off, or the default stepping
    aside, :meth:`RobustRule.steps_aside`); :class:`ConfigError` in one line for a bad
    value or for a rule set by hand that cannot run."""
    try:
        rule = robust_rule(raw)
    except (TypeError, ValueError) as e:
        key, _, why = str(e).partition(": ")
        field = key if key.startswith("federation.robust") else "federation.robust"
        raise ConfigError(field, why if field == key else str(e)) from None
    if not rule.on or rule.steps_aside(fedavg_aggregation, secure, temporal):
        return None
    why = cannot_run(fedavg_aggregation, secure)
    if why is not None:
        raise ConfigError("federation.robust", f"{rule.rule} cannot run: {why}; choose one")
    return rule


def stacked_deltas(
    updates: Sequence[ClientUpdate], reference: dict[str, Tensor]
) -> tuple[Tensor, list[str]]:
    """``[n, d]`` float64: each client's update (model minus ``reference``) over the floating
    fields that every client sends, flattened in key order; and those keys."""
    states = [model_state(u.tensors) for u in updates]
    keys = [  # the fields every client sends (a method may send part of its model)
        k for k, v in reference.items() if v.is_floating_point() and all(k in s for s in states)
    ]
    sizes = [reference[k].numel() for k in keys]
    x = torch.empty(len(states), sum(sizes), dtype=torch.float64)
    for row, s in zip(x, states, strict=True):  # each field written once, in place
        for piece, k in zip(row.split(sizes), keys, strict=True):
            piece.copy_(s[k].reshape(-1)).sub_(reference[k].reshape(-1))
    return x, keys


def coordinate_median(x: Tensor) -> Tensor:
    r"""The coordinate-wise median of the rows of ``x`` (``[n, d]``): for even :math:`n` the
    mean of the two middle values (as ``numpy.median``)."""
    s = x.sort(dim=0).values
    n = x.size(0)
    return (s[(n - 1) // 2] + s[n // 2]) / 2


def median_signs(x: Tensor) -> Tensor:
    """The signs of :func:`coordinate_median` for an odd number of rows, without sorting:
    a sign is monotone, so it commutes with the middle order statistic: 1 where more than
    half of the rows are positive, -1 where more than half are negative, else 0."""
    half = x.size(0) // 2
    pos, neg = (x > 0).sum(dim=0) > half, (x < 0).sum(dim=0) > half
    return pos.to(x.dtype) - neg.to(x.dtype)


def trimmed_mean(x: Tensor, trim: float) -> Tensor:
    r"""The coordinate-wise mean of the rows of ``x`` after cutting
    :math:`\lfloor \mathrm{trim}\, n \rfloor` of the smallest and of the largest values
    (``scipy.stats.trim_mean``)."""
    n = x.size(0)
    cut = int(trim * n)
    return x.sort(dim=0).values[cut : n - cut].mean(dim=0)


def krum_scores(x: Tensor, byzantine: int) -> Tensor:
    r"""Krum's score of each row of ``x``: the sum of its squared distances to its
    :math:`\max(1, n - f - 2)` nearest other rows (Blanchard et al., 2017, Eq. 1)."""
    n = x.size(0)
    d = torch.cdist(x, x).pow(2)
    closest = max(1, n - byzantine - 2)
    d = d + torch.diag(torch.full((n,), math.inf, dtype=d.dtype))  # not itself
    return d.sort(dim=1).values[:, : min(closest, n - 1)].sum(dim=1)


def cosines(x: Tensor, ref: Tensor) -> Tensor:
    """Each row's cosine to ``ref`` (0 where either is the zero vector)."""
    norms = x.norm(dim=1) * ref.norm()
    dots = x @ ref
    return torch.where(norms > 0, dots / norms.clamp_min(1e-300), torch.zeros_like(dots))


def centered_clip(x: Tensor, center: Tensor, tau: float | None, iters: int) -> Tensor:
    r"""Centered clipping (Karimireddy, He and Jaggi, ICML 2021, Eq. 2), ``iters`` times:
    :math:`v \leftarrow v + \frac1n \sum_k (\Delta_k - v) \min(1, \tau / \lVert \Delta_k -
    v\rVert)` from ``center``; ``tau`` ``None``: the median norm of the first deviations."""
    v = center
    for _ in range(iters):
        d = x - v
        norms = d.norm(dim=1)
        t = float(norms.median()) if tau is None else float(tau)
        scale = torch.where(norms > t, t / norms.clamp_min(1e-300), torch.ones_like(norms))
        v = v + (d * scale[:, None]).mean(dim=0)
        tau = t
    return v


def sign_agreement(x: Tensor, ref: Tensor) -> Tensor:
    r"""Each row's sign agreement with ``ref`` over the coordinates where ``ref`` is not
    zero, :math:`\frac1{|S|}\sum_{j \in S} \mathrm{sign}(x_j)\,\mathrm{sign}(r_j)` in
    :math:`[-1, 1]` (0: chance; 0 for every row when ``ref`` is zero)."""
    on = int((ref != 0).sum())
    if not on:
        return torch.zeros(x.size(0), dtype=x.dtype)
    return (torch.sign(x) @ torch.sign(ref)) / on  # sums of +-1 and 0: exact in float64


def pairwise(x: Tensor, measure: str) -> Tensor:
    """``[n, n]``: every pair of rows' cosine (``measure="cosine"``) or sign agreement
    (``"sign"``, :func:`sign_agreement` over every coordinate)."""
    if measure == "sign":
        s = torch.sign(x)
        return s @ s.T / max(1, x.size(1))
    unit = x / x.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return unit @ unit.T


def chance_margin(x: Tensor) -> float:
    r"""Three standard deviations of the agreement (sign agreement or cosine) of two
    independent random updates of ``x``'s width :math:`d`, :math:`3/\sqrt d`: an agreement
    below ``peers`` by less than this could be chance."""
    return 3.0 / math.sqrt(max(1, x.size(1)))


def peer_outvoted(agreement: Tensor, low: float, high: float = -math.inf) -> list[tuple[int, int]]:
    r"""``(row, votes)`` for each row whose ``agreement`` (:func:`pairwise`) with more than
    half of the other rows is below ``low``, :math:`V_k = \{j \ne k : a_{kj} < low\}`,
    :math:`|V_k| > (n-1)/2`, when those voters agree among themselves: the mean of
    :math:`a_{jl}` over the pairs :math:`j \ne l` of :math:`V_k` above ``high``. A sign-flipped
    update is outvoted by honest clients that agree with each other; clients that each
    pull their own way (disjoint classes) disagree with most peers, but their voters are
    no consensus, so nobody is outvoted. Needs :data:`PEER_VOTERS` rows or more: in a
    smaller round one dissenting honest client is outvoted by two peers (measured on
    SCAFFOLD's three-client runs)."""
    n = agreement.size(0)
    if n < PEER_VOTERS:
        return []
    against = (agreement < low).fill_diagonal_(False)
    out = []
    for k, row in enumerate(against):
        voters = row.nonzero().flatten()
        m = voters.numel()
        if m <= (n - 1) / 2:
            continue
        among = agreement[voters][:, voters]
        consensus = (among.sum() - among.diagonal().sum()) / (m * (m - 1))
        if float(consensus) > high:
            out.append((k, m))
    return out


def screened(
    rule: RobustRule, x: Tensor, ids: Sequence[int], previous: Tensor | None
) -> list[tuple[int, str]]:
    """``(client, why)`` for each row of ``x`` that the ``screen`` rule sets aside: a cosine
    below ``rule.cosine`` to its reference (:attr:`RobustRule.reference`), a norm above
    ``rule.norm_ratio`` times the median norm, or outvoted by its peers (``rule.peers``)."""
    by_sign = rule.measure == "sign" and x.size(0) % 2 == 1
    ref = median_signs(x) if by_sign else coordinate_median(x)
    name = "the median update"
    if rule.reference == "previous" and usable(previous, x):
        ref, name = previous, "the previous global update"
    cos = cosines(x, ref) if rule.measure == "cosine" else sign_agreement(x, ref)
    what = "cosine" if rule.measure == "cosine" else "sign agreement"
    outvoted = {}
    if rule.peers is not None:
        margin = chance_margin(x)
        peers = float(rule.peers)
        votes = peer_outvoted(pairwise(x, rule.measure), peers - margin, peers + margin)
        outvoted = dict(votes)
    low = float(rule.cosine)
    if rule.relative is not None:  # a fraction of the round's median cosine
        low = max(low, float(rule.relative) * float(cos.median()))
    norms = x.norm(dim=1)
    top = float(rule.norm_ratio) * float(norms.median()) if rule.norm_ratio else math.inf
    flagged = []
    for i, k in enumerate(ids):
        if float(cos[i]) < low:
            flagged.append((k, f"{what} {float(cos[i]):.3f} to {name} < {low:.3g}"))
        elif float(norms[i]) > top:
            flagged.append((k, f"update norm {float(norms[i]):.3g} > {rule.norm_ratio:g} x median"))
        elif i in outvoted:
            votes = f"{outvoted[i]} of its {len(ids) - 1} peers"
            flagged.append((k, f"{what} < {peers - margin:.3g} with {votes}"))
    return flagged


def usable(previous: Tensor | None, x: Tensor) -> bool:
    """Whether ``previous`` (the last global update) can be a reference for the rows of
    ``x``: as long as a row (the model did not change shape) and not zero."""
    return previous is not None and previous.numel() == x.size(1) and bool(previous.any())


def robust_deltas(
    rule: RobustRule, x: Tensor, ids: Sequence[int], previous: Tensor | None = None
) -> tuple[Tensor | None, list[int], list[tuple[int, str]]]:
    """``rule`` on the round's updates (the rows of ``x``, from clients ``ids``), with
    ``previous`` the last global update (or ``None``): the combined update (``None``: the
    method's own weighted mean of the kept rows), the indices of the rows kept, and
    ``(client, why)`` for each client set aside."""
    n = x.size(0)
    if rule.rule in ("median", "trimmed_mean"):
        agg = coordinate_median(x) if rule.rule == "median" else trimmed_mean(x, rule.trim)
        return agg, list(range(n)), []
    if rule.rule == "centered_clip":
        center = previous.double() if usable(previous, x) else torch.zeros_like(x[0])
        return centered_clip(x, center, rule.tau, int(rule.iters)), list(range(n)), []
    if rule.rule == "krum":
        keep = rule.keep if rule.keep is not None else max(1, n - rule.byzantine)
        scores = krum_scores(x, rule.byzantine)
        order = sorted(range(n), key=lambda i: (float(scores[i]), i))
        kept = sorted(order[: min(keep, n)])
        why = f"multi-Krum: not among the {len(kept)} closest updates"
        return None, kept, [(ids[i], why) for i in range(n) if i not in kept]
    flagged = screened(rule, x, ids, previous)
    bad = {k for k, _ in flagged}
    kept = [i for i in range(n) if ids[i] not in bad] or list(range(n))
    return None, kept, flagged


def global_update(state: dict[str, Tensor], before: dict[str, Tensor]) -> Tensor | None:
    """The global model's last step ``state - before`` over ``before``'s floating fields,
    flattened in key order as :func:`stacked_deltas` (``None`` if the model changed shape)."""
    keys = [k for k, v in before.items() if v.is_floating_point()]
    if any(k not in state or state[k].shape != before[k].shape for k in keys):
        return None
    return torch.cat([(state[k].double() - before[k].double()).reshape(-1) for k in keys])


def _with(reference: dict[str, Tensor], keys: list[str], delta: Tensor, base: dict) -> dict:
    """``base`` (integer buffers from FedAvg) with the floating fields ``reference + delta``."""
    out, at = dict(base), 0
    for k in keys:
        n = reference[k].numel()
        piece = delta[at : at + n].view(reference[k].shape)
        out[k] = (reference[k].double() + piece).to(reference[k].dtype)
        at += n
    return out


def robust_aggregate(
    rule: RobustRule,
    updates: Sequence[ClientUpdate],
    reference: dict[str, Tensor],
    previous: Tensor | None = None,
) -> tuple[dict[str, Tensor], list[ClientUpdate], list[tuple[int, str]]]:
    """The next global model under ``rule`` from the round's ``updates`` around
    ``reference`` (the broadcast global model), ``previous`` the last global update
    (:func:`global_update`, or ``None``); the updates kept (what the server's modules see);
    and ``(client, why)`` for each client set aside as suspicious."""
    if not rule.on or len(updates) < 2:
        return fedavg(updates), list(updates), []
    x, keys = stacked_deltas(updates, reference)
    agg, kept, flagged = robust_deltas(rule, x, [u.client_id for u in updates], previous)
    chosen = [updates[i] for i in kept]
    if agg is not None:  # integer buffers (counters) as FedAvg has them
        return _with(reference, keys, agg, fedavg(updates)), chosen, flagged
    return fedavg(chosen), chosen, flagged
