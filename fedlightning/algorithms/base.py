"""The client procedure shared by the algorithms, and a client's persistent state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch_geometric.data import Data

from fedlightning.federation.messages import ClientUpdate, ServerBroadcast, detach_state
from fedlightning.server import Server
from fedlightning.server.aggregate import as_model_fields, model_state


@dataclass
class FederatedClient:
    """One client: its private data and the state it keeps between rounds.

    ``state`` is what a checkpoint saves for the client. Methods add entries (replay
    memory, teacher weights, a local basis, a prompt adapter, optimizer state) and never
    change the checkpoint format: everything in it is saved and restored as it is.

    Args:
        client_id: index ``0..K-1``.
        data: the client's subgraph with ``train_mask``, ``val_mask``, ``test_mask``.
        state: persistent, checkpointed client state (default empty).
    """

    client_id: int
    data: Data
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_train(self) -> int:
        return int(self.data.train_mask.sum())


class Algorithm:
    """Base wiring of a federated algorithm for node-level tasks.

    Subclasses choose the client module (:meth:`client_module`), its callbacks
    (:meth:`callbacks`), the server (:meth:`server`) and what the client sends
    (:meth:`make_update`). The round loop only calls these.

    Args:
        local_epochs: set from ``federation.local_epochs`` at build time.
    """

    name = "base"
    variant = "full"

    def client_module(self, net: nn.Module, optimizer: Any) -> pl.LightningModule:
        raise NotImplementedError

    def callbacks(self) -> list[pl.Callback]:
        return []

    def server(self, global_state: dict) -> Server:
        return Server(global_state)

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
