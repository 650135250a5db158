"""FedProx: Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedlightning.clients import NodeClassifier
from fedlightning.errors import ConfigError
from fedlightning.methods.fedavg.fedavg import FedAvg


class FedProx(FedAvg):
    """FedAvg plus the proximal term ``mu/2 ||w - w^t||^2`` on the client."""

    name = "fedprox"

    def __init__(
        self,
        mu: float = 0.01,
        max_update_norm: float | None = None,
        max_client_weight: float | None = None,
    ) -> None:
        super().__init__(max_update_norm, max_client_weight)
        if mu < 0:
            raise ConfigError("algorithm.mu", f"must be >= 0, got {mu}")
        self.mu = float(mu)

    def client_module(self, net: nn.Module, optimizer: Any) -> NodeClassifier:
        return NodeClassifier(net, optimizer, prox_mu=self.mu)
