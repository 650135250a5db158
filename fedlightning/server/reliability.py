r"""FedTIP's server mathematics (paper 001, Sec. 3.5 and 4.3-4.4), Lightning-free.

One equation, one function: Eqs. (27)-(29); the prompt update (Eqs. 30-31) and anchors
(Eqs. 23-24) go through the additive statistics of Eq. (6), so secure summation could
replace the plain sums (:mod:`~fedlightning.server.secure_sum`); the private prototype of
Eqs. (4), (5), (7) is :mod:`~fedlightning.server.privacy`'s."""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch
from torch import Tensor

from fedlightning.errors import ConfigError
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.server.aggregate import strip_prefix
from fedlightning.server.privacy import clip_embeddings, private_prototype  # noqa: F401
from fedlightning.server.robust import RobustRule, robust_deltas

EPS = 1e-8
log = logging.getLogger(__name__)


def label_coverage(counts: Mapping[int, int], classes: Sequence[int]) -> float:
    r"""Eq. (27): :math:`b_k = 1 - \frac12 \sum_{c \in \mathcal{Y}} |p_{k,c} - 1/|\mathcal{Y}||`
    from support ``counts`` per class (absent: 0) over the label set ``classes``."""
    n = sum(counts.get(c, 0) for c in classes)
    if n <= 0 or not classes:
        raise ValueError(f"label_coverage needs a non-empty support over {list(classes)}")
    u = 1.0 / len(classes)
    return 1.0 - 0.5 * sum(abs(counts.get(c, 0) / n - u) for c in classes)


def median_norm(deltas: Sequence[Tensor]) -> float:
    r"""Eq. (28): :math:`\gamma^{(r)} = \mathrm{median}_k \lVert \Delta\Omega_k \rVert_2`
    (the mean of the two middle norms for an even count)."""
    norms = torch.tensor([float(d.double().norm()) for d in deltas], dtype=torch.float64)
    return float(norms.quantile(0.5))


def reliability(coverage: float, norm: float, gamma: float, eps: float = EPS) -> float:
    r"""Eq. (29): :math:`r_k = b_k \min(1, \gamma / (\lVert\Delta\Omega_k\rVert_2 + \epsilon))`.

    A zero update is not outsized, so its factor is 1 (:math:`r_k = b_k`): with
    :math:`\gamma = 0` (half the clients or more sent zero updates, e.g. ``lr=0``) Eq. (29)
    would give every client 0 and Eq. (30) would divide 0 by 0."""
    if norm == 0.0:
        return coverage
    return coverage * min(1.0, gamma / (norm + eps))


@dataclass
class ClientSummary:
    r"""A client's uplink message of Eq. (2) as the server reads it: flat
    :math:`\Delta\Omega_k`, class -> :math:`\mathbf{q}_{k,c}` and :math:`n_{k,c}`,
    :math:`b_k` (Eq. 27) and :math:`\lVert\Delta\Omega_k\rVert_2`."""

    delta: Tensor
    prototypes: dict[int, Tensor]
    counts: dict[int, int]
    coverage: float
    norm: float

    @property
    def size(self) -> int:
        return sum(self.counts.values())


@dataclass
class SufficientStatistics:
    r"""Eq. (6): :math:`S_\Omega = \sum n_k r_k \Delta\Omega_k`, :math:`Z_\Omega = \sum n_k r_k`,
    :math:`S_c = \sum n_{k,c} r_k \mathbf{q}_{k,c}`, :math:`Z_c = \sum n_{k,c} r_k`."""

    s_omega: Tensor
    z_omega: Tensor
    s_class: dict[int, Tensor]
    z_class: dict[int, Tensor]

    def __add__(self, other: SufficientStatistics) -> SufficientStatistics:
        classes = set(self.s_class) | set(other.s_class)

        def add(a: dict, b: dict) -> dict[int, Tensor]:
            return {c: a[c] + b[c] if c in a and c in b else a.get(c, b.get(c)) for c in classes}

        return SufficientStatistics(
            self.s_omega + other.s_omega,
            self.z_omega + other.z_omega,
            add(self.s_class, other.s_class),
            add(self.z_class, other.z_class),
        )


def client_statistics(m: ClientSummary, r: float) -> SufficientStatistics:
    """One client's additive share of Eq. (6), given its reliability :math:`r_k`."""
    nr = torch.tensor(m.size * r, dtype=torch.float64)
    return SufficientStatistics(
        nr * m.delta.double(),
        nr,
        {c: m.counts[c] * r * q.double() for c, q in m.prototypes.items()},
        {c: torch.tensor(m.counts[c] * r, dtype=torch.float64) for c in m.prototypes},
    )


def prompt_update(omega: Tensor, stats: SufficientStatistics, eta_s: float = 1.0) -> Tensor:
    r"""Eq. (31) through Eq. (6): :math:`\Omega^{(r+1)} = \Omega^{(r)} + \eta_s S_\Omega / Z_\Omega`,
    i.e. :math:`\Omega^{(r)} + \eta_s \sum_k w_k \Delta\Omega_k` with the weights of Eq. (30),
    :math:`w_k = n_k r_k / \sum_j n_j r_j`."""
    return (omega.double() + eta_s * stats.s_omega / stats.z_omega).to(omega.dtype)


def anchor_update(
    anchors: Mapping[int, Tensor], stats: SufficientStatistics, beta: float = 0.1, eps: float = EPS
) -> dict[int, Tensor]:
    r"""Eqs. (23)-(24): :math:`\hat{\mathbf{q}}_c = S_c / (Z_c + \epsilon)` and
    :math:`\bar{\mathbf{q}}_c \leftarrow \mathrm{norm}((1-\beta)\bar{\mathbf{q}}_c + \beta\hat{\mathbf{q}}_c)`.

    A class without an anchor yet takes :math:`\mathrm{norm}(\hat{\mathbf{q}}_c)` (the first
    aggregate initialises it, docs/readings.md); classes nobody uploaded keep their anchor."""
    out = {c: a.clone() for c, a in anchors.items()}
    for c, s in stats.s_class.items():
        q_hat = s / (stats.z_class[c] + eps)
        prev = anchors.get(c)
        mixed = q_hat if prev is None else (1 - beta) * prev.double() + beta * q_hat
        dtype = prev.dtype if prev is not None else torch.float32
        out[c] = torch.nn.functional.normalize(mixed, dim=0).to(dtype)
    return out


def aggregate(
    omega: Tensor,
    anchors: Mapping[int, Tensor],
    messages: Sequence[ClientSummary],
    eta_s: float = 1.0,
    beta: float = 0.1,
    reliability_weights: bool = True,
) -> tuple[Tensor, dict[int, Tensor], list[float]]:
    """One round on the server, Eqs. (28)-(31) and (23)-(24) through Eq. (6): the new
    adapter, anchors and :math:`r_k` (all 1 without ``reliability_weights``: support-weighted
    FedAvg, the ablation of paper Table 4)."""
    gamma = median_norm([m.delta for m in messages])
    r = [reliability(m.coverage, m.norm, gamma) if reliability_weights else 1.0 for m in messages]
    total = _sum_statistics(messages, r)
    return prompt_update(omega, total, eta_s), anchor_update(anchors, total, beta), r


PROTO_NORM_RATIO = 3.0  # a prototype's norm may be at most this times its class's median


def bound_prototypes(
    messages: Sequence[ClientSummary],
    ratio: float | None = PROTO_NORM_RATIO,
    anchors: Mapping[int, Tensor] | None = None,
) -> tuple[list[ClientSummary], list[tuple[int, int, str]]]:
    r"""The uploaded prototypes held to the representation's scale and direction.

    Norm: each :math:`\mathbf{q}_{k,c}` is clipped to
    :math:`\rho\,\mathrm{median}_j \lVert\mathbf{q}_{j,c}\rVert` over the round's uploads
    of class :math:`c` (the lower median; ``ratio`` :math:`\rho`; ``None``: off), as Eq. (28)
    holds the deltas to their median norm. Direction: a prototype whose cosine to the class's
    reference is negative is set aside (the message keeps its other fields); the reference
    is the class's anchor where one exists, else the coordinate-wise median of the round's
    uploads of the class when there are at least three. A kept prototype's share of
    :math:`\hat{\mathbf{q}}_c` (Eq. 23) then moves it by at most
    :math:`n_{k,c} r_k (\rho + 1)\,\mathrm{median}_c / Z_c`.

    Returns the messages and ``(message index, class, why)`` of each prototype bounded."""
    if ratio is None:
        return list(messages), []
    ups: dict[int, list[Tensor]] = {}
    for m in messages:
        for c, q in m.prototypes.items():
            ups.setdefault(c, []).append(q.double())
    caps, refs = {}, {}
    for c, qs in ups.items():
        caps[c] = ratio * float(torch.stack([q.norm() for q in qs]).median())
        if anchors is not None and c in anchors:
            refs[c] = anchors[c].double()
        elif len(qs) >= 3:
            refs[c] = torch.stack(qs).median(dim=0).values
    out, bounded = [], []
    for i, m in enumerate(messages):
        protos = dict(m.prototypes)
        for c, q in m.prototypes.items():
            n = float(q.double().norm())
            ref = refs.get(c)
            if ref is not None and float(q.double() @ ref) < 0:
                del protos[c]
                bounded.append((i, c, f"proto.{c} points away from its class's reference"))
            elif n > caps[c] > 0:
                protos[c] = (q.double() * (caps[c] / n)).to(q.dtype)
                bounded.append((i, c, f"proto.{c} norm {n:.3g} clipped to {ratio:g}x the median"))
        out.append(ClientSummary(m.delta, protos, m.counts, m.coverage, m.norm))
    return out, bounded


def pairwise_masks(num_clients: int, shape: tuple[int, ...], seed: int) -> list[Tensor]:
    """Masks that sum to zero over the clients (client ``i`` adds ``m_ij``, ``j`` subtracts
    it): what a secure-summation transport adds to each share of Eq. (6)."""
    g = torch.Generator().manual_seed(seed)
    masks = [torch.zeros(shape, dtype=torch.float64) for _ in range(num_clients)]
    for i in range(num_clients):
        for j in range(i + 1, num_clients):
            m = torch.randn(shape, generator=g, dtype=torch.float64)
            masks[i] += m
            masks[j] -= m
    return masks


class FedTIPServer:
    r"""One task's server: the flat global adapter :math:`\Omega^{(r)}` (broadcast as
    ``field``: ``adapter``, or ``model`` for the full-model comparator) and the anchors
    (``anchor.<c>``), with ``eta_s`` (Eq. 31), ``beta`` (Eq. 24), ``reliability_weights``
    (Eqs. 27-30), ``proto_norm_ratio`` (:func:`bound_prototypes`; ``None``: off, FedTIP
    sets it). ``anchors=False`` keeps and broadcasts none; :meth:`class_prototypes` is
    then the count-weighted mean of the last round's uploaded prototypes (docs/fedtip.md).
    ``classes``: the label set :math:`\mathcal{Y}` of Eq. (27).

    The server reads a client's update norm and coverage off the delta and the counts it
    received (:func:`read_update`), never off the scalars the client reports.

    :attr:`robust` (``federation.robust``, set by :func:`with_robust`; ``None``: off)
    aggregates the deltas by a robust rule (:func:`robust_adapter`)."""

    def __init__(
        self,
        omega: Mapping[str, Tensor],
        eta_s: float = 1.0,
        beta: float = 0.1,
        reliability_weights: bool = True,
        anchors: bool = True,
        field: str = "adapter",
        classes: Sequence[int] = (0, 1),
        proto_norm_ratio: float | None = None,
    ) -> None:
        self.shapes = {k: v.shape for k, v in omega.items()}
        self.omega = torch.cat([v.detach().reshape(-1) for v in omega.values()]).clone()
        self.eta_s, self.beta, self.field = eta_s, beta, field
        self.reliability_weights, self.use_anchors = reliability_weights, anchors
        self.classes = tuple(classes)
        self.anchors: dict[int, Tensor] = {}
        self.uploaded: dict[int, Tensor] = {}
        self.proto_norm_ratio = proto_norm_ratio
        self.flagged: list[tuple[int, str]] = []  # the last round's suspicious clients
        self.robust: RobustRule | None = None
        self.previous: Tensor | None = None  # the last adapter update, the rule's reference

    def state(self) -> dict[str, Tensor]:
        r""":math:`\Omega^{(r)}` as a state dict."""
        return unflatten(self.omega, self.shapes)

    def broadcast(self, round: int) -> ServerBroadcast:
        """What every active client receives: the adapter and the anchors."""
        anchors = self.anchors if self.use_anchors else {}
        tensors = {self.field: self.omega, **{f"{ANCHOR}{c}": a for c, a in anchors.items()}}
        return ServerBroadcast(round=round, tensors=tensors)

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        """One round's messages into the adapter and the anchors."""
        messages = [read_update(u, self.classes) for u in updates]
        secure = any(u.client_id < 0 for u in updates)  # a secure sum's aggregate: no client
        ids = [u.client_id for u in updates]
        combined, robust = None, []
        if self.robust is not None and self.robust.on and not secure and len(messages) > 1:
            combined, kept, robust = robust_adapter(self.robust, messages, ids, self.previous)
            messages, ids = [messages[i] for i in kept], [ids[i] for i in kept]
        ratio = None if secure else self.proto_norm_ratio
        messages, bounded = bound_prototypes(messages, ratio, self.anchors)
        self.flagged = robust + [(ids[i], why) for i, _, why in bounded]
        for client, why in self.flagged[len(robust) :]:  # the round logs the rule's
            log.warning("round %d: client %d suspicious: %s", round, client, why)
        omega, anchors, _ = aggregate(
            self.omega, self.anchors, messages, self.eta_s, self.beta, self.reliability_weights
        )
        if combined is not None:  # Eq. (31) with the rule's combined delta
            omega = (self.omega.double() + self.eta_s * combined).to(self.omega.dtype)
        if self.robust is not None and self.robust.remembers:
            self.previous = omega.double() - self.omega.double()
        self.omega = omega
        if self.use_anchors:
            self.anchors = anchors
        else:
            counted = [m for m in messages if m.prototypes]
            if counted:
                self.uploaded = anchor_update({}, _sum_statistics(counted, [1.0] * len(counted)))

    def class_prototypes(self) -> dict[int, Tensor]:
        """The prototypes the server scores node classification against."""
        return dict(self.anchors) if self.use_anchors else dict(self.uploaded)


def robust_adapter(
    rule: RobustRule,
    messages: Sequence[ClientSummary],
    ids: Sequence[int],
    previous: Tensor | None = None,
) -> tuple[Tensor | None, list[int], list[tuple[int, str]]]:
    r"""``federation.robust`` on the adapter deltas :math:`\Delta\Omega_k` of a round
    (:func:`~fedlightning.server.robust.robust_deltas`, ``previous`` the last adapter
    update): the combined delta (``None``: Eq. 30's weighted mean of the kept clients),
    the indices of the messages kept (their prototypes and counts feed Eqs. 23-24), and
    ``(client, why)`` for each client set aside."""
    x = torch.stack([m.delta.double().reshape(-1) for m in messages])
    return robust_deltas(rule, x, ids, previous)


def with_robust(server: Any, rule: RobustRule | None) -> Any:
    """A task's ``server`` aggregating by ``rule`` (``federation.robust``; ``None``: as it
    is): a :class:`FedTIPServer`'s :attr:`~FedTIPServer.robust`; any other server is refused
    in one line."""
    if rule is None:
        return server
    if not isinstance(server, FedTIPServer):
        raise ConfigError(
            "federation.robust",
            f"{rule.rule} reads each client's adapter update, and this method's "
            f"server ({type(server).__name__}) aggregates otherwise; use "
            "federation.robust=none",
        )
    server.robust = rule
    return server


ANCHOR = "anchor."


def unflatten(flat: Tensor, shapes: Mapping[str, Sequence[int]]) -> dict[str, Tensor]:
    """A flat parameter vector as ``name -> tensor`` views of ``shapes``, in order."""
    parts = flat.split([math.prod(shape) for shape in shapes.values()])
    return {k: x.view(shape) for (k, shape), x in zip(shapes.items(), parts, strict=True)}


def read_broadcast(
    broadcast: ServerBroadcast, shapes: Mapping[str, Sequence[int]], field: str = "adapter"
) -> tuple[dict[str, Tensor], dict[int, Tensor]]:
    r"""A client's view of a broadcast: :math:`\Omega` as a state dict, and the anchors."""
    anchors = {int(k): v for k, v in strip_prefix(broadcast.tensors, ANCHOR).items()}
    return unflatten(broadcast.tensors[field], shapes), anchors


def read_update(update: ClientUpdate, classes: Sequence[int] = (0, 1)) -> ClientSummary:
    r"""The server's view of a message: the coverage :math:`b_k` (Eq. 27) from the counts
    received (over the label set ``classes``; ``0`` for a client that observed none) and
    :math:`\lVert\Delta\Omega_k\rVert_2` from the delta received; the ``coverage`` and
    ``norm`` a client reports (Eq. 2) are checked against these
    (:func:`reported_scalars`), not used."""
    counts = {int(k): int(v) for k, v in strip_prefix(update.scalars, "count.").items()}
    protos = {int(k): v for k, v in strip_prefix(update.tensors, "proto.").items()}
    delta = update.tensors["delta"]
    return ClientSummary(delta, protos, counts, coverage_of(counts, classes), update_norm(delta))


def coverage_of(counts: Mapping[int, int], classes: Sequence[int]) -> float:
    """Eq. (27) from the counts, ``0`` when they hold no example (what a client reports)."""
    return label_coverage(counts, classes) if sum(counts.values()) > 0 else 0.0


def update_norm(delta: Tensor) -> float:
    r""":math:`\lVert\Delta\Omega_k\rVert_2` as a client computes it (float32)."""
    return float(delta.norm())


def _sum_statistics(messages: Sequence[ClientSummary], r: Sequence[float]) -> SufficientStatistics:
    return reduce(operator.add, map(client_statistics, messages, r))
