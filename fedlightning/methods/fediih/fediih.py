"""FedIIH: Yu et al., Modeling Inter-Intra Heterogeneity for Graph Federated Learning, AAAI
2025; at node level in the class-incremental stream, as a composition (docs/fedogl.md,
"FedIIH")."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedlightning.clients.continual_client import ContinualNodeClassifier
from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fediih.fediih_server import (
    LOGVAR_FIELD,
    MU_FIELD,
    PERSONAL_PREFIX,
    FactorMixing,
    fediih_average,
)
from fedlightning.methods.personalized.personalized import PersonalizedContinual
from fedlightning.server import Server
from fedlightning.server.aggregate import model_state, strip_prefix
from fedlightning.server.validation import Field, MessageSpec


class FedIIH(PersonalizedContinual):
    """FedIIH with FedOGL's adaptation rule (replay budget, MSP rejection).

    Clients train :class:`~fedlightning.methods.fediih.disentangled.DisentangledGNN` with the
    class-incremental CE and send the whole model plus, per factor, the Gaussian of their
    routed factor representations (``posterior.mu``, ``posterior.logvar``, ``[K, d]``
    each). The server averages the model (FedAvg) and, per factor, mixes the factor's weight
    blocks with the posteriors' similarity weights
    (:class:`~fedlightning.methods.fediih.fediih_server.FactorMixing`); client ``i`` loads the average with
    its own blocks, ``personal.<i>.*``, over it.

    Args:
        scale: the similarity's temperature in ``exp(scale * S)`` (FedIIH: 10).
        replay_budget, score, ...: as
            :class:`~fedlightning.methods.continual.continual.ContinualFedAvg`.
    """

    def __init__(
        self,
        scale: float = 10.0,
        name: str = "fediih",
        variant: str = "replay",
        replay_budget: int = 20,
        **kw: Any,
    ) -> None:
        if scale < 0:
            raise ConfigError("algorithm.scale", f"must be >= 0, got {scale}")
        super().__init__(name=name, variant=variant, replay_budget=replay_budget, **kw)
        self.scale = float(scale)
        self.axes: dict[str, int] = {}
        self.factors, self.factor_dim = 1, 0

    def client_module(self, net: nn.Module, optimizer: Any) -> ContinualNodeClassifier:
        if not hasattr(net, "factor_axes"):
            raise ConfigError(
                "model",
                f"FedIIH needs its disentangled GNN, got {type(net).__name__}: "
                "use model=disentangled_gnn",
            )
        module = super().client_module(net, optimizer)
        self.axes, self.factors = net.factor_axes(), int(net.factors)
        self.factor_dim = int(net.hidden) // self.factors
        return module

    def server(self, global_state: dict) -> Server:
        mixing = FactorMixing(self.axes, self.factors, self.scale)
        return Server(global_state, fediih_average, {"factors": mixing}, **self.bounds())

    def received(self, client: FederatedClient, broadcast: ServerBroadcast) -> dict:
        """The global model with the client's personalized factor blocks over it."""
        own = strip_prefix(broadcast.tensors, f"{PERSONAL_PREFIX}{client.client_id}.")
        return {**model_state(broadcast.tensors), **own}

    def uplink(self, broadcast: ServerBroadcast) -> MessageSpec:
        """FedAvg's fields and the posteriors ``posterior.mu``, ``posterior.logvar`` (``[K, d]``)."""
        spec = super().uplink(broadcast)
        shape = (self.factors, self.factor_dim)
        return MessageSpec(
            (*spec.fields, Field(MU_FIELD, shape=shape), Field(LOGVAR_FIELD, shape=shape)),
            rules=spec.rules,
            reference=broadcast,
        )

    @torch.no_grad()
    def finish(
        self, module: Any, client: FederatedClient, broadcast: ServerBroadcast, batch: Any
    ) -> ClientUpdate:
        update = super().finish(module, client, broadcast, batch)
        was = module.net.training
        module.net.eval()
        mu, logvar = module.net.posterior(batch, batch.sup_mask | batch.replay_mask)
        module.net.train(was)
        update.tensors[MU_FIELD], update.tensors[LOGVAR_FIELD] = mu.clone(), logvar.clone()
        return update
