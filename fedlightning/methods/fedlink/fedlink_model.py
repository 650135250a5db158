r"""FedLink (Yao et al., *Federated Link Prediction on Dynamic Graphs*, NeurIPS 2025 NPGML
workshop) at FedTIP's widths (docs/fedtip.md, "FedLink"): user and item ID embeddings
(initialised from the bank's states), a heterogeneous two-layer GraphSAGE over the
user-item graph, a dot-product score with BCE against negatives, trained over chronological
buffers of the training edges.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.methods.fedgnn.fedgnn_model import HistoryGraph, RowMean


class SAGE(nn.Module):
    r"""One GraphSAGE relation (mean aggregator, PyG's ``SAGEConv``):
    :math:`W_{nb}\,\mathrm{mean}_{w \in N(v)} \mathbf{x}_w + b + W_{self}\mathbf{x}_v`."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.nb = nn.Linear(d, d)
        self.self_ = nn.Linear(d, d, bias=False)

    def forward(self, adj: Tensor, x_nb: Tensor, x_self: Tensor) -> Tensor:
        return self.nb(torch.sparse.mm(adj, x_nb)) + self.self_(x_self)


class HeteroSAGE(nn.Module):
    """``layers`` heterogeneous GraphSAGE layers (PyG's ``to_hetero``: one :class:`SAGE` per
    relation, item -> user and user -> item), ReLU between layers."""

    def __init__(self, d: int, layers: int = 2) -> None:
        super().__init__()
        self.to_user = nn.ModuleList(SAGE(d) for _ in range(layers))
        self.to_item = nn.ModuleList(SAGE(d) for _ in range(layers))

    def forward(
        self, a_ui: Tensor, a_iu: Tensor, x_u: Tensor, x_i: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``a_ui`` ``[users, items]`` and ``a_iu`` ``[items, users]`` row-mean adjacencies."""
        for n, (fu, fi) in enumerate(zip(self.to_user, self.to_item, strict=True)):
            x_u, x_i = fu(a_ui, x_i, x_u), fi(a_iu, x_u, x_i)
            if n < len(self.to_user) - 1:
                x_u, x_i = F.relu(x_u), F.relu(x_i)
        return x_u, x_i


class FedLinkModel(nn.Module):
    """The ID embedding tables (``users`` ``[U, d]``, ``items`` ``[I, d]``; ``init="bank"``:
    the bank's end-of-history states, ``"random"``: N(0, 0.1^2)), the GNN and the node
    classification head (ours) on the user's output."""

    def __init__(self, graph: HistoryGraph, init: str = "bank", layers: int = 2) -> None:
        super().__init__()
        if init not in ("bank", "random"):
            raise ValueError(f"init must be bank or random, got {init!r}")
        d = graph.item_state.size(1)
        if init == "bank":
            users, items = graph.user_state.clone(), graph.item_state.clone()
        else:
            users, items = (
                torch.randn(graph.num_users, d) * 0.1,
                torch.randn(graph.num_items, d) * 0.1,
            )
        self.users, self.items = nn.Parameter(users), nn.Parameter(items)
        self.gnn = HeteroSAGE(d, layers)
        self.head = nn.Linear(d, 1)

    def num_values(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def embed(
        self, a_ui: Tensor, a_iu: Tensor, user_rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Outputs of every user (or of ``user_rows``, the rows ``a_ui``/``a_iu`` index) and
        every item."""
        x_u = self.users if user_rows is None else self.users[user_rows]
        return self.gnn(a_ui, a_iu, x_u, self.items)


def chronological_buffers(n: int, size: int) -> list[np.ndarray]:
    """Positions ``0..n-1`` of time-ordered training edges cut into consecutive buffers of
    ``size`` (the last one shorter)."""
    return [np.arange(s, min(s + size, n)) for s in range(0, n, size)]


def local_adjacency(
    hist_u: np.ndarray,
    hist_i: np.ndarray,
    extra_u: np.ndarray,
    extra_i: np.ndarray,
    users: int,
    items: int,
) -> tuple[Tensor, Tensor]:
    """The two row-mean adjacencies (``[users, items]``, ``[items, users]``) of the edges
    ``hist`` plus ``extra`` (local user and item rows)."""
    u, i = np.concatenate([hist_u, extra_u]), np.concatenate([hist_i, extra_i])
    return RowMean(u, i, (users, items)).all(), RowMean(i, u, (items, users)).all()


def bce_link_loss(pos: Tensor, neg: Tensor, ok: Tensor) -> Tensor:
    """FedLink's binary cross-entropy of the dot-product logits: positives 1, negatives 0
    (the events whose negative exists)."""
    logits = torch.cat([pos[ok], neg[ok]])
    target = torch.cat([torch.ones(int(ok.sum())), torch.zeros(int(ok.sum()))])
    return F.binary_cross_entropy_with_logits(logits, target) if len(logits) else pos.sum() * 0
