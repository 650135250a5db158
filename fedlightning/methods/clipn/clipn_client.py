"""CLIPN's "no" branch and the local training that teaches it, on detached embeddings and
class prototypes (CLIP's encoders stay frozen), beside Eq. (5)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.clients.continual_client import ContinualNodeClassifier
from fedlightning.clients.continual_retrieval import ContinualRetrievalClient
from fedlightning.methods.clipn.clipn_score import itbo_losses, tso_loss

__all__ = ["CLIPNClassifier", "CLIPNRetrievalClient", "NoBranch"]


class NoBranch(nn.Module):
    """The "no" prototypes ``MLP(t_c) + o_c`` (one offset per class, zero at the start)."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.offset = nn.Parameter(torch.zeros(num_classes, dim))

    def forward(self, t: Tensor, classes: Tensor) -> Tensor:
        return self.mlp(t) + self.offset[classes]


class CLIPNClassifier(ContinualNodeClassifier):
    """:class:`ContinualNodeClassifier` plus the "no"-branch losses (``net.no_branch``)."""

    stackable = False  # the branch's loss is not in ``objective``

    def __init__(
        self, net: nn.Module, optimizer: Any, lambda_no: float = 0.5, scale: float = 10.0, **kw: Any
    ) -> None:
        super().__init__(net, optimizer, **kw)
        self.lambda_no, self.scale = lambda_no, scale

    def no_loss(self, z: Tensor, batch: Data) -> Tensor:
        """ITBO and TSO of the supervised and replayed nodes over the known classes."""
        mask = batch.sup_mask | batch.replay_mask
        t = self.net.head.weight[self.known].detach()
        t_no = self.net.no_branch(t, self.known)
        l_yes, l_no = itbo_losses(
            z[mask].detach(), t, t_no, self.class_index(batch.y[mask]), self.scale
        )
        return l_yes + l_no + tso_loss(t, t_no)

    def training_step(self, batch: Data, batch_idx: int = 0) -> Tensor:
        z = self.net.embed(batch)
        full = self.net.head(self.net.dropout(z))
        loss = self.objective(full, batch, self.teacher_logits(batch))
        return self.with_proximal(loss + self.lambda_no * self.no_loss(z, batch))


class CLIPNRetrievalClient(ContinualRetrievalClient):
    """:class:`ContinualRetrievalClient` plus the "no"-branch losses, a query's own item its
    matched one."""

    stackable = False  # the branch's loss is not in the objective

    def __init__(
        self, net: nn.Module, optimizer: Any, lambda_no: float = 0.5, scale: float = 10.0, **kw: Any
    ) -> None:
        super().__init__(net, optimizer, **kw)
        self.lambda_no, self.scale = lambda_no, scale

    def no_loss(self, q: Tensor, k: Tensor, batch: Data) -> Tensor:
        """ITBO and TSO of the paired supervised and replayed nodes (0 without any)."""
        mask = (batch.sup_mask | batch.replay_mask) & self.net.pair_mask(batch)
        n = int(mask.sum())
        if n == 0:
            return q.sum() * 0.0 + sum(p.sum() for p in self.net.no_branch.parameters()) * 0.0
        items = k[mask].detach()
        items_no = self.net.no_branch(items, torch.zeros(n, dtype=torch.long, device=k.device))
        l_yes, l_no = itbo_losses(
            q[mask].detach(), items, items_no, torch.arange(n, device=k.device), self.scale
        )
        return l_yes + l_no + tso_loss(items, items_no)

    def training_step(self, batch: Data, batch_idx: int = 0) -> Tensor:
        q, k = self.net(batch)
        loss = self.retrieval_loss(batch, q, k)
        return self.with_proximal(loss + self.lambda_no * self.no_loss(q, k, batch))
