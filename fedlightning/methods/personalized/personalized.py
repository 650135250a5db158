"""Personalized class-incremental baselines (FedSSP, FedIIH): clients keep their own model
between rounds and exchange only part of it; evaluation runs each client's own model (``personalized``: the schedule evaluates each client
with :meth:`PersonalizedContinual.eval_state`)."""

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
    """:class:`~fedlightning.methods.continual.continual.ContinualFedAvg` whose clients keep their
    whole model in their state (``state["local"]``, checkpointed) and load over it, at each
    fit, only what the broadcast carries for them (:meth:`received`); they send back only the
    weights :meth:`shared` names. Retention is FedOGL's adaptation rule for non-continual
    methods: the shared class-balanced replay budget, MSP rejection (no teacher).

    Every client starts from the same seeded initial model (captured by
    :meth:`client_module`, which every process calls on the freshly built net).
    """

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
        """The model ``client`` starts a fit from: its own (the initial model before its
        first fit) with :meth:`received` loaded over it."""
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
        """The :meth:`shared` weights (and ``num_examples``, set by :meth:`finish`)."""
        state = {k: v for k, v in module.net.state_dict().items() if self.shared(k)}
        scalars = {"num_examples": float(client.num_train)}
        if self.report_train_loss:
            scalars["train_loss"] = module.last_loss
        return ClientUpdate(round, as_model_fields(detach_state(state)), scalars, client.client_id)

    def shared_state(self, global_state: dict) -> dict:
        """The part of the initial model the server holds."""
        return {k: v for k, v in global_state.items() if self.shared(k)}
