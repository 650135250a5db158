"""FedLink's client (docs/fedtip.md, "FedLink"): Adam over the local model, each step on one
random chronological buffer."""

from __future__ import annotations

import torch
from torch import Tensor

from fedlightning.methods.fedgnn.fedgnn_client import TableClient
from fedlightning.methods.fedgnn.fedgnn_model import dot_scores
from fedlightning.methods.fedlink.fedlink_model import FedLinkModel, bce_link_loss

GNN_KEYS = "gnn."
FAMILY_HEAD = {"lp": (), "nc": ("head.weight", "head.bias")}


def dense_keys(model: FedLinkModel, family: str) -> tuple[str, ...]:
    """The dense parameters a family trains and sends."""
    gnn = tuple(n for n, _ in model.named_parameters() if n.startswith(GNN_KEYS))
    return gnn + FAMILY_HEAD[family]


def fedlink_forward(model: FedLinkModel, buf: dict[str, Tensor], family: str) -> tuple[Tensor, ...]:
    z_u, z_i = model.embed(buf["a_ui"], buf["a_iu"], buf.get("rows"))
    zu = z_u[buf["u"]]
    if family == "nc":
        return (model.head(zu).squeeze(-1),)
    return dot_scores(zu, z_i[buf["i"]]), dot_scores(zu, z_i[buf["j"]])


class FedLinkClient(TableClient):
    """One client's fit on ``{"buffers": [...]}``."""

    link_loss = staticmethod(bce_link_loss)

    def __init__(self, model: FedLinkModel, family: str, lr: float = 1e-3) -> None:
        super().__init__(model, family, lr)

    def step_scores(self, batch: dict) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        buffers = batch["buffers"]
        buf = buffers[int(torch.randint(len(buffers), (1,)))]
        return fedlink_forward(self.model, buf, self.family), buf

    def configure_optimizers(self) -> torch.optim.Optimizer:
        keys = set(dense_keys(self.model, self.family)) | {"users", "items"}
        params = [p for n, p in self.model.named_parameters() if n in keys]
        return torch.optim.Adam(params, lr=self.lr)
