r"""FedGCN's model pieces (Yao et al., NeurIPS 2023; docs/fedtip.md, "FedGCN").

Before training, each client uploads its local neighbour-feature sums
:math:`S^{(k)}_v = \sum_{j} A^{(k)}_{vj} \mathbf{x}_j` and counts
:math:`c^{(k)}_v = \sum_j A^{(k)}_{vj}` over its own edges; the server adds them
(:func:`exchange_total`). The 2-layer GCN's first layer then reads the global mean
:math:`\mathbf{m}_v = (\mathbf{x}_v + \sum_k S^{(k)}_v) / (1 + \sum_k c^{(k)}_v)`
(:func:`first_layer_input`, the row-normalised :math:`\hat{A}X` with self loops); its second
layer aggregates over the client's own edges.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedlightning.models.dropout import Dropout


def neighbour_sums(x: Tensor, edge_index: Tensor, num_nodes: int) -> tuple[Tensor, Tensor]:
    r""":math:`S_v = \sum_{(v, j) \in E} \mathbf{x}_j` ``[N, d]`` and :math:`c_v = |\{(v, j)
    \in E\}|` ``[N]`` over the directed ``edge_index`` (give both directions for an
    undirected graph)."""
    src, dst = edge_index
    s = torch.zeros(num_nodes, x.size(1), dtype=x.dtype).index_add_(0, src, x[dst])
    c = torch.zeros(num_nodes, dtype=x.dtype).index_add_(
        0, src, torch.ones_like(src, dtype=x.dtype)
    )
    return s, c


def exchange_total(
    parts: list[tuple[Tensor, Tensor, Tensor]], num_nodes: int, dim: int
) -> tuple[Tensor, Tensor]:
    r"""The server's sum of the clients' uploads ``(nodes, sums, counts)``:
    :math:`\sum_k S^{(k)}` ``[N, d]`` and :math:`\sum_k c^{(k)}` ``[N]``."""
    s = torch.zeros(num_nodes, dim, dtype=torch.float64)
    c = torch.zeros(num_nodes, dtype=torch.float64)
    for nodes, sums, counts in parts:
        s.index_add_(0, nodes.long(), sums.double())
        c.index_add_(0, nodes.long(), counts.double())
    return s.float(), c.float()


def first_layer_input(x: Tensor, sums: Tensor, counts: Tensor) -> Tensor:
    r""":math:`\mathbf{m}_v = (\mathbf{x}_v + S_v) / (1 + c_v)` (module docstring)."""
    return (x + sums) / (1.0 + counts).unsqueeze(1)


def mean_aggregate(h: Tensor, edge_index: Tensor) -> Tensor:
    r""":math:`(\mathbf{h}_v + \sum_{(v, j) \in E} \mathbf{h}_j) / (1 + c_v)`: a mean over
    the node and its neighbours along ``edge_index``."""
    s, c = neighbour_sums(h, edge_index, h.size(0))
    return first_layer_input(h, s, c)


class FedGCNNet(nn.Module):
    r"""Two GCN layers: :math:`\mathbf{h}_v = \mathrm{ReLU}(W_1 \mathbf{m}_v + b_1)`, then
    :math:`\mathbf{z}_v = W_2\,\mathrm{mean}(\mathbf{h}_v, \mathbf{h}_{N(v)}) + b_2` over
    the graph's edges (a client's own; the server's whole history)."""

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
