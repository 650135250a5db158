"""FedGCN's model pieces (Yao et al., NeurIPS 2023; docs/fedtip.md, "FedGCN"): the exchanged
neighbour sums and counts, a first layer on their global mean, a second on the own edges."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedlightning.models.dropout import Dropout


def neighbour_sums(x: Tensor, edge_index: Tensor, num_nodes: int) -> tuple[Tensor, Tensor]:
    """Neighbour sums [N, d] and counts [N] along the directed ``edge_index``."""
    src, dst = edge_index
    s = torch.zeros(num_nodes, x.size(1), dtype=x.dtype).index_add_(0, src, x[dst])
    c = torch.zeros(num_nodes, dtype=x.dtype).index_add_(
        0, src, torch.ones_like(src, dtype=x.dtype)
    )
    return s, c


def exchange_total(
    parts: list[tuple[Tensor, Tensor, Tensor]], num_nodes: int, dim: int
) -> tuple[Tensor, Tensor]:
    """The server's sums of the clients' ``(nodes, sums, counts)``."""
    s = torch.zeros(num_nodes, dim, dtype=torch.float64)
    c = torch.zeros(num_nodes, dtype=torch.float64)
    for nodes, sums, counts in parts:
        s.index_add_(0, nodes.long(), sums.double())
        c.index_add_(0, nodes.long(), counts.double())
    return s.float(), c.float()


def first_layer_input(x: Tensor, sums: Tensor, counts: Tensor) -> Tensor:
    """``(x + S) / (1 + c)``."""
    return (x + sums) / (1.0 + counts).unsqueeze(1)


def mean_aggregate(h: Tensor, edge_index: Tensor) -> Tensor:
    """The mean over each node and its neighbours."""
    s, c = neighbour_sums(h, edge_index, h.size(0))
    return first_layer_input(h, s, c)


class FedGCNNet(nn.Module):
    """Two GCN layers: ``ReLU(W_1 m + b_1)``, then ``W_2`` of the neighbour mean ``+ b_2``."""

    hops = 1  # the receptive field: the first layer reads precomputed rows

    def __init__(self, d_in: int, hidden: int = 32, d_out: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
        self.dropout = Dropout(dropout)
        self.d_out = d_out

    def forward(self, m: Tensor, edge_index: Tensor) -> Tensor:
        h = self.dropout(torch.relu(self.lin1(m)))
        return self.lin2(mean_aggregate(h, edge_index))

    def num_values(self) -> int:
        return sum(p.numel() for p in self.parameters())
