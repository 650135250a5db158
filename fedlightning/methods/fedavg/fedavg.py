"""FedAvg: McMahan et al., Communication-Efficient Learning of Deep Networks from
Decentralized Data, AISTATS 2017."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from fedlightning.clients import NodeClassifier
from fedlightning.federation.algorithm import Algorithm, FederatedClient, check_bounds
from fedlightning.federation.stacking import fit_stacked
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.server.aggregate import model_state


class FedAvg(Algorithm):
    """Local cross-entropy, models averaged by training nodes; the bounds: docs/security.md."""

    name = "fedavg"

    def __init__(
        self, max_update_norm: float | None = None, max_client_weight: float | None = None
    ) -> None:
        self.max_update_norm, self.max_client_weight = check_bounds(
            max_update_norm, max_client_weight
        )

    def client_module(self, net: nn.Module, optimizer: Any) -> NodeClassifier:
        return NodeClassifier(net, optimizer)

    def class_incremental(self) -> Algorithm:
        from fedlightning.methods.fedavg.class_incremental import ClassIncremental

        return ClassIncremental(self)

    def local_fit_share(
        self,
        module: NodeClassifier,
        clients: Sequence[FederatedClient],
        broadcast: ServerBroadcast,
        executor: Any,
        epochs: int,
        seeds: Sequence[int],
    ) -> list[ClientUpdate]:
        """:meth:`local_fit` of ``clients`` as one stacked fit (docs/scaling.md)."""
        module.receive(model_state(broadcast.tensors))
        graphs = [c.data for c in clients]
        fitted = fit_stacked(module, graphs, executor, epochs, self.callbacks(), seeds)
        return [
            self.make_update(fitted.load(module, k), c, broadcast.round)
            for k, c in enumerate(clients)
        ]
