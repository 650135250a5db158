"""FedTIP's zero-shot row: the frozen bank scored by its own template (paper 001, Eq. 10), no
training, nothing sent; node classification by the pooled support's class means (docs/fedtip.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedlightning.clients.temporal_prompt import family_prototypes, family_views, stack_batches
from fedlightning.federation.task_loop import TaskBatches, TaskContext
from fedlightning.methods.temporal_base.temporal_base import TemporalMethod


class BankTemplate(nn.Module):
    """Eq. (16) replaced by ``h_u``, in the adapter's call signature, no parameter."""

    def __init__(self, d_h: int) -> None:
        super().__init__()
        self.d_h = d_h

    def forward(
        self, h_u: Tensor, h_i: Tensor, te: Tensor, x: Tensor, delta_u: Tensor, delta_i: Tensor
    ) -> Tensor:
        return h_u

    def num_values(self) -> int:
        return 0


@dataclass
class ZeroShot(TemporalMethod):
    """``algorithm=zero_shot``: FedTIP's protocol with the bank's template, no message."""

    name: str = "zero_shot"
    mode: str = "zero_shot"
    modes = ("zero_shot",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pooled = True  # the pooled support's class means: no message, no bank sent

    def task_module(self, adapter: nn.Module, family: str) -> None:
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
        """The bank template and the pooled support's class means."""
        supports = list(task.clients.values())
        pooled = stack_batches([{k: torch.cat([b[k] for b in supports]) for k in supports[0]}])
        q, counts = family_prototypes(family_views(adapter, pooled, family), family)
        return adapter, {c: q[0, c] for c in range(q.size(1)) if counts[0, c] > 0}

    def adapter(self, d_h: int, d_t: int, d_e: int) -> BankTemplate:
        return BankTemplate(d_h)

    def message_fields(self, family: str) -> tuple[str, ...]:
        return ()

    def message_size(self, adapter: nn.Module, family: str, classes: int = 2) -> int:
        return 0
