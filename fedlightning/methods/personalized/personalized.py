"""Personalized class-incremental baselines (FedSSP, FedIIH): clients keep their own model and
exchange part of it; each client is evaluated on its own (:meth:`eval_state`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedlightning.federation.algorithm import FederatedClient
from fedlightning.messages import ClientUpdate, ServerBroadcast, detach_state
from fedlightning.methods.continual.continual import ContinualFedAvg
from fedlightning.server.aggregate import as_model_fields, model_state

LOCAL = "local"  # the client-state entry holding its own model


class PersonalizedContinual(ContinualFedAvg):
    """Clients keep their model in ``state["local"]``, load :meth:`received` over it and send
    the :meth:`shared` weights; all start from the same seeded initial model."""

    personalized = True

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.init_state: dict[str, torch.Tensor] = {}

    def client_module(self, net: nn.Module, optimizer: Any) -> Any:
        module = super().client_module(net, optimizer)
        self.init_state = detach_state(net.state_dict())
        return module

    def shared(self, key: str) -> bool:
        """Whether the net's weight ``key`` travels (default: all)."""
        return True

    def received(self, client: FederatedClient, broadcast: ServerBroadcast) -> dict:
        """The weights ``client`` takes from ``broadcast`` (default: every ``model.`` field)."""
        return model_state(broadcast.tensors)

    def eval_state(self, client: FederatedClient, broadcast: ServerBroadcast) -> dict:
        """The client's own model (initially the shared one) with :meth:`received` over it."""
        own = client.state.get(LOCAL) or self.init_state
        return {**own, **self.received(client, broadcast)}

    def prepare(self, module: Any, client: FederatedClient, broadcast: ServerBroadcast) -> Any:
        t = self.stage_of(broadcast.round)
        state = self.eval_state(client, broadcast)
        if client.state.get("stage") != t:
            self.begin_stage(client, t, state)
        module.receive(state)
        known = torch.tensor(self.stream.known(t), dtype=torch.long)
        module.set_stage(known, client.state.get("teacher"), client.state.get("teacher_known"))
        return self.batch_at(client, t)

    def finish(
        self, module: Any, client: FederatedClient, broadcast: ServerBroadcast, batch: Any
    ) -> ClientUpdate:
        client.state[LOCAL] = detach_state(module.net.state_dict())
        return super().finish(module, client, broadcast, batch)

    def make_update(self, module: Any, client: FederatedClient, round: int) -> ClientUpdate:
        state = {k: v for k, v in module.net.state_dict().items() if self.shared(k)}
        scalars = {"num_examples": float(client.num_train)}
        if self.report_train_loss:
            scalars["train_loss"] = module.last_loss
        return ClientUpdate(round, as_model_fields(detach_state(state)), scalars, client.client_id)

    def shared_state(self, global_state: dict) -> dict:
        return {k: v for k, v in global_state.items() if self.shared(k)}
