r"""Secure summation by pairwise masks (Bonawitz et al., CCS 2017, without its key agreement
and secret sharing): a simulation of the protocol, not a cryptographic implementation
(docs/security.md, "Secure sums").

Each client turns its message into the *additive share* the aggregate sums (FedAvg:
:math:`n_k \mathbf{w}_k`; FedTIP, Eq. (6): :math:`n_k \Delta\Omega_k` and
:math:`n_{k,c}\mathbf{q}_{k,c}`), encodes it in fixed point in the ring
:math:`\mathbb{Z}_{2^{64}}` and adds a pairwise mask per other client, which cancel in the
sum. The counts travel in the clear; the server sums the shares, decodes, divides, and
hands its own aggregation one update: the aggregate."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from fedlightning.messages import (
    COUNT_PREFIX,
    PROTO_PREFIX,
    ClientUpdate,
    ServerBroadcast,
    read_prototypes,
)
from fedlightning.server.aggregate import MODEL_PREFIX
from fedlightning.server.reliability import coverage_of, reliability
from fedlightning.server.validation import Field, MessageSpec
from fedlightning.utils.seeding import torch_generator

FRACTION_BITS = 32  # fixed point: a share's value is round(x * 2^32) in Z_{2^64}
SCALE = float(2**FRACTION_BITS)
RING_HALF = 2.0**63  # the decoded sum is exact while |sum| * 2^32 < 2^63
PROTO_SUM = "proto_sum"  # class -> summed n_{k,c} q_{k,c}, one row per class
RULES = ("fedavg", "fedtip")


def encode(x: Tensor, bound: float = RING_HALF) -> Tensor:
    r"""Fixed point: :math:`\mathrm{round}(x\,2^{32})` as int64; ``ValueError`` if a value
    is not finite or :math:`|x|\,2^{32} \ge` ``bound``."""
    y = torch.round(x.double() * SCALE)
    top = float(y.abs().max()) if y.numel() else 0.0
    if not torch.isfinite(y).all() or top >= bound:
        raise ValueError(
            f"value outside the fixed-point range |x| < {bound / SCALE:.3g} ({FRACTION_BITS} "
            f"fractional bits), got max |x| = {top / SCALE:.3g}"
        )
    return y.to(torch.int64)


def decode(s: Tensor) -> Tensor:
    """A ring element (int64, two's complement) back to float64."""
    return s.double() / SCALE


def pair_mask(seed: int, round: int, i: int, j: int, field: str, shape: Sequence[int]) -> Tensor:
    r""":math:`\mathbf{m}_{ij}` (``i < j``) of one field: uniform int64 from the pair's seed
    ``(seed, round, i, j, field)``."""
    if not i < j:
        raise ValueError(f"a pair mask is addressed by i < j, got {i}, {j}")
    g = torch_generator(seed, "secure_sum", round, i, j, field)
    return torch.randint(-(2**63), 2**63 - 1, tuple(shape), generator=g, dtype=torch.int64)


def client_mask(
    seed: int, round: int, client: int, peers: Sequence[int], field: str, shape: Sequence[int]
) -> Tensor:
    r"""Client ``client``'s net mask :math:`\sum_{j > k} \mathbf{m}_{kj} - \sum_{j < k}
    \mathbf{m}_{jk}` over ``peers`` (the round's clients), in the ring."""
    total = torch.zeros(tuple(shape), dtype=torch.int64)
    for j in peers:
        if j > client:
            total += pair_mask(seed, round, client, j, field, shape)
        elif j < client:
            total -= pair_mask(seed, round, j, client, field, shape)
    return total


def _clip_norm(delta: Tensor, max_norm: float) -> Tensor:
    norm = float(delta.double().norm())
    return delta * min(1.0, max_norm / norm) if norm > 0 else delta


@dataclass(frozen=True)
class ShareSpec:
    """What a client's additive share holds (plain values; the same layout for every client).

    Args:
        rule: ``fedavg`` (``model.<k>`` times ``num_examples``; FedAvg, FedProx, FedOGL's
            model) or ``fedtip`` (``delta`` times :math:`n_k = \\sum_c n_{k,c}`, Eq. 6).
        classes, dim: the ``proto_sum`` rows and width (``classes=0``: no prototypes).
        max_update_norm: each client clips its update (``model.*`` minus the broadcast, or
            ``delta``) to this L2 norm before scaling and masking; the server cannot check it.
        max_client_weight: ``fedavg``: each client caps its ``num_examples`` at this before
            scaling and masking, and sends the capped count in the clear, where the server
            checks it (:meth:`SecureSum.share_spec`).
        sums: the prefixes of extra fields a server module reads only as their plain sum
            over the round's clients (unweighted; SCAFFOLD's ``control_delta.``:
            :meth:`~fedlightning.server.server.ServerModule.summed_fields`); the aggregate
            carries each such field's sum."""

    rule: str = "fedavg"
    classes: int = 0
    dim: int = 0
    max_update_norm: float | None = None
    max_client_weight: float | None = None
    sums: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"share rule must be one of {RULES}, got {self.rule!r}")

    def weight(self, update: ClientUpdate) -> float:
        """The client's weight in the sum: ``num_examples`` (at most ``max_client_weight``)
        or :math:`\\sum_c n_{k,c}`."""
        if self.rule == "fedavg":
            cap = self.max_client_weight
            return update.num_examples if cap is None else min(update.num_examples, cap)
        return sum(v for k, v in update.scalars.items() if k.startswith("count."))

    def plain(
        self, update: ClientUpdate, broadcast: ServerBroadcast, r: float = 1.0
    ) -> dict[str, Tensor]:
        """The client's plain additive share (float64), before encoding and masking;
        ``r``: its reliability :math:`r_k` (Eq. 6; 1 without reliability weights)."""
        n = self.weight(update) * r
        out: dict[str, Tensor] = {}
        if self.rule == "fedavg":
            model = {k: v for k, v in update.tensors.items() if k.startswith(MODEL_PREFIX)}
            if self.max_update_norm is not None:
                model = _clip_model(model, broadcast.tensors, self.max_update_norm)
            out.update({k: n * v.double() for k, v in model.items()})
        else:
            delta = update.tensors["delta"]
            if self.max_update_norm is not None:
                delta = _clip_norm(delta, self.max_update_norm)
            out["delta"] = n * delta.double()
        for prefix in self.sums:  # a module's additive fields, summed as they are
            out.update({k: v.double() for k, v in update.tensors.items() if k.startswith(prefix)})
        if self.classes:
            rows = torch.zeros(self.classes, self.dim, dtype=torch.float64)
            for c, p, count in self.prototypes(update):
                rows[c] += count * r * p.double()
            out[PROTO_SUM] = rows
        return out

    def prototypes(self, update: ClientUpdate) -> list[tuple[int, Tensor, float]]:
        """``(class, prototype, count)`` of a plain message, in either method's fields."""
        if self.rule == "fedavg":
            return [(c, p, float(n)) for c, p, n in read_prototypes(update)]
        out = []
        for k, p in update.tensors.items():
            if k.startswith(PROTO_PREFIX):
                c = int(k[len(PROTO_PREFIX) :])
                out.append((c, p, update.scalars[f"count.{c}"]))
        return out

    def aggregate(
        self,
        total: dict[str, Tensor],
        shares: Sequence[ClientUpdate],
        like: dict[str, Tensor],
        weights: dict[int, float] | None = None,
    ) -> ClientUpdate:
        r"""The decoded sums over the clear counts of ``shares`` (times each client's
        reliability in ``weights``: Eq. 6's :math:`Z_\Omega, Z_c`): one update that the
        server's own aggregation reads as the round's only, with the clear counts' totals
        (``like``: the broadcast, for the model's dtypes)."""
        r = {u.client_id: 1.0 if weights is None else weights[u.client_id] for u in shares}
        n = sum(self.weight(u) * r[u.client_id] for u in shares)
        if n <= 0:
            raise ValueError("secure sum: the clients' total weight is 0, nothing to divide by")
        tensors, scalars = {}, {}
        for k, s in total.items():
            if k == PROTO_SUM:
                continue
            if self.sums and k.startswith(self.sums):
                tensors[k] = s.float()  # a declared sum: the server module divides itself
                continue
            dtype = like[k].dtype if k in like else torch.float32
            mean = s / n
            tensors[k] = mean.to(dtype) if dtype.is_floating_point else mean.round().to(dtype)
        if self.rule == "fedavg":
            scalars["num_examples"] = float(n)
        if self.classes:
            z = torch.zeros(self.classes, dtype=torch.float64)
            counted = torch.zeros(self.classes, dtype=torch.float64)
            for u in shares:
                for key, v in u.scalars.items():
                    c = _count_class(key, self.rule)
                    if c is not None:
                        z[c] += v * r[u.client_id]
                        counted[c] += v
            for c in range(self.classes):
                if z[c] > 0:
                    q = (total[PROTO_SUM][c] / z[c]).float()
                    if self.rule == "fedavg":
                        tensors[f"{PROTO_PREFIX}{c}.0"] = q
                        scalars[f"{COUNT_PREFIX}{c}.0"] = float(z[c])
                    else:
                        tensors[f"{PROTO_PREFIX}{c}"] = q
            if self.rule == "fedtip":
                scalars.update(
                    {f"count.{c}": float(counted[c]) for c in range(self.classes) if z[c]}
                )
        elif self.rule == "fedtip":
            counts = {k: sum(u.scalars.get(k, 0.0) for u in shares) for k in _counts(shares)}
            scalars.update(counts)
        return ClientUpdate(round=shares[0].round, tensors=tensors, scalars=scalars)


def _counts(shares: Sequence[ClientUpdate]) -> list[str]:
    return sorted({k for u in shares for k in u.scalars if k.startswith("count.")})


def _count_class(key: str, rule: str) -> int | None:
    prefix = COUNT_PREFIX if rule == "fedavg" else "count."
    if not key.startswith(prefix):
        return None
    return int(key[len(prefix) :].split(".")[0])


def _clip_model(
    model: dict[str, Tensor], start: dict[str, Tensor], max_norm: float
) -> dict[str, Tensor]:
    """``model`` moved back towards ``start`` so that its floating-point change has L2 norm
    at most ``max_norm`` (integer buffers unchanged)."""
    keys = [k for k, v in model.items() if v.dtype.is_floating_point]
    norm = math.sqrt(sum(float((model[k].double() - start[k].double()).pow(2).sum()) for k in keys))
    if norm <= max_norm:
        return model
    f = max_norm / norm
    return {k: start[k] + f * (v - start[k]) if k in keys else v for k, v in model.items()}


@dataclass(frozen=True)
class SecureSum:
    """The round's protocol: ``seed`` (pair seeds) and the :class:`ShareSpec`."""

    seed: int
    spec: ShareSpec
    held: dict[int, ClientUpdate] = field(default_factory=dict, compare=False, repr=False)

    def mask(
        self,
        update: ClientUpdate,
        broadcast: ServerBroadcast,
        peers: Sequence[int],
        weight: float = 1.0,
    ) -> ClientUpdate:
        """Client side: the masked share of ``update`` (ring elements, int64) with its
        scalars in the clear. ``peers``: the round's client ids, agreed at the broadcast;
        ``weight``: the client's reliability :math:`r_k` (a weighted sum's phase two)."""
        k, r = update.client_id, broadcast.round  # the round the peers were fixed in
        bound = RING_HALF / max(len(peers), 1)
        tensors = {}
        for f, x in self.spec.plain(update, broadcast, weight).items():
            try:
                enc = encode(x, bound)
            except ValueError as e:
                raise ValueError(f"secure sum: client {k}, field {f}: {e}") from None
            tensors[f] = enc + client_mask(self.seed, r, k, peers, f, x.shape)
        scalars = dict(update.scalars)
        if self.spec.rule == "fedavg" and "num_examples" in scalars:
            scalars["num_examples"] = self.spec.weight(update)  # the weight its share carries
        return ClientUpdate(r, tensors, scalars, client_id=k)

    def unmask(
        self,
        shares: Sequence[ClientUpdate],
        broadcast: ServerBroadcast,
        peers: Sequence[int],
        weights: dict[int, float] | None = None,
    ) -> ClientUpdate:
        """Server side: the ring sum of ``shares``; for a client of ``peers`` whose share
        did not arrive, every survivor reveals its pair mask with it (recovery), which the
        server subtracts; then decode and :meth:`ShareSpec.aggregate`."""
        if not shares:
            raise ValueError(f"round {broadcast.round}: no client shares to sum")
        fields = list(shares[0].tensors)
        for u in shares[1:]:
            if list(u.tensors) != fields:
                raise ValueError(f"secure sum: client {u.client_id}'s share has other fields")
        alive = [u.client_id for u in shares]
        dropped = [j for j in peers if j not in alive]
        total = {}
        for f in fields:
            s = torch.zeros_like(shares[0].tensors[f])
            for u in shares:
                s += u.tensors[f]
            for i in alive:  # the survivors' revealed masks with the dropped clients
                for j in dropped:
                    if i < j:
                        s -= pair_mask(self.seed, broadcast.round, i, j, f, s.shape)
                    else:
                        s += pair_mask(self.seed, broadcast.round, j, i, f, s.shape)
            total[f] = decode(s)
        return self.spec.aggregate(total, shares, broadcast.tensors, weights)

    def client_side(
        self, fit: Any, peers: Sequence[int], weights: dict[int, float] | None = None
    ) -> Any:
        """A round's :class:`~fedlightning.federation.round.ClientWork` whose per-client fit
        returns the masked share (on the client's process: the plain update stays there).
        With ``weights`` (the second phase of a weighted sum), each client masks the update
        it kept in :meth:`first_phase`, times its reliability; a client the first phase
        dropped sends nothing."""
        inner = fit.one

        def one(client: Any) -> ClientUpdate | None:
            if weights is not None:
                update = self.held.pop(client.client_id, None)
                if client.client_id not in weights or update is None:
                    return None
                return self.mask(update, fit.broadcast, peers, weights[client.client_id])
            update = inner(client)
            return None if update is None else self.mask(update, fit.broadcast, peers)

        params = {**fit.params, "secure_sum": {"seed": self.seed, **asdict(self.spec)}}
        return replace(fit, one=one, params=params, kind=fit.kind if weights is None else "share")

    def weighs(self, server: Any) -> bool:
        """Whether the clients weight their shares by the server's reliabilities (FedTIP's
        Eqs. 28-30): then a round has two phases (:meth:`first_phase`, :meth:`weights`)."""
        return self.spec.rule == "fedtip" and bool(getattr(server, "reliability_weights", False))

    def first_phase(self, fit: Any) -> Any:
        """Phase one of a weighted sum: each client fits, keeps its plain update on its own
        process, and sends the clear scalars of its message (Eq. 2: counts, coverage,
        norm), from which the server computes every :math:`r_k` (:meth:`weights`)."""
        inner = fit.one

        def one(client: Any) -> ClientUpdate | None:
            update = inner(client)
            if update is None:
                return None
            self.held[update.client_id] = update
            return ClientUpdate(update.round, {}, dict(update.scalars), client_id=update.client_id)

        return replace(fit, one=one)

    def clear_spec(self, plain: MessageSpec | None) -> MessageSpec:
        """Phase one's declaration: the plain message's scalars, with their ranges."""
        scalars = [f for f in plain.fields if not f.tensor] if plain is not None else []
        return MessageSpec(tuple(scalars) or (Field(r".+", tensor=False, required=False),))

    def weights(self, first: Sequence[ClientUpdate], server: Any) -> dict[int, float]:
        r"""Eqs. (27)-(29) from phase one's clear scalars: :math:`b_k` from the counts,
        :math:`\gamma` (Eq. 28) the median of the *reported* norms (the server cannot
        recompute a norm from a masked delta), client id -> :math:`r_k`."""
        classes = tuple(getattr(server, "classes", (0, 1)))
        norms = {u.client_id: float(u.scalars["norm"]) for u in first}
        gamma = float(torch.tensor(list(norms.values()), dtype=torch.float64).quantile(0.5))
        out = {}
        for u in first:
            counts = {int(k[6:]): int(v) for k, v in u.scalars.items() if k.startswith("count.")}
            out[u.client_id] = reliability(coverage_of(counts, classes), norms[u.client_id], gamma)
        return out

    def share_spec(self, plain: MessageSpec | None, optional: bool = False) -> MessageSpec:
        """What the server can still check of a masked share (docs/security.md): the summed
        fields' names, shapes and ring dtype (their values are masked), and the clear
        scalars of the plain declaration ``plain`` with their ranges; the rules that read
        plain values cannot run."""
        ring = {"dtype": torch.int64}
        summed = "delta" if self.spec.rule == "fedtip" else re.escape(MODEL_PREFIX) + r".+"
        fields = [replace(f, **ring) for f in getattr(plain, "fields", ()) if f.name == summed]
        fields = fields or [Field(summed, like=lambda m: m[0], **ring)]
        for prefix in self.spec.sums:  # shaped as the plain declaration says, in the ring
            own = re.escape(prefix) + r"(.+)"
            fields += [replace(f, **ring) for f in getattr(plain, "fields", ()) if f.name == own]
        if self.spec.classes:
            fields.append(Field(PROTO_SUM, shape=(self.spec.classes, self.spec.dim), **ring))
        scalars = [f for f in plain.fields if not f.tensor] if plain is not None else []
        if plain is None:
            scalars = [Field(r".+", tensor=False, required=False)]
        cap = self.spec.max_client_weight
        if cap is not None:  # the clear count is the weight the share carries: checked here
            scalars = [
                replace(f, high=_capped(f.high, cap)) if f.name == "num_examples" else f
                for f in scalars
            ]
        return MessageSpec(
            fields=(*fields, *scalars),
            optional=optional or (plain.optional if plain is not None else True),
            masked=(
                re.escape(MODEL_PREFIX) + r".+",
                "delta",
                PROTO_SUM,
                *(re.escape(p) + r"(.+)" for p in self.spec.sums),
            ),
            reference=plain.reference if plain is not None else None,
        )

    def aggregate(
        self,
        round: int,
        shares: Sequence[ClientUpdate],
        broadcast: ServerBroadcast,
        peers: Sequence[int],
        aggregate: Callable[[int, list[ClientUpdate]], None],
        weights: dict[int, float] | None = None,
    ) -> None:
        """Server side of a round: :meth:`unmask`, then ``aggregate(round, [the sum])``."""
        aggregate(round, [self.unmask(shares, broadcast, peers, weights)])


def _capped(high: Any, cap: float) -> Callable[[int], float]:
    """A declared upper bound (a number or ``client -> number``) no higher than ``cap``."""
    return lambda k: min(float(high(k) if callable(high) else high), cap)


def graph_secure_sum(
    server: Any,
    seed: int,
    max_update_norm: float | None = None,
    max_client_weight: float | None = None,
) -> SecureSum:
    """The protocol for a graph run's :class:`~fedlightning.server.server.Server`: FedAvg's
    model sum (FedAvg, FedProx, the continual baselines, FedOGL) and the per-class prototype
    sums a server module declares (:meth:`~fedlightning.server.server.ServerModule.summed_prototypes`),
    and the plain sums of the extra fields a module declares
    (:meth:`~fedlightning.server.server.ServerModule.summed_fields`). ``ValueError`` for an
    aggregation that is not a weighted sum, or a module that refuses."""
    from fedlightning.server.aggregate import fedavg

    if server.aggregator is not fedavg:
        raise ValueError("secure sums need the FedAvg aggregation (a weighted sum)")
    classes = dim = 0
    sums: list[str] = []
    for mod in server.modules.values():
        if mod.secure_sum is not None:
            raise ValueError(mod.secure_sum)
        classes, dim = mod.summed_prototypes(server.global_state) or (classes, dim)
        sums += mod.summed_fields()
    spec = ShareSpec("fedavg", classes, dim, max_update_norm, max_client_weight, tuple(sums))
    return SecureSum(int(seed), spec)


def enabled(value: Any) -> bool:
    """``federation.secure_sum``: ``true`` or ``false``, else one :class:`ConfigError` line."""
    if not isinstance(value, bool):
        from fedlightning.errors import ConfigError

        raise ConfigError("federation.secure_sum", f"must be true or false, got {value!r}")
    return value
