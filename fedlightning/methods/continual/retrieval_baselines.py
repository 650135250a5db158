"""Class-incremental cross-modal retrieval baselines of the FedOGL setting, as compositions."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedlightning.clients.continual_retrieval import ContinualRetrievalClient
from fedlightning.errors import ConfigError
from fedlightning.methods.continual.continual import ContinualFedAvg

RETRIEVAL_SCORES = ("similarity",)


def check_retrieval_net(net: nn.Module) -> None:
    """A cir algorithm's model must return query and item embeddings."""
    if not hasattr(net, "pair_mask"):
        raise ConfigError(
            "model",
            f"{type(net).__name__} is not a retrieval model; cir algorithms need "
            "model=retrieval_gnn (a net returning query and item embeddings)",
        )


class ContinualRetrieval(ContinualFedAvg):
    """FedAvg for cross-modal retrieval in the class-incremental stream: the switches of
    :class:`~fedlightning.methods.continual.continual.ContinualFedAvg` (distillation on similarity
    logits) with :class:`~fedlightning.clients.continual_retrieval.ContinualRetrievalClient`
    evaluated by :class:`~fedlightning.federation.retrieval_stages.RetrievalEvaluation`.

    Args:
        name, variant, replay_budget, replay_stages, lambda_rep, lambda_dis, tau,
            distill_on, prox_mu: as in :class:`ContinualFedAvg`.
        score: rejection score; only ``"similarity"`` (a query's highest cosine similarity
            to the known-class items; no energy variant for retrieval).
        temperature: InfoNCE temperature :math:`T` (default ``0.1``).
    """

    evaluation = "retrieval"

    def __init__(self, score: str = "similarity", temperature: float = 0.1, **kw: Any) -> None:
        if score not in RETRIEVAL_SCORES:
            raise ConfigError(
                "algorithm.score",
                f"retrieval rejects by {RETRIEVAL_SCORES}, got {score!r} "
                "(msp and energy need class logits)",
            )
        if isinstance(temperature, bool) or not temperature > 0:
            raise ConfigError("algorithm.temperature", f"must be > 0, got {temperature!r}")
        # The parent validates a classification score; the retrieval one is set afterwards.
        super().__init__(score="msp", **kw)
        self.score, self.temperature = score, float(temperature)

    def client_module(self, net: nn.Module, optimizer: Any) -> ContinualRetrievalClient:
        check_retrieval_net(net)
        return ContinualRetrievalClient(
            net, optimizer, temperature=self.temperature, **self.retention_kwargs()
        )
