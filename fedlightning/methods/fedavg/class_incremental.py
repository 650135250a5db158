"""A method of the FedAvg family (FedAvg, FedProx, SCAFFOLD) in the class-incremental stream,
by composition: the stream's stage wiring around the method's own fit, messages and server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from fedlightning.clients import NodeClassifier
from fedlightning.clients.continual_client import ContinualNodeClassifier
from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import Algorithm, FederatedClient
from fedlightning.federation.stacking import defined_by
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.continual.continual import ContinualFedAvg
from fedlightning.server import Server
from fedlightning.server.validation import MessageSpec


class ClassIncremental(Algorithm):
    """``method``'s own fit, messages and server on each client's stage batch, through the
    known-class head (Eq. 5 without replay or teacher) and ``cil_fedavg``'s stage wiring."""

    continual = True
    score = "msp"

    def __init__(self, method: Algorithm) -> None:
        self.method = method
        self.name, self.variant = method.name, method.variant
        self.max_update_norm, self.max_client_weight = method.bounds().values()
        self.report_train_loss = method.report_train_loss
        self.stages = ContinualFedAvg(method.name, method.variant)
        fit, share = defined_by(method, "local_fit"), defined_by(method, "local_fit_share")
        if method.local_fit_share is None or (fit is not share and issubclass(fit, share)):
            self.local_fit_share = None  # the stack follows the method's own fit

    def setup(self, stream: Any, rounds_per_stage: int, seed: int, num_classes: int) -> None:
        self.stages.setup(stream, rounds_per_stage, seed, num_classes)

    def client_module(self, net: nn.Module, optimizer: Any) -> ContinualNodeClassifier:
        plain = self.method.client_module(net, optimizer)
        if type(plain) is not NodeClassifier:
            raise ConfigError(
                "algorithm",
                f"{self.name!r} trains a {type(plain).__name__}, which has no class-incremental "
                "form; with protocol=cil use a cil_* algorithm",
            )
        self.stages.prox_mu = plain.prox_mu
        return self.stages.client_module(net, optimizer)

    def callbacks(self) -> list:
        return self.method.callbacks()

    def server(self, global_state: dict) -> Server:
        return self.method.server(global_state)

    def uplink(self, broadcast: ServerBroadcast) -> MessageSpec:
        return self.method.uplink(broadcast)

    def downlink(self, global_state: dict) -> MessageSpec:
        return self.method.downlink(global_state)

    def check_optimizer(self, optimizer: Any) -> str | None:
        return self.method.check_optimizer(optimizer)

    def local_fit(
        self,
        module: ContinualNodeClassifier,
        client: FederatedClient,
        broadcast: ServerBroadcast,
        executor: Any,
        epochs: int,
    ) -> ClientUpdate:
        batch = self.stages.prepare(module, client, broadcast)
        update = self.method.local_fit(module, at_stage(client, batch), broadcast, executor, epochs)
        return weighted(update, batch)

    def local_fit_share(
        self,
        module: ContinualNodeClassifier,
        clients: Sequence[FederatedClient],
        broadcast: ServerBroadcast,
        executor: Any,
        epochs: int,
        seeds: Sequence[int],
    ) -> list[ClientUpdate]:
        batches = [self.stages.prepare(module, c, broadcast) for c in clients]
        views = [at_stage(c, b) for c, b in zip(clients, batches, strict=True)]
        updates = self.method.local_fit_share(module, views, broadcast, executor, epochs, seeds)
        return [weighted(u, b) for u, b in zip(updates, batches, strict=True)]


def at_stage(client: FederatedClient, batch: Any) -> FederatedClient:
    return FederatedClient(client.client_id, batch, client.state)


def weighted(update: ClientUpdate, batch: Any) -> ClientUpdate:
    """``update`` weighted by the stage's supervised and replayed nodes."""
    update.scalars["num_examples"] = float(int(batch.sup_mask.sum()) + int(batch.replay_mask.sum()))
    return update
