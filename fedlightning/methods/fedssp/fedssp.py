"""FedSSP: Tan et al., FedSSP: Federated Graph Learning with Spectral Knowledge and
Personalized Preference, NeurIPS 2024; at node level in the class-incremental stream, as a
composition (docs/fedogl.md, "FedSSP")."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fedssp.fedssp_client import FedSSPClassifier
from fedlightning.methods.fedssp.fedssp_server import (
    GLOBAL_MEAN_FIELD,
    MEAN_FIELD,
    GlobalMean,
    uniform_average,
)
from fedlightning.methods.fedssp.spectral import SHARED_PREFIXES
from fedlightning.methods.personalized.personalized import PersonalizedContinual
from fedlightning.server import Server
from fedlightning.server.validation import Field, MessageSpec


class FedSSP(PersonalizedContinual):
    """FedSSP with FedOGL's adaptation rule (replay budget, MSP rejection).

    GSKS: only the spectral encoders (``eig_encoder.*`` and ``filter_encoder.*`` of
    :class:`~fedlightning.methods.fedssp.spectral.SpectralGNN`, the parameters FedSSP's code shares)
    travel and are averaged uniformly; modality encoders, eigenvalue attention and decoder,
    message-passing weights, preference vector ``b_k`` and head stay on the client. PGPA: the logits ``W(g + b_k)`` and the alignment of the client's running
    mean representation to the server's mean of means
    (:class:`~fedlightning.methods.fedssp.fedssp_client.FedSSPClassifier`). Uplink: the encoder, ``mean``
    (``hidden`` floats) and ``num_examples``.

    Args:
        tau_mean: PGPA's alignment weight (FedSSP: 100).
        momentum: the running mean's momentum (FedSSP: 0.5).
        replay_budget, score, ...: as
            :class:`~fedlightning.methods.continual.continual.ContinualFedAvg`.
    """

    def __init__(
        self,
        tau_mean: float = 100.0,
        momentum: float = 0.5,
        name: str = "fedssp",
        variant: str = "replay",
        replay_budget: int = 20,
        **kw: Any,
    ) -> None:
        if tau_mean < 0:
            raise ConfigError("algorithm.tau_mean", f"must be >= 0, got {tau_mean}")
        if not 0 <= momentum < 1:
            raise ConfigError("algorithm.momentum", f"must lie in [0, 1), got {momentum}")
        super().__init__(name=name, variant=variant, replay_budget=replay_budget, **kw)
        self.tau_mean, self.momentum = float(tau_mean), float(momentum)
        self.width = 0

    def client_module(self, net: nn.Module, optimizer: Any) -> FedSSPClassifier:
        if not hasattr(net, "filter_encoder"):
            raise ConfigError(
                "model",
                f"FedSSP needs its spectral GNN, got {type(net).__name__}: use model=spectral_gnn",
            )
        module = FedSSPClassifier(
            net, optimizer, tau_mean=self.tau_mean, momentum=self.momentum,
            **self.retention_kwargs(),
        )  # fmt: skip
        self.init_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        self.width = int(net.hidden)
        return module

    def shared(self, key: str) -> bool:
        """GSKS: the spectral encoders alone."""
        return key.startswith(SHARED_PREFIXES)

    def server(self, global_state: dict) -> Server:
        modules = {"mean": GlobalMean()}
        return Server(self.shared_state(global_state), uniform_average, modules, **self.bounds())

    def uplink(self, broadcast: ServerBroadcast) -> MessageSpec:
        """The encoder's fields (all of them), ``num_examples`` and ``mean`` (``[hidden]``)."""
        spec = super().uplink(broadcast)
        return MessageSpec(
            (*spec.fields, Field(MEAN_FIELD, shape=(self.width,))),
            rules=spec.rules,
            reference=broadcast,
        )

    def prepare(self, module: Any, client: FederatedClient, broadcast: ServerBroadcast) -> Any:
        batch = super().prepare(module, client, broadcast)
        module.set_global_mean(broadcast.tensors.get(GLOBAL_MEAN_FIELD))
        return batch

    def finish(
        self, module: Any, client: FederatedClient, broadcast: ServerBroadcast, batch: Any
    ) -> ClientUpdate:
        update = super().finish(module, client, broadcast, batch)
        mean = module.final_mean(batch)
        update.tensors[MEAN_FIELD] = mean.clone()
        return update
