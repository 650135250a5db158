r"""Robust aggregation: rules that bound what a few hostile clients can do to the global model
(docs/security.md, "Robust aggregation"). Pure functions over the clients' models; no
Lightning here.

Each rule reads the clients' updates :math:`\Delta_k = w_k - \bar w` (every floating field
of the model as one vector) and returns the next global model and the clients it set aside
as suspicious, which the round records beside its rejections (``comm.suspicious``):

- ``median``: the coordinate-wise median of the models (Yin et al., ICML 2018);
- ``trimmed_mean``: the coordinate-wise mean after cutting the ``trim`` fraction of the
  largest and of the smallest values (Yin et al., ICML 2018);
- ``krum``: multi-Krum (Blanchard et al., NeurIPS 2017): the FedAvg of the ``keep`` clients
  whose updates are closest to their :math:`n - f - 2` nearest neighbours;
- ``screen``: norm-and-direction screening: a client whose update's cosine to the
  coordinate-wise median update is below ``cosine`` (or whose norm is above ``norm_ratio``
  times the median norm) is set aside, the others are averaged by FedAvg.

The rules mirror Flower's ``FedMedian``, ``FedTrimmedAvg`` and ``Krum`` strategies (the tests
compare them with Flower's ``aggregate_*`` functions), written here over torch state dicts
so that the core server needs no optional dependency and keeps every field's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedlightning.messages import ClientUpdate
from fedlightning.server.aggregate import fedavg, model_state

RULES = ("none", "median", "trimmed_mean", "krum", "screen")


@dataclass(frozen=True)
class RobustRule:
    """``federation.robust``: the rule and its parameters.

    Args:
        rule: one of :data:`RULES` (``none``: FedAvg, unchanged).
        trim: ``trimmed_mean``: the fraction cut at each end, in ``[0, 0.5)`` (default 0.2).
        byzantine: ``krum``: :math:`f`, the hostile clients it assumes (default 1).
        keep: ``krum``: the clients averaged (``None``: :math:`n - f`).
        cosine: ``screen``: the least cosine to the median update a client may have
            (default 0.0: an update pointing away from the median one is set aside).
        norm_ratio: ``screen``: the most a client's update norm may exceed the median norm,
            as a factor (``None``: no norm screen).
    """

    rule: str = "none"
    trim: float = 0.2
    byzantine: int = 1
    keep: int | None = None
    cosine: float = 0.0
    norm_ratio: float | None = None

    @property
    def on(self) -> bool:
        return self.rule != "none"


def robust_rule(raw: Any) -> RobustRule:
    """``federation.robust`` (``None``, a rule name, or a mapping of :class:`RobustRule`'s
    fields) as a :class:`RobustRule`; ``ValueError`` naming the key otherwise."""
    if raw is None or isinstance(raw, str):
        raw = {"rule": raw or "none"}
    if not hasattr(raw, "items"):
        raise ValueError(f"federation.robust: expected a rule name or a mapping, got {raw!r}")
    known = set(RobustRule.__dataclass_fields__)
    extra = sorted(set(raw) - known)
    if extra:
        raise ValueError(f"federation.robust.{extra[0]}: unknown key (keys: {sorted(known)})")
    rule = RobustRule(**dict(raw.items()))
    if rule.rule not in RULES:
        raise ValueError(f"federation.robust.rule: one of {list(RULES)}, got {rule.rule!r}")
    if not 0.0 <= float(rule.trim) < 0.5:
        raise ValueError(f"federation.robust.trim: expected [0, 0.5), got {rule.trim!r}")
    if int(rule.byzantine) < 0 or (rule.keep is not None and int(rule.keep) < 1):
        raise ValueError("federation.robust.byzantine >= 0 and federation.robust.keep >= 1")
    if not -1.0 <= float(rule.cosine) <= 1.0:
        raise ValueError(f"federation.robust.cosine: expected [-1, 1], got {rule.cosine!r}")
    if rule.norm_ratio is not None and not float(rule.norm_ratio) >= 1.0:
        raise ValueError(f"federation.robust.norm_ratio: expected >= 1, got {rule.norm_ratio!r}")
    return rule


def stacked_deltas(
    updates: Sequence[ClientUpdate], reference: dict[str, Tensor]
) -> tuple[Tensor, list[str]]:
    """``[n, d]`` float64: each client's update (model minus ``reference``) over the floating
    fields, flattened in key order; and those keys."""
    states = [model_state(u.tensors) for u in updates]
    keys = [k for k, v in reference.items() if v.is_floating_point()]
    rows = [
        torch.cat([(s[k].double() - reference[k].double()).reshape(-1) for k in keys])
        for s in states
    ]
    return torch.stack(rows), keys


def coordinate_median(x: Tensor) -> Tensor:
    r"""The coordinate-wise median of the rows of ``x`` (``[n, d]``): for even :math:`n` the
    mean of the two middle values (as ``numpy.median``)."""
    s = x.sort(dim=0).values
    n = x.size(0)
    return (s[(n - 1) // 2] + s[n // 2]) / 2


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
    rule: RobustRule, updates: Sequence[ClientUpdate], reference: dict[str, Tensor]
) -> tuple[dict[str, Tensor], list[ClientUpdate], list[tuple[int, str]]]:
    """The next global model under ``rule`` from the round's ``updates`` around
    ``reference`` (the broadcast global model); the updates kept (what the server's modules
    see); and ``(client, why)`` for each client set aside as suspicious."""
    if not rule.on or len(updates) < 2:
        return fedavg(updates), list(updates), []
    x, keys = stacked_deltas(updates, reference)
    ids = [u.client_id for u in updates]
    if rule.rule in ("median", "trimmed_mean"):
        base = fedavg(updates)  # integer buffers (counters) as FedAvg has them
        agg = coordinate_median(x) if rule.rule == "median" else trimmed_mean(x, rule.trim)
        return _with(reference, keys, agg, base), list(updates), []
    if rule.rule == "krum":
        keep = rule.keep if rule.keep is not None else max(1, len(updates) - rule.byzantine)
        scores = krum_scores(x, rule.byzantine)
        order = sorted(range(len(updates)), key=lambda i: (float(scores[i]), i))
        kept = sorted(order[: min(keep, len(updates))])
        why = f"multi-Krum: not among the {len(kept)} closest updates"
        flagged = [(ids[i], why) for i in range(len(updates)) if i not in kept]
        chosen = [updates[i] for i in kept]
        return fedavg(chosen), chosen, flagged
    ref = coordinate_median(x)  # screen
    cos = cosines(x, ref)
    norms = x.norm(dim=1)
    top = float(rule.norm_ratio) * float(norms.median()) if rule.norm_ratio else math.inf
    flagged = []
    for i, k in enumerate(ids):
        if float(cos[i]) < rule.cosine:
            flagged.append(
                (k, f"cosine {float(cos[i]):.3f} to the median update < {rule.cosine:g}")
            )
        elif float(norms[i]) > top:
            flagged.append((k, f"update norm {float(norms[i]):.3g} > {rule.norm_ratio:g} x median"))
    bad = {k for k, _ in flagged}
    chosen = [u for u in updates if u.client_id not in bad] or list(updates)
    return fedavg(chosen), chosen, flagged
