"""FedOGL's server memory as server modules: structural basis and prototype bank.

Both see messages only (no dataset, no LightningModule, no Lightning import).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning.federation.messages import ClientUpdate
from fedlightning.server.basis import aggregate_bases
from fedlightning.server.prototypes import (
    PrototypeBank,
    client_consensus,
    propagate,
    prototype_graph,
    refine_head,
)

BASIS_PREFIX, PROTO_PREFIX, COUNT_PREFIX = "basis.", "proto.", "proto_count."


class BasisMemory:
    """The global structural basis ``U_t`` per protected weight, FedOGL Eq. (8).

    At a stage's end the clients' residual bases (fields ``basis.<param>``, with the
    scalar ``basis_nodes``) are merged by summing projectors with decay ``rho`` on the old
    basis and keeping the top ``rank`` directions. Broadcast as ``basis.<param>``.

    Args:
        rank: ``r``, the global basis rank (default ``16``).
        rho: decay of the previous basis's projector (default ``1.0``).
    """

    def __init__(self, rank: int = 16, rho: float = 1.0) -> None:
        self.rank, self.rho = rank, rho
        self.bases: dict[str, Tensor] = {}

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        pass  # the basis changes only at a stage's end

    def end_stage(self, stage: int, updates: Sequence[ClientUpdate]) -> None:
        names = sorted(
            {
                k[len(BASIS_PREFIX) :]
                for u in updates
                for k in u.tensors
                if k.startswith(BASIS_PREFIX)
            }
        )
        for name in names:
            sent = [u for u in updates if BASIS_PREFIX + name in u.tensors]
            self.bases[name] = aggregate_bases(
                self.bases.get(name),
                [u.tensors[BASIS_PREFIX + name] for u in sent],
                [u.scalars["basis_nodes"] for u in sent],
                self.rho,
                self.rank,
            )

    def broadcast_fields(self) -> dict[str, Tensor]:
        return {BASIS_PREFIX + k: v for k, v in self.bases.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"bases": dict(self.bases)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bases = dict(state["bases"])


def read_prototypes(update: ClientUpdate) -> list[tuple[int, Tensor, int]]:
    """``(class, prototype, support)`` triples of a message (fields ``proto.<c>.<q>``)."""
    out = []
    for key, p in update.tensors.items():
        if key.startswith(PROTO_PREFIX):
            c = int(key[len(PROTO_PREFIX) :].split(".")[0])
            out.append((c, p, int(update.scalars[COUNT_PREFIX + key[len(PROTO_PREFIX) :]])))
    return sorted(out, key=lambda x: x[0])


class PrototypeMemory:
    """The bounded per-class prototype bank and the head refinement, FedOGL Eqs. (12)-(14).

    Every round, each uploaded prototype is consolidated into its class's bank (Eq. (12));
    then the global head is refined on the prototype graph (Eqs. (13)-(14)) against the
    count-weighted mean prediction of the client heads of the last ``window`` rounds,
    weighted by ``gamma_t`` (``gamma`` once an old class exists, else ``0``).

    Args:
        slots: ``S`` slots per class (default ``4``). eta: merge threshold (default ``0.8``).
        kappa: prototype-graph neighbours (default ``3``). gamma: ``gamma_t`` (default ``0.5``).
        lambda_lab, lambda_tr: Eq. (14) weights (default ``1.0``).
        steps, lr: SGD steps on the head per round (default ``5``, ``0.05``).
        window: rounds of client heads behind ``q_cli`` (default ``3``).
        head_prefix: key prefix of the head in the model state (default ``"head."``).
    """

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
    ) -> None:
        self.bank = PrototypeBank(slots, eta)
        self.kappa, self.gamma = kappa, gamma
        self.lambda_lab, self.lambda_tr, self.steps, self.lr = lambda_lab, lambda_tr, steps, lr
        self.head_prefix = head_prefix
        self.heads: deque[tuple[list[dict[str, Tensor]], list[float]]] = deque(maxlen=window)
        self.schedule: Callable[[int], tuple[list[int], bool]] | None = None
        self.last_refine: dict[str, float] = {}

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        for u in updates:
            for c, p, n in read_prototypes(u):
                self.bank.update(c, p, n)
        n = len(self.head_prefix)
        heads = [
            {
                k[len("model.") + n :]: v
                for k, v in u.tensors.items()
                if k.startswith("model." + self.head_prefix)
            }
            for u in updates
        ]
        self.heads.append((heads, [max(u.num_examples, 1e-12) for u in updates]))

    def update_global(self, round: int, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Refine the head of the aggregated global model on the memory, Eq. (14)."""
        known, has_old = self.schedule(round) if self.schedule else ([], False)
        P, labels, counts = self.bank.prototypes()
        if not has_old or self.gamma == 0 or P.shape[0] == 0:
            self.last_refine = {}
            return state
        keep = torch.isin(labels, torch.tensor(known))
        P, labels, counts = P[keep], labels[keep], counts[keep]
        w = state[self.head_prefix + "weight"]
        head = nn.Linear(w.size(1), w.size(0))
        head.load_state_dict({"weight": w, "bias": state[self.head_prefix + "bias"]})
        p_tilde = propagate(P, prototype_graph(P, labels, self.kappa))
        heads = [h for hs, _ in self.heads for h in hs]
        weights = [x for _, ws in self.heads for x in ws]
        q_cli = client_consensus(heads, weights, p_tilde, known)
        self.last_refine = refine_head(
            head,
            P,
            labels,
            counts,
            q_cli,
            known,
            self.kappa,
            self.gamma,
            self.lambda_lab,
            self.lambda_tr,
            self.steps,
            self.lr,
        )
        out = dict(state)
        out[self.head_prefix + "weight"] = head.weight.detach().clone()
        out[self.head_prefix + "bias"] = head.bias.detach().clone()
        return out

    def broadcast_fields(self) -> dict[str, Tensor]:
        return {}  # the bank stays on the server; its effect reaches clients through the head

    def state_dict(self) -> dict[str, Any]:
        return {"bank": self.bank.state_dict(), "heads": list(self.heads)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bank.load_state_dict(state["bank"])
        self.heads.clear()
        self.heads.extend(state["heads"])
