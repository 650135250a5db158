"""FedOGL's server memory as server modules: structural basis and prototype bank (no Lightning)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning.messages import ClientUpdate, read_prototypes
from fedlightning.methods.fedogl.alignment import (
    class_descriptors,
    refine_heads,
    similarity_consensus,
)
from fedlightning.methods.fedogl.basis import aggregate_bases
from fedlightning.methods.fedogl.prototypes import (
    PrototypeBank,
    client_consensus,
    propagate,
    prototype_graph,
    refine_head,
)
from fedlightning.server.aggregate import model_state, strip_prefix
from fedlightning.server.server import ServerModule

BASIS_PREFIX = "basis."


class BasisMemory(ServerModule):
    """Eq. (8)'s ``U_t`` per protected weight: at a stage's end the clients' ``basis.<param>``
    merged (weighted by ``basis_nodes``); broadcast as ``basis.<param>``."""

    def __init__(self, rank: int = 16, rho: float = 1.0) -> None:
        self.rank, self.rho = rank, rho
        self.bases: dict[str, Tensor] = {}

    def end_stage(self, stage: int, updates: Sequence[ClientUpdate]) -> None:
        sent = [(strip_prefix(u.tensors, BASIS_PREFIX), u.scalars) for u in updates]
        for name in sorted({k for bases, _ in sent for k in bases}):
            has = [(b[name], scalars["basis_nodes"]) for b, scalars in sent if name in b]
            self.bases[name] = aggregate_bases(
                self.bases.get(name), [b for b, _ in has], [n for _, n in has], self.rho, self.rank
            )

    def broadcast_fields(self) -> dict[str, Tensor]:
        return {BASIS_PREFIX + k: v for k, v in self.bases.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"bases": dict(self.bases)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bases = dict(state["bases"])


class PrototypeMemory(ServerModule):
    """Eqs. (12)-(14): each round the uploads enter the bank, then the global head is refined
    against the last ``window`` rounds' client heads once an old class exists (arguments:
    docs/fedogl.md); one bank per ``sides`` entry (``""``: node classification)."""

    def summed_prototypes(self, global_state: dict[str, Tensor]) -> tuple[int, int] | None:
        head = global_state[self.head_prefix + "weight"]
        return int(head.shape[0]), int(head.shape[1])

    def __init__(
        self,
        slots: int = 4,
        eta: float = 0.8,
        kappa: int = 3,
        gamma: float = 0.5,
        lambda_lab: float = 1.0,
        lambda_tr: float = 1.0,
        steps: int = 5,
        lr: float = 0.05,
        window: int = 3,
        head_prefix: str = "head.",
        sides: Sequence[str] = ("",),
    ) -> None:
        self.banks = {side: PrototypeBank(slots, eta) for side in sides}
        self.kappa, self.gamma = kappa, gamma
        self.refine_kw = dict(lambda_lab=lambda_lab, lambda_tr=lambda_tr, steps=steps, lr=lr)
        self.head_prefix = head_prefix
        self.heads: deque[tuple[list[dict[str, Tensor]], list[float]]] = deque(maxlen=window)
        self.schedule: Callable[[int], tuple[list[int], bool]] | None = None
        self.last_refine: dict[str, float] = {}

    @property
    def bank(self) -> PrototypeBank:
        """The single bank of node classification."""
        return self.banks[""]

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        for u in updates:
            for side, bank in self.banks.items():
                for c, p, n in read_prototypes(u, side):
                    bank.update(c, p, n)
        heads = [strip_prefix(model_state(u.tensors), self.head_prefix) for u in updates]
        self.heads.append((heads, [max(u.num_examples, 1e-12) for u in updates]))

    def known_prototypes(self, side: str, known: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """A bank's known-class prototypes: raw, propagated (Eq. 13), and their labels."""
        P, labels, _ = self.banks[side].prototypes()
        keep = torch.isin(labels, torch.tensor(known, dtype=labels.dtype))
        P, labels = P[keep], labels[keep]
        return P, propagate(P, prototype_graph(P, labels, self.kappa)), labels

    def update_global(self, round: int, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Refine the head(s) of the aggregated global model on the memory, Eq. (14)."""
        known, has_old = self.schedule(round) if self.schedule else ([], False)
        self.last_refine = {}
        if not has_old or self.gamma == 0 or any(len(b) == 0 for b in self.banks.values()):
            return state
        return self.refine(state, known)

    def client_heads(self) -> tuple[list[dict[str, Tensor]], list[float]]:
        """The client heads of the window with their weights (training-node counts)."""
        heads = [h for hs, _ in self.heads for h in hs]
        return heads, [x for _, ws in self.heads for x in ws]

    def refine(self, state: dict[str, Tensor], known: list[int]) -> dict[str, Tensor]:
        """Eq. (14) on the classification head."""
        P, p_tilde, labels = self.known_prototypes("", known)
        head = _linear(state, self.head_prefix)
        q_cli = client_consensus(*self.client_heads(), p_tilde, known)
        self.last_refine = refine_head(
            head, P, labels, q_cli, known, self.kappa, self.gamma, **self.refine_kw
        )
        return {**state, **_linear_state(head, self.head_prefix)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "banks": {k: b.state_dict() for k, b in self.banks.items()},
            "heads": list(self.heads),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, b in self.banks.items():
            b.load_state_dict(state["banks"][k])
        self.heads.clear()
        self.heads.extend(state["heads"])


class AlignmentMemory(PrototypeMemory):
    """Retrieval's Eqs. (12)-(14): a bank per modality ``sides = (query, item)``; the heads
    ``heads.<query>``, ``heads.<item>`` aligned on the class descriptors (:mod:`~.alignment`)."""

    secure_sum = "retrieval's per-modality prototype banks are not summed securely"

    def __init__(self, sides: Sequence[str], temperature: float = 0.1, **kw: Any) -> None:
        kw.setdefault("head_prefix", "heads.")
        super().__init__(sides=tuple(sides), **kw)
        self.query, self.item = sides
        self.temperature = temperature

    def refine(self, state: dict[str, Tensor], known: list[int]) -> dict[str, Tensor]:
        (_, Pq, lq), (_, Pv, lv) = (
            self.known_prototypes(m, known) for m in (self.query, self.item)
        )
        classes = sorted(set(lq.tolist()) & set(lv.tolist()))
        if len(classes) < 2:
            return state  # nothing to contrast a class with
        A, B = class_descriptors(Pq, lq, classes), class_descriptors(Pv, lv, classes)
        heads, weights = self.client_heads()
        pairs = [
            (strip_prefix(h, f"{self.query}."), strip_prefix(h, f"{self.item}.")) for h in heads
        ]
        targets = similarity_consensus(pairs, weights, A, B, self.temperature)
        hq, hv = (_linear(state, f"{self.head_prefix}{m}.") for m in (self.query, self.item))
        self.last_refine = refine_heads(
            hq, hv, A, B, targets, self.temperature, self.gamma, **self.refine_kw
        )
        return {
            **state,
            **_linear_state(hq, f"{self.head_prefix}{self.query}."),
            **_linear_state(hv, f"{self.head_prefix}{self.item}."),
        }


def _linear(state: dict[str, Tensor], prefix: str) -> nn.Linear:
    w = state[prefix + "weight"]
    layer = nn.Linear(w.size(1), w.size(0), dtype=w.dtype)
    layer.load_state_dict({"weight": w, "bias": state[prefix + "bias"]})
    return layer


def _linear_state(layer: nn.Linear, prefix: str) -> dict[str, Tensor]:
    return {prefix + k: v.detach().clone() for k, v in layer.state_dict().items()}
