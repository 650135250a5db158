"""FedGCN's server side of the one-off exchange (docs/fedtip.md, "FedGCN")."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fedgcn.fedgcn_model import exchange_total


class SumExchangeServer:
    """One exchange: keeps the summed :attr:`sums` and :attr:`counts`."""

    def __init__(self, num_nodes: int, dim: int) -> None:
        self.num_nodes, self.dim = num_nodes, dim
        self.sums: Tensor | None = None
        self.counts: Tensor | None = None

    def broadcast(self, round: int) -> ServerBroadcast:
        return ServerBroadcast(round=round)

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        parts = [(u.tensors["nodes"], u.tensors["sum"], u.tensors["count"]) for u in updates]
        self.sums, self.counts = exchange_total(parts, self.num_nodes, self.dim)
