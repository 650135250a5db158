"""FedAvg: McMahan et al., Communication-Efficient Learning of Deep Networks from
Decentralized Data, AISTATS 2017."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedlightning.clients import NodeClassifier
from fedlightning.federation.algorithm import Algorithm


class FedAvg(Algorithm):
    """Local cross-entropy training; the server averages models weighted by training nodes."""

    name = "fedavg"

    def client_module(self, net: nn.Module, optimizer: Any) -> NodeClassifier:
        return NodeClassifier(net, optimizer)
