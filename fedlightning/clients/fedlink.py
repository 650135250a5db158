"""FedLink's client (docs/fedtip.md, "FedLink"): Adam over the whole local model (the
client's user rows, the item table, the GNN and, for node classification, the head); each
local step samples one chronological buffer of the client's support and predicts its edges
from the graph of the client's history plus the support events of earlier buffers.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor

from fedlightning.models.fedgnn import bce_node_loss, dot_scores
from fedlightning.models.fedlink import FedLinkModel, bce_link_loss

GNN_KEYS = "gnn."
FAMILY_HEAD = {"lp": (), "nc": ("head.weight", "head.bias")}


def dense_keys(model: FedLinkModel, family: str) -> tuple[str, ...]:
    """The dense parameters a family trains and sends: the GNN's (and the node head)."""
    gnn = tuple(n for n, _ in model.named_parameters() if n.startswith(GNN_KEYS))
    return gnn + FAMILY_HEAD[family]


def fedlink_forward(model: FedLinkModel, buf: dict[str, Tensor], family: str) -> tuple[Tensor, ...]:
    """One buffer's scores: ``lp`` positive and negative logits, ``nc`` node logits."""
    z_u, z_i = model.embed(buf["a_ui"], buf["a_iu"], buf.get("rows"))
    zu = z_u[buf["u"]]
    if family == "nc":
        return (model.head(zu).squeeze(-1),)
    return dot_scores(zu, z_i[buf["i"]]), dot_scores(zu, z_i[buf["j"]])


class FedLinkClient(pl.LightningModule):
    """One client's fit (module docstring); the batch is ``{"buffers": [...]}``."""

    def __init__(self, model: FedLinkModel, family: str, lr: float = 1e-3) -> None:
        super().__init__()
        self.model, self.family, self.lr = model, family, lr
        self.last_loss = float("nan")

    def receive(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            own = dict(self.model.named_parameters())
            for k, v in state.items():
                own[k].copy_(v)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        buffers = batch["buffers"]
        buf = buffers[int(torch.randint(len(buffers), (1,)))]
        out = fedlink_forward(self.model, buf, self.family)
        if self.family == "nc":
            loss = bce_node_loss(out[0], buf["y"])
        else:
            loss = bce_link_loss(*out, buf["ok"])
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        keys = set(dense_keys(self.model, self.family)) | {"users", "items"}
        params = [p for n, p in self.model.named_parameters() if n in keys]
        return torch.optim.Adam(params, lr=self.lr)
