"""FedAvg: McMahan et al., Communication-Efficient Learning of Deep Networks from
Decentralized Data, AISTATS 2017."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from fedlightning.clients import NodeClassifier
from fedlightning.federation.algorithm import Algorithm, FederatedClient
from fedlightning.federation.stacking import fit_stacked
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.server.aggregate import model_state


class FedAvg(Algorithm):
    """Local cross-entropy training; the server averages models weighted by training nodes."""

    name = "fedavg"

    def client_module(self, net: nn.Module, optimizer: Any) -> NodeClassifier:
        return NodeClassifier(net, optimizer)

    def local_fit_share(
        self,
        module: NodeClassifier,
        clients: Sequence[FederatedClient],
        broadcast: ServerBroadcast,
        executor: Any,
        epochs: int,
        seeds: Sequence[int],
    ) -> list[ClientUpdate]:
        """:meth:`local_fit` of ``clients`` as one stacked fit (client ``k``'s dropout seeded
        by ``seeds[k]``): their updates, in order (docs/scaling.md, "Stacked graph clients")."""
        module.receive(model_state(broadcast.tensors))
        graphs = [c.data for c in clients]
        fitted = fit_stacked(module, graphs, executor, epochs, self.callbacks(), seeds)
        return [
            self.make_update(fitted.load(module, k), c, broadcast.round)
            for k, c in enumerate(clients)
        ]
