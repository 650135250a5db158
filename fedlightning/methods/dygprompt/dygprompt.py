"""DyGPrompt as FedTIP's Table 3 comparator (paper 001, Sec. 5.3), centralised
(``dygprompt_central``) or FedAvg (``dygprompt_fedavg``) on FedTIP's task loop; the readings
chosen: docs/fedtip.md, "DyGPrompt (Table 3)"."""

from __future__ import annotations

from dataclasses import dataclass

from fedlightning.errors import ConfigError
from fedlightning.methods.dygprompt.dygprompt_client import DyGPromptClient
from fedlightning.methods.dygprompt.dygprompt_model import INITS, DyGPromptModule
from fedlightning.methods.fedtip.fedtip import FedTIP


@dataclass
class DyGPrompt(FedTIP):
    """One DyGPrompt row; ``lr`` the prompts' step, ``cn_lr`` the condition-nets'. A FedTIP
    configuration with its own adapter: it keeps FedTIP's stacked fit, Eq. (2) message and
    ``lambda_p``, so it reads FedTIP's settings where they live (fedtip.yaml)."""

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
