"""DyGPrompt's local fit: its Eq. (11) template on the prompted nodes, read as FedTIP's losses
(Eqs. 18-21 of paper 001); Adam with the released code's two step sizes."""

from __future__ import annotations

import torch
from torch import Tensor

from fedlightning.clients.temporal_prompt import FedTIPClient, task_loss
from fedlightning.methods.dygprompt.dygprompt_model import DyGPromptModule
from fedlightning.temporal.adapter import proximal_adapter

Batch = dict[str, Tensor]


class DyGPromptClient(FedTIPClient):
    """FedTIP's stacked client with DyGPrompt's views and optimiser; no anchor term."""

    def __init__(
        self,
        adapter: DyGPromptModule,
        family: str,
        tau: float = 0.1,
        lambda_p: float = 0.0,
        lr: float = 1e-2,
        cn_lr: float = 1e-3,
        weight_decay: float = 1e-5,
    ) -> None:
        super().__init__(adapter, family, tau, lambda_p, 0.0, lr, weight_decay)
        self.cn_lr = cn_lr

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = task_loss(self.adapter.views(batch, self.family), self.family, self.tau)
        if self.lambda_p:
            loss = loss + self.lambda_p * proximal_adapter(self.adapter, self.start)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        prompts, nets = self.adapter.groups()
        return torch.optim.Adam(
            [{"params": prompts, "lr": self.lr}, {"params": nets, "lr": self.cn_lr}],
            weight_decay=self.weight_decay,
            foreach=True,
        )
