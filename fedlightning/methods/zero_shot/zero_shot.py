r"""The zero-shot row of FedTIP's tables: the frozen bank scored by its own similarity
template (paper 001, Eq. 10), on the same tasks, negatives and segments as FedTIP, with no
training and nothing sent (docs/fedtip.md, "Does the adapter learn?").

The prompted representation of Eq. (16) is replaced by the bank's source state,
:math:`\tilde{\mathbf{h}}_{u,v,t} = \mathbf{h}_u^{t^-}`, so link prediction scores
:math:`s(\mathbf{h}_u, \mathbf{h}_i)` against :math:`s(\mathbf{h}_u, \mathbf{h}_j)`: the
pre-training score of Eq. (10), which needs nothing from the clients. Node classification
scores :math:`s(\mathbf{h}_u, \mathbf{q}_1) - s(\mathbf{h}_u, \mathbf{q}_0)` against the
class means (Eq. 18) of the bank states of the task's pooled support, as
``prompt_central`` pools it: the labels reach the server raw, no message is counted and no
client is sent the bank, so the ledger's uplink is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedlightning.clients.temporal_prompt import family_prototypes, family_views, stack_batches
from fedlightning.federation.task_loop import TaskBatches, TaskContext
from fedlightning.methods.fedtip.fedtip import FedTIP


class BankTemplate(nn.Module):
    r"""Eq. (16) replaced by the bank's template: :math:`\tilde{\mathbf{h}} = \mathbf{h}_u`
    (``d_h`` wide), with the :class:`~fedlightning.temporal.adapter.PromptAdapter`'s call
    signature and no parameter."""

    def __init__(self, d_h: int) -> None:
        super().__init__()
        self.d_h = d_h

    def forward(
        self, h_u: Tensor, h_i: Tensor, te: Tensor, x: Tensor, delta_u: Tensor, delta_i: Tensor
    ) -> Tensor:
        return h_u

    def num_values(self) -> int:
        """No value trains or travels."""
        return 0


@dataclass
class ZeroShot(FedTIP):
    """``algorithm=zero_shot`` (module docstring): FedTIP's protocol and metrics, the bank's
    template for the adapter, no training, no message."""

    name: str = "zero_shot"
    mode: str = "zero_shot"
    anchors: bool = False
    aggregation: str = "fedavg"
    modes = ("zero_shot",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pooled = True  # the pooled support's class means: no message, no bank sent

    def task_module(self, adapter: nn.Module, family: str) -> None:
        """Nothing trains."""
        return None

    @torch.no_grad()
    def pooled_fit(
        self,
        context: TaskContext,
        task: TaskBatches,
        family: str,
        module: None,
        adapter: BankTemplate,
        rounds: int,
    ) -> tuple[BankTemplate, dict[int, Tensor]]:
        """Nothing fitted: the bank template and the class means of the pooled support."""
        supports = list(task.clients.values())
        pooled = stack_batches([{k: torch.cat([b[k] for b in supports]) for k in supports[0]}])
        q, counts = family_prototypes(family_views(adapter, pooled, family), family)
        return adapter, {c: q[0, c] for c in range(q.size(1)) if counts[0, c] > 0}

    def adapter(self, d_h: int, d_t: int, d_e: int) -> BankTemplate:
        return BankTemplate(d_h)

    def message_fields(self, family: str) -> tuple[str, ...]:
        """Nothing is sent."""
        return ()

    def message_size(self, adapter: nn.Module, family: str, classes: int = 2) -> int:
        return 0
