r"""SCAFFOLD's server control variate (Karimireddy et al. 2020, Algorithm 1, line 17)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedlightning.messages import ClientUpdate
from fedlightning.server.aggregate import strip_prefix
from fedlightning.server.server import ServerModule

CONTROL, CONTROL_DELTA = "control.", "control_delta."


def control_update(c: Tensor, deltas: Sequence[Tensor], num_clients: int) -> Tensor:
    """Line 17: ``c + sum of the changes / N`` (``N`` the federation's clients)."""
    return c + torch.stack(list(deltas)).sum(0) / num_clients


class ControlVariates(ServerModule):
    """The global control variate per floating model entry, broadcast as ``control.<key>``;
    line 17 reads only the changes' sum, so a secure sum may carry them."""

    def __init__(self) -> None:
        self.control: dict[str, Tensor] = {}
        self.num_clients = 0

    def setup(self, global_state: dict[str, Tensor], num_clients: int) -> None:
        self.num_clients = int(num_clients)
        self.control = {
            k: torch.zeros_like(v) for k, v in global_state.items() if v.is_floating_point()
        }

    def summed_fields(self) -> tuple[str, ...]:
        return (CONTROL_DELTA,)

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        deltas = [strip_prefix(u.tensors, CONTROL_DELTA) for u in updates]
        self.control = {
            k: control_update(c, [d[k] for d in deltas], self.num_clients)
            for k, c in self.control.items()
        }

    def broadcast_fields(self) -> dict[str, Tensor]:
        return {CONTROL + k: v for k, v in self.control.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"control": dict(self.control), "num_clients": self.num_clients}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.control, self.num_clients = dict(state["control"]), int(state["num_clients"])
