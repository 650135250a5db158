"""FedGNN's client (docs/fedtip.md, "FedGNN"): SGD with each gradient clipped (the LDP clip) on
the family's loss."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from fedlightning.methods.fedgnn.fedgnn_model import (
    FedGNNModel,
    bce_node_loss,
    clip_norm,
    dot_scores,
    mse_link_loss,
)

FAMILY_KEYS = {  # the dense parameters each family trains (and sends)
    "lp": ("gnn_u.weight", "gnn_u.bias", "gnn_i.weight", "gnn_i.bias"),
    "nc": ("gnn_u.weight", "gnn_u.bias", "head.weight", "head.bias"),
}


def fedgnn_forward(model: FedGNNModel, batch: dict[str, Tensor], family: str) -> tuple[Tensor, ...]:
    """``lp``: the positives' and negatives' dot products; ``nc``: the node logits."""
    z_u = model.users(batch["h_u"], model.aggregate(batch["u"]))
    if family == "nc":
        return (model.head(z_u).squeeze(-1),)
    return dot_scores(z_u, model.item_side(batch["i"])), dot_scores(
        z_u, model.item_side(batch["j"])
    )


class TableClient(pl.LightningModule):
    """What FedGNN's and FedLink's clients share: parameters received by name, the family's
    loss on :meth:`step_scores`."""

    link_loss = staticmethod(mse_link_loss)

    def __init__(self, model: nn.Module, family: str, lr: float) -> None:
        super().__init__()
        self.model, self.family, self.lr = model, family, lr
        self.last_loss = float("nan")

    def receive(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            own = dict(self.model.named_parameters())
            for k, v in state.items():
                own[k].copy_(v)

    def step_scores(self, batch: dict) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        return fedgnn_forward(self.model, batch, self.family), batch

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        out, rows = self.step_scores(batch)
        if self.family == "nc":
            loss = bce_node_loss(out[0], rows["y"])
        else:
            loss = self.link_loss(*out, rows["ok"])
        self.last_loss = float(loss.detach())
        return loss


class FedGNNClient(TableClient):
    """One client's fit of :class:`FedGNNModel`; ``clip`` bounds each gradient's norm."""

    def __init__(
        self, model: FedGNNModel, family: str, lr: float = 0.01, clip: float = 0.1
    ) -> None:
        super().__init__(model, family, lr)
        self.clip = clip

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.copy_(clip_norm(p.grad, self.clip))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        keys = set(FAMILY_KEYS[self.family]) | {"items"}
        params = [p for n, p in self.model.named_parameters() if n in keys]
        return torch.optim.SGD(params, lr=self.lr)
