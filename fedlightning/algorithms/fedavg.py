"""FedAvg: McMahan et al., Communication-Efficient Learning of Deep Networks from
Decentralized Data, AISTATS 2017."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedlightning.clients import NodeClassifier
from fedlightning.federation.algorithm import Algorithm, check_bounds


class FedAvg(Algorithm):
    """Local cross-entropy training; the server averages models weighted by training nodes.

    Args:
        max_update_norm: clip each client's update to this L2 norm around the broadcast
            global model (``None``: off; docs/security.md).
        max_client_weight: cap on a client's ``num_examples`` (``None``: off).
    """

    name = "fedavg"

    def __init__(
        self, max_update_norm: float | None = None, max_client_weight: float | None = None
    ) -> None:
        self.max_update_norm, self.max_client_weight = check_bounds(
            max_update_norm, max_client_weight
        )

    def client_module(self, net: nn.Module, optimizer: Any) -> NodeClassifier:
        return NodeClassifier(net, optimizer)
