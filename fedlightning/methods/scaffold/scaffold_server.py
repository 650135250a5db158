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
    r""":math:`c \leftarrow c + \frac{1}{N} \sum_{i \in S} \Delta c_i` (Algorithm 1, line 17):
    the server's control variate moves by the sum of the sampled clients' changes over the
    number of clients ``N`` of the federation."""
    return c + torch.stack(list(deltas)).sum(0) / num_clients


class ControlVariates(ServerModule):
    """The global control variate :math:`c`, one tensor per floating model entry, zero at the
    start; broadcast as ``control.<key>``, moved by the clients' ``control_delta.<key>``.
    Line 17 reads the changes only through their sum, so a secure sum carries them
    (:meth:`summed_fields`): the module then gets one update holding the sum."""

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
