"""FedMVP (Singha et al., ICCV 2025) in the class-incremental setting (docs/fedogl.md,
"FedMVP"): the prompted cosine classifier, its consistency term, the class text bank."""

from __future__ import annotations

from typing import Any

import torch

from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.messages import detach_state
from fedlightning.methods.class_bank.class_bank import ClassBankFedAvg
from fedlightning.methods.class_bank.class_bank_server import class_means
from fedlightning.methods.fedmvp.fedmvp_client import FedMVPClassifier
from fedlightning.methods.fedmvp.fedmvp_model import SEEN_BUFFER, TEXT_BUFFER, FedMVPNet

TEXT_PREFIX, TEXT_COUNT_PREFIX = "text_proto.", "text_count."


class FedMVP(ClassBankFedAvg):
    """FedMVP; ``alpha``: the consistency term's weight."""

    bank_buffer, seen_buffer = TEXT_BUFFER, SEEN_BUFFER
    bank_prefix, count_prefix = TEXT_PREFIX, TEXT_COUNT_PREFIX
    net_class, model_name = FedMVPNet, "fedmvp_gnn"

    def __init__(self, alpha: float = 10.0, replay_budget: int = 20, **kw: Any) -> None:
        if alpha < 0:
            raise ConfigError("algorithm.alpha", f"must be >= 0, got {alpha}")
        kw.setdefault("name", "fedmvp")
        kw.setdefault("variant", "full" if replay_budget else "no_replay")
        super().__init__(replay_budget=replay_budget, **kw)
        self.alpha = float(alpha)

    def make_module(self, net: FedMVPNet, optimizer: Any) -> FedMVPClassifier:
        return FedMVPClassifier(net, optimizer, alpha=self.alpha, **self.retention_kwargs())

    def begin_stage(self, client: FederatedClient, t: int, global_state: dict) -> None:
        """The frozen view: the global model at the client's first round of a stage ``t > 0``."""
        super().begin_stage(client, t, global_state)
        if t > 0 and self.alpha > 0:
            client.state["frozen_view"] = detach_state(global_state)
        else:
            client.state.pop("frozen_view", None)

    def prepare(self, module: FedMVPClassifier, client: FederatedClient, broadcast: Any) -> Any:
        batch = super().prepare(module, client, broadcast)
        module.set_frozen(client.state.get("frozen_view"))
        return batch

    def class_rows(self, net: FedMVPNet, batch: Any) -> dict[int, tuple[torch.Tensor, int]]:
        """Each class's mean text embedding over the training nodes that have text."""
        text = net.unprompted(batch)["text"]
        mask = (batch.sup_mask | batch.replay_mask) & net.text_available(batch)
        return class_means(text, batch.y, mask)
