"""DyGPrompt as FedTIP's Table 3 comparator (paper 001, Sec. 5.3): the centralised row pools
a task's support (``algorithm=dygprompt_central``), the direct FedAvg row averages the
client-trained prompts and condition-nets weighted by support (``algorithm=dygprompt_fedavg``),
on either bank (``bank=tgn`` or ``bank=tgat``), on FedTIP's task loop, segments and scorer.

What the papers leave open, and what is chosen here (docs/fedtip.md, "DyGPrompt (Table 3)"):
the prompts act on the bank's frozen outputs, not on the encoder's inputs
(:mod:`~fedlightning.methods.dygprompt.dygprompt_model`); one shared node prompt, not the
released code's per-node table (the protocol's inductive nodes have no row, and a table
would not be a federated message of fixed size); the downstream head is the paper's
similarity template (Eq. 11), scored by the protocol's cosine; ``init=identity`` starts at the
frozen states (``init=xavier``: the released code's start). The message is Eq. (2) of paper 001
without anchors or reliability: the delta of every DyGPrompt parameter and the class counts
(and, for node classification, the prototypes the server scores with).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedlightning.errors import ConfigError
from fedlightning.methods.dygprompt.dygprompt_client import DyGPromptClient
from fedlightning.methods.dygprompt.dygprompt_model import INITS, DyGPromptModule
from fedlightning.methods.fedtip.fedtip import FedTIP


@dataclass
class DyGPrompt(FedTIP):
    """One DyGPrompt row (module docstring): FedTIP's ``mode`` (``central`` or
    ``federated``) and ``aggregation`` (``fedavg``) with DyGPrompt's module and client.

    Args:
        bottleneck: the condition-nets' hidden width (released code: ``d / 4``).
        lr: Adam's step on the node and time prompts; cn_lr: on the condition-nets
            (released code: 1e-2 and 1e-3).
        init: :data:`~fedlightning.methods.dygprompt.dygprompt_model.INITS`.
        tau, lambda_p, dropout, weight_decay: as FedTIP's.
    """

    name: str = "dygprompt_fedavg"
    prototype_bound: float | None = None  # a published baseline runs as published
    aggregation: str = "fedavg"
    anchors: bool = False
    lambda_p: float = 0.0
    bottleneck: int = 16
    dropout: float = 0.0
    lr: float = 1e-2
    cn_lr: float = 1e-3
    init: str = "identity"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.anchors:
            raise ConfigError("algorithm.anchors", "DyGPrompt has no anchor prototypes: set false")
        if self.init not in INITS:
            raise ConfigError("algorithm.init", f"must be one of {INITS}, got {self.init!r}")

    def adapter(self, d_h: int, d_t: int, d_e: int) -> DyGPromptModule:  # type: ignore[override]
        """A task's initial prompts and condition-nets (the event features ``d_e`` are not
        DyGPrompt's inputs)."""
        try:
            return DyGPromptModule(d_h, d_t, self.bottleneck, self.dropout, init=self.init)
        except ValueError as e:
            raise ConfigError("algorithm", str(e)) from None

    def task_module(self, adapter: DyGPromptModule, family: str) -> DyGPromptClient:  # type: ignore[override]
        return DyGPromptClient(
            adapter,
            family,
            tau=self.tau,
            lambda_p=0.0 if self.mode == "central" else self.lambda_p,
            lr=self.lr,
            cn_lr=self.cn_lr,
            weight_decay=self.weight_decay,
        )
