"""The client of Feddy, STFL and FedDGL: one net per client, stacked, fitted on the family's
loss (Eqs. 19-21 of paper 001) plus Feddy's trajectory or FedDGL's prototype term."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor

from fedlightning.clients.temporal_prompt import FAMILIES, family_prototypes, task_loss
from fedlightning.methods.dynamic.dynamic_model import FeddyNet, StackedNet

Batch = dict[str, Tensor]


def prototype_gap(q: Tensor, counts: Tensor, glob: Tensor, has: Tensor) -> Tensor:
    """FedDGL's prototype term: per client the mean distance of its observed classes'
    prototypes to the global ones (where ``has``), summed over clients."""
    keep = (counts > 0) & has.unsqueeze(0)
    dist = (q - glob.unsqueeze(0)).norm(dim=-1)
    return ((dist * keep).sum(1) / keep.sum(1).clamp(min=1)).sum()


class DynamicBaselineClient(pl.LightningModule):
    """The stacked local fit."""

    def __init__(
        self,
        net: StackedNet,
        family: str,
        tau: float = 0.1,
        lr: float = 1e-3,
        weight_decay: float = 1e-5,
        lambda_traj: float = 0.0,
        lambda_proto: float = 0.0,
    ) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        self.net, self.family, self.tau = net, family, tau
        self.lr, self.weight_decay = lr, weight_decay
        self.lambda_traj, self.lambda_proto = lambda_traj, lambda_proto
        self.extras: Batch = {}
        self.last_loss = float("nan")

    def receive(self, states: list[dict[str, Tensor]], extras: Batch | None = None) -> None:
        """Copy ``k`` from ``states[k]``; ``extras``: the method's per-client inputs."""
        if self.net.copies != len(states):
            self.net = self.net.stacked(len(states))
        self.net.load_copies(states)
        self.extras = dict(extras or {})

    def loss(self, batch: Batch) -> Tensor:
        views = self.net.views(batch, self.family)
        loss = task_loss(views, self.family, self.tau)
        if self.lambda_traj and isinstance(self.net, FeddyNet):
            loss = loss + self.lambda_traj * self.net.trajectory(self.extras)
        if self.lambda_proto and "glob" in self.extras:
            q, counts = family_prototypes(views, self.family)
            gap = prototype_gap(q, counts, self.extras["glob"], self.extras["has_glob"])
            loss = loss + self.lambda_proto * gap
        return loss

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.last_loss = float(loss.detach())
        return loss

    @torch.no_grad()
    def prototypes(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """Eq. (18) of paper 001 per copy after the fit."""
        self.eval()
        return family_prototypes(self.net.views(batch, self.family), self.family)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(
            self.net.parameters(), lr=self.lr, weight_decay=self.weight_decay, foreach=True
        )
