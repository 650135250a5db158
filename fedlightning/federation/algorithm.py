"""What a federated method declares (:class:`Algorithm`), and a client's persistent state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import lightning.pytorch as pl
from torch import nn
from torch_geometric.data import Data

from fedlightning.messages import ClientUpdate, ServerBroadcast, detach_state
from fedlightning.server import Server
from fedlightning.server.aggregate import as_model_fields, model_state


@dataclass
class FederatedClient:
    """Client ``client_id`` (``0..K-1``): its subgraph ``data`` (with ``train_mask``,
    ``val_mask``, ``test_mask``) and the ``state`` it keeps between rounds, checkpointed
    whole (methods add entries: replay memory, teacher weights, ...)."""

    client_id: int
    data: Data
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_train(self) -> int:
        return int(self.data.train_mask.sum())


class Algorithm:
    """The verbs a federated method declares; the schedules and the round call only these.

    Every verb has a default, so a method overrides what it changes (docs/architecture.md,
    "Adding a method"). :meth:`stage_end_update` is asked only when
    :attr:`stage_end_exchange` is true.

    Attributes:
        name, variant: the ``method`` and ``variant`` tags of a run.
        continual: the method needs the class-incremental stream (``protocol=cil``).
        stage_end_exchange: the method exchanges messages after every stage.
        loop_class: the schedule that runs the method (``None``: the protocol's own,
            :class:`~fedlightning.federation.loop.FederatedLoop` or
            :class:`~fedlightning.federation.stages.ContinualLoop`).
    """

    name = "base"
    variant = "full"
    continual: ClassVar[bool] = False
    stage_end_exchange: ClassVar[bool] = False
    loop_class: ClassVar[type | None] = None

    def client_module(self, net: nn.Module, optimizer: Any) -> pl.LightningModule:
        raise NotImplementedError

    def callbacks(self) -> list[pl.Callback]:
        return []

    def server(self, global_state: dict) -> Server:
        """The method's server; by default FedAvg aggregation and no modules."""
        return Server(global_state)

    def setup(self, stream: Any, rounds_per_stage: int, seed: int, num_classes: int) -> None:
        """Learn the stream's schedule before the first round (class-incremental methods)."""

    def make_update(
        self, module: pl.LightningModule, client: FederatedClient, round: int
    ) -> ClientUpdate:
        """The uplink message: the model (parameters and buffers) and two scalars."""
        return ClientUpdate(
            round=round,
            client_id=client.client_id,
            tensors=as_model_fields(detach_state(module.net.state_dict())),
            scalars={"num_examples": float(client.num_train), "train_loss": module.last_loss},
        )

    def local_fit(
        self,
        module: pl.LightningModule,
        client: FederatedClient,
        broadcast: ServerBroadcast,
        executor: Any,
        epochs: int,
    ) -> ClientUpdate:
        """Receive the broadcast, train locally for ``epochs`` steps, return the update."""
        module.receive(model_state(broadcast.tensors))
        executor.fit(module, client.data, epochs, self.callbacks())
        return self.make_update(module, client, broadcast.round)

    def stage_end_update(
        self, module: Any, client: FederatedClient, broadcast: ServerBroadcast, stage: int
    ) -> ClientUpdate | None:
        """A client's stage-end message (``None``: it sends nothing)."""
        return None
