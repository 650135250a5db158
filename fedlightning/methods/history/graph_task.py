"""The client of FedGCN and FedSage+ (docs/fedtip.md): a GNN's static ``z`` over the client's
history graph, read at each event's nodes and trained with FedTIP's task losses (Eqs. 19-21)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor, nn
from torch_geometric.utils import k_hop_subgraph

from fedlightning.clients.temporal_prompt import FAMILIES, NUM_CLASSES, task_loss
from fedlightning.temporal.adapter import class_prototypes

Batch = dict[str, Tensor]


@dataclass
class ClientGraph:
    """A client's GNN input: ``x`` (generated nodes appended) and two-way ``edge_index``."""

    x: Tensor
    edge_index: Tensor


class SourceState(nn.Module):
    """The scorer's "adapter": an event's representation is its source's ``h_u``."""

    def forward(self, h_u: Tensor, *_: Tensor) -> Tensor:
        return h_u


def event_nodes(src: np.ndarray, dst: np.ndarray, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """Each event's source, destination and negative node (a failed negative reads node 0)."""
    events = batch["events"].numpy()
    return (
        torch.from_numpy(src[events]),
        torch.from_numpy(dst[events]),
        batch["neg_id"].clamp(min=0),
    )


def graph_views(z: Tensor, nodes: tuple[Tensor, Tensor, Tensor], batch: Batch, family: str):
    """``family_views`` of one client's support with ``z`` for the prompted states."""
    u, i, j = (z[n].unsqueeze(0) for n in nodes)
    mask = batch.get("mask", torch.ones(len(batch["events"]), dtype=torch.bool)).reshape(1, -1)
    if family == "nc":
        return u, batch["y"].reshape(1, -1), mask
    return u, i, u, j, mask & batch["neg_ok"].reshape(1, -1)


def lp_prototypes(views: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """Link prediction's class means (negative 0, positive 1) as FedTIP's ``lp`` counts them."""
    h_pos, _, h_neg, _, mask = views
    y = torch.cat([torch.zeros_like(mask), torch.ones_like(mask)], 1).long()
    return class_prototypes(torch.cat([h_neg, h_pos], 1), y, torch.cat([mask, mask], 1), 2)


class GraphTaskClient(pl.LightningModule):
    """A GNN ``model(x, edge_index) -> z`` fitted on a client's support over its graph."""

    def __init__(
        self,
        model: nn.Module,
        stream: Any,
        family: str,
        tau: float = 0.1,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        optimizer: str = "adam",
    ) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be adam or sgd, got {optimizer!r}")
        self.model, self.family = model, family
        self.src, self.dst = stream.src, stream.dst
        self.tau, self.lr, self.weight_decay, self.optimizer = tau, lr, weight_decay, optimizer
        self.graph: ClientGraph | None = None
        self.last_loss = float("nan")

    def use_graph(self, graph: ClientGraph) -> None:
        self.graph = graph
        self._sub: tuple[Any, ...] | None = None

    def subgraph(self, nodes: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The support's ``model.hops``-hop subgraph (inputs, edges, positions), kept while
        the graph and the support stay."""
        key = tuple(id(n) for n in nodes)
        if self._sub is None or self._sub[0] != key:
            targets = torch.unique(torch.cat([n.flatten() for n in nodes]))
            subset, edges, _, _ = k_hop_subgraph(
                targets, self.model.hops, self.graph.edge_index, relabel_nodes=True,
                num_nodes=self.graph.x.size(0), flow="target_to_source",
            )  # fmt: skip
            where = torch.full((self.graph.x.size(0),), -1, dtype=torch.long)
            where[subset] = torch.arange(len(subset))
            self._sub = (key, self.graph.x[subset], edges, where)
        return self._sub[1:]

    def receive(self, state: dict[str, Tensor]) -> None:
        self.model.load_state_dict(state)

    def embed(self) -> Tensor:
        return self.model(self.graph.x, self.graph.edge_index)

    def views(self, batch: Batch) -> tuple[Tensor, ...]:
        nodes = event_nodes(self.src, self.dst, batch)
        x, edges, where = self.subgraph(nodes)
        z = self.model(x, edges)
        return graph_views(z, tuple(where[n] for n in nodes), batch, self.family)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = task_loss(self.views(batch), self.family, self.tau)
        self.last_loss = float(loss.detach())
        return loss

    @torch.no_grad()
    def prototypes(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """The family's class means and counts after the fit (Eq. 18)."""
        self.eval()
        views = self.views(batch)
        if self.family == "nc":
            q, counts = class_prototypes(*views, NUM_CLASSES)
        else:
            q, counts = lp_prototypes(views)
        return q[0], counts[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.model.parameters())
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
