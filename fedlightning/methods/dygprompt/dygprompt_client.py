r"""DyGPrompt's local fit: the similarity template of its Eq. (11) on the prompted
representations of every node of an event.

.. math::
    \mathcal{L} = -\sum_{(v, t, y)} \ln \frac{\exp(\mathrm{sim}(\tilde{\mathbf{h}}_{t,v},
    \bar{\mathbf{h}}_{y})/\tau)}{\sum_{c} \exp(\mathrm{sim}(\tilde{\mathbf{h}}_{t,v},
    \bar{\mathbf{h}}_{c})/\tau)}

for node classification (class prototypes :math:`\bar{\mathbf{h}}_c` of the support: FedTIP's
prototypical loss, Eqs. 18-19 of paper 001), and for link prediction the same softmax over the
prompted destination and the prompted negative (FedTIP's two-way loss, Eqs. 20-21, with both
ends prompted). Cosine similarity, :math:`\tau` from the config. Adam with the released code's
two step sizes: ``lr`` for the prompts, ``cn_lr`` for the condition-nets.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedlightning.clients.temporal_prompt import FedTIPClient, task_loss
from fedlightning.methods.dygprompt.dygprompt_model import DyGPromptModule
from fedlightning.temporal.adapter import proximal_adapter

Batch = dict[str, Tensor]


class DyGPromptClient(FedTIPClient):
    """FedTIP's stacked client (round start, stacking, dropout windows) with DyGPrompt's
    views (:meth:`DyGPromptModule.views`) and optimiser; no anchor term."""

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
