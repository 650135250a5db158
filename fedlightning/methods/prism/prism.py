"""PRISM (Chen et al.) in the class-incremental setting (docs/fedogl.md, "PRISM"): whole
clients miss a modality, the server's class bank holds paired prototypes, :class:`PrismNet`
imputes; FedAvg, replay and MSP rejection (Eq. 6)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from fedlightning.data.graphs.base import zero_missing
from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.methods.class_bank.class_bank import ClassBankFedAvg
from fedlightning.methods.class_bank.class_bank_server import class_means
from fedlightning.methods.prism.prism_model import PAIRED_BUFFER, PAIRED_SEEN_BUFFER, PrismNet
from fedlightning.utils.seeding import torch_generator

log = logging.getLogger("fedlightning")
PAIRED_PREFIX, PAIRED_COUNT_PREFIX = "paired_proto.", "paired_count."


def deficient_clients(
    num_clients: int, modalities: list[str], fraction: float, seed: int
) -> dict[int, str]:
    """The first ``round(fraction * K)`` clients of a seeded permutation, the ``j``-th
    missing ``modalities[j % M]``."""
    order = torch.randperm(num_clients, generator=torch_generator(seed, "prism", "deficient"))
    n = int(round(fraction * num_clients))
    return {int(k): modalities[j % len(modalities)] for j, k in enumerate(order[:n].tolist())}


def drop_modality(data: Any, modalities: list[str], missing: str) -> None:
    """``missing`` zeroed and masked on every node of ``data`` (in place, idempotent)."""
    j = modalities.index(missing)
    mask = data.modality_mask.clone()
    mask[:, j] = False
    feats = zero_missing({m: data[f"x_{m}"] for m in modalities}, mask)
    data[f"x_{missing}"] = feats[missing]
    data.modality_mask = mask


class Prism(ClassBankFedAvg):
    """PRISM; ``deficient_fraction`` of ``num_clients`` miss a modality, drawn with
    ``deficiency_seed`` (``protocol.seed``: part of the data protocol)."""

    bank_buffer, seen_buffer = PAIRED_BUFFER, PAIRED_SEEN_BUFFER
    bank_prefix, count_prefix = PAIRED_PREFIX, PAIRED_COUNT_PREFIX
    net_class, model_name = PrismNet, "prism_gnn"

    def __init__(
        self,
        deficient_fraction: float = 0.4,
        num_clients: int = 5,
        deficiency_seed: int = 0,
        replay_budget: int = 20,
        **kw: Any,
    ) -> None:
        if not 0.0 <= deficient_fraction <= 1.0:
            raise ConfigError(
                "algorithm.deficient_fraction", f"must lie in [0, 1], got {deficient_fraction}"
            )
        if num_clients < 1:
            raise ConfigError("algorithm.num_clients", f"must be >= 1, got {num_clients}")
        kw.setdefault("name", "prism")
        kw.setdefault("variant", "full" if replay_budget else "no_replay")
        super().__init__(replay_budget=replay_budget, **kw)
        self.deficient_fraction, self.num_clients = float(deficient_fraction), int(num_clients)
        self.deficiency_seed = int(deficiency_seed)
        self.modalities: list[str] = []
        self.missing: dict[int, str] = {}

    def make_module(self, net: PrismNet, optimizer: Any) -> Any:
        if len(net.modalities) < 2:
            raise ConfigError(
                "dataset",
                f"{self.name} imputes a missing modality from the others: it needs a graph with "
                f"at least two modalities, got {net.modalities} (docs/fedogl.md, PRISM)",
            )
        self.modalities = list(net.modalities)
        self.missing = deficient_clients(
            self.num_clients, self.modalities, self.deficient_fraction, self.deficiency_seed
        )
        log.info("PRISM deficient clients (client: missing modality): %s", self.missing)
        return super().make_module(net, optimizer)

    def prepare_clients(self, clients: list[FederatedClient]) -> None:
        """The deficient clients miss their modality throughout."""
        if len(clients) != self.num_clients:
            raise ConfigError(
                "algorithm.num_clients",
                f"must equal federation.clients ({len(clients)}), got {self.num_clients}",
            )
        for client in clients:
            self.make_deficient(client)

    def make_deficient(self, client: FederatedClient) -> None:
        missing = self.missing.get(client.client_id)
        if missing is not None and not getattr(client.data, "prism_deficient", False):
            drop_modality(client.data, self.modalities, missing)
            client.data.prism_deficient = True

    def prepare(self, module: Any, client: FederatedClient, broadcast: Any) -> Any:
        self.make_deficient(client)  # on a node that builds its own clients, too
        return super().prepare(module, client, broadcast)

    def class_rows(self, net: PrismNet, batch: Any) -> dict[int, tuple[torch.Tensor, int]]:
        """Per class the modality embeddings' means [M, hidden] over complete training nodes."""
        h = torch.stack(net.modality_embeddings(batch), dim=1)  # [N, M, hidden]
        mask = (batch.sup_mask | batch.replay_mask) & batch.modality_mask.all(dim=1)
        return class_means(h, batch.y, mask)
