"""FedLink's model (docs/fedtip.md, "FedLink"): ID embeddings, a heterogeneous GraphSAGE, a
dot-product score with BCE, chronological buffers."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.methods.fedgnn.fedgnn_model import HistoryGraph, RowMean


class SAGE(nn.Module):
    """One GraphSAGE relation as PyG's ``SAGEConv``: ``W_nb mean(N(v)) + b + W_self x_v``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.nb = nn.Linear(d, d)
        self.self_ = nn.Linear(d, d, bias=False)

    def forward(self, adj: Tensor, x_nb: Tensor, x_self: Tensor) -> Tensor:
        return self.nb(torch.sparse.mm(adj, x_nb)) + self.self_(x_self)


class HeteroSAGE(nn.Module):
    """``layers`` heterogeneous layers as PyG's ``to_hetero``, ReLU between."""

    def __init__(self, d: int, layers: int = 2) -> None:
        super().__init__()
        self.to_user = nn.ModuleList(SAGE(d) for _ in range(layers))
        self.to_item = nn.ModuleList(SAGE(d) for _ in range(layers))

    def forward(
        self, a_ui: Tensor, a_iu: Tensor, x_u: Tensor, x_i: Tensor
    ) -> tuple[Tensor, Tensor]:
        for n, (fu, fi) in enumerate(zip(self.to_user, self.to_item, strict=True)):
            x_u, x_i = fu(a_ui, x_i, x_u), fi(a_iu, x_u, x_i)
            if n < len(self.to_user) - 1:
                x_u, x_i = F.relu(x_u), F.relu(x_i)
        return x_u, x_i


class FedLinkModel(nn.Module):
    """The ID tables (from the ``bank`` or ``random``), the GNN, a node classification head."""

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
        """Outputs of every user (or ``user_rows``) and every item."""
        x_u = self.users if user_rows is None else self.users[user_rows]
        return self.gnn(a_ui, a_iu, x_u, self.items)


def chronological_buffers(n: int, size: int) -> list[np.ndarray]:
    """Positions ``0..n-1`` cut into consecutive buffers of ``size``."""
    return [np.arange(s, min(s + size, n)) for s in range(0, n, size)]


def local_adjacency(
    hist_u: np.ndarray,
    hist_i: np.ndarray,
    extra_u: np.ndarray,
    extra_i: np.ndarray,
    users: int,
    items: int,
) -> tuple[Tensor, Tensor]:
    """The two row-mean adjacencies of the edges ``hist`` plus ``extra``."""
    u, i = np.concatenate([hist_u, extra_u]), np.concatenate([hist_i, extra_i])
    return RowMean(u, i, (users, items)).all(), RowMean(i, u, (items, users)).all()


def bce_link_loss(pos: Tensor, neg: Tensor, ok: Tensor) -> Tensor:
    """FedLink's BCE: positives 1, negatives 0 where ``ok``."""
    logits = torch.cat([pos[ok], neg[ok]])
    target = torch.cat([torch.ones(int(ok.sum())), torch.zeros(int(ok.sum()))])
    return F.binary_cross_entropy_with_logits(logits, target) if len(logits) else pos.sum() * 0
