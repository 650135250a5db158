"""FedSage+'s generator client (docs/fedtip.md, "FedSage+")."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor

from fedlightning.methods.fedsage.fedsage_model import NeighGen, degree_loss, greedy_feature_loss


def generator_loss(gen: NeighGen, batch: dict[str, Tensor], lambda_feat: float = 1.0) -> Tensor:
    """``L_deg + lambda L_feat``, fGen run only where ``L_feat`` reads it."""
    kept, missing = batch["kept"], batch["missing"]
    rows, owner = torch.unique(missing[0], return_inverse=True)  # fGen where L_feat reads it
    deg, feats = gen(batch["x"], batch["impaired"], rows)
    loss = degree_loss(deg, missing, kept, gen.num_pred)
    targets = batch.get("targets", batch["x"])  # the hidden neighbours' features
    local = torch.stack([owner, missing[1]])
    return loss + lambda_feat * greedy_feature_loss(feats, targets, local, kept)


class NeighGenClient(pl.LightningModule):
    """One client's NeighGen fit (Adam ``lr``)."""

    def __init__(self, gen: NeighGen, lr: float = 1e-3, lambda_feat: float = 1.0) -> None:
        super().__init__()
        self.gen, self.lr, self.lambda_feat = gen, lr, lambda_feat
        self.last_loss = float("nan")

    def receive(self, state: dict[str, Tensor]) -> None:
        self.gen.load_state_dict(state)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = generator_loss(self.gen, batch, self.lambda_feat)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.gen.parameters(), lr=self.lr)
