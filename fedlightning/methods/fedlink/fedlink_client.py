"""FedLink's client (docs/fedtip.md, "FedLink"): Adam over the whole local model (the
client's user rows, the item table, the GNN and, for node classification, the head); each
local step samples one chronological buffer of the client's support and predicts its edges
from the graph of the client's history plus the support events of earlier buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedlightning.methods.fedgnn.fedgnn_client import TableClient
from fedlightning.methods.fedgnn.fedgnn_model import dot_scores
from fedlightning.methods.fedlink.fedlink_model import FedLinkModel, bce_link_loss

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


class FedLinkClient(TableClient):
    """One client's fit (module docstring); the batch is ``{"buffers": [...]}``."""

    link_loss = staticmethod(bce_link_loss)

    def __init__(self, model: FedLinkModel, family: str, lr: float = 1e-3) -> None:
        super().__init__(model, family, lr)

    def step_scores(self, batch: dict) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        """The scores of one buffer of the support, drawn at random."""
        buffers = batch["buffers"]
        buf = buffers[int(torch.randint(len(buffers), (1,)))]
        return fedlink_forward(self.model, buf, self.family), buf

    def configure_optimizers(self) -> torch.optim.Optimizer:
        keys = set(dense_keys(self.model, self.family)) | {"users", "items"}
        params = [p for n, p in self.model.named_parameters() if n in keys]
        return torch.optim.Adam(params, lr=self.lr)
