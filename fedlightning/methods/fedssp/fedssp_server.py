"""FedSSP's server (Tan et al., NeurIPS 2024): GSKS, the uniform mean of the clients'
spectral encoders, and PGPA's global mean representation. No Lightning here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedlightning.messages import ClientUpdate
from fedlightning.server.aggregate import model_state, weighted_average
from fedlightning.server.server import ServerModule

MEAN_FIELD = "mean"  # uplink: a client's running mean representation
GLOBAL_MEAN_FIELD = "mean.global"  # downlink: the server's mean of the clients' means


def uniform_average(updates: Sequence[ClientUpdate]) -> dict[str, Tensor]:
    r"""GSKS: :math:`\bar\theta = \frac{1}{n}\sum_k \theta_k` over the ``model.`` fields of
    the ``n`` updates (the spectral encoder), unweighted as in FedSSP."""
    return weighted_average([model_state(u.tensors) for u in updates], [1.0] * len(updates))


def global_mean(means: Sequence[Tensor]) -> Tensor:
    r"""PGPA's :math:`\mu_{glob} = \frac{1}{n}\sum_k \bar\mu_k` (in float64, cast back)."""
    stacked = torch.stack([m.to(torch.float64) for m in means])
    return stacked.mean(0).to(means[0].dtype)


class GlobalMean(ServerModule):
    """Keeps :func:`global_mean` of the last round's ``mean`` fields and broadcasts it as
    ``mean.global`` (nothing before the first round)."""

    def __init__(self) -> None:
        self.mean: Tensor | None = None

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        means = [u.tensors[MEAN_FIELD] for u in updates if MEAN_FIELD in u.tensors]
        if means:
            self.mean = global_mean(means)

    def broadcast_fields(self) -> dict[str, Tensor]:
        return {} if self.mean is None else {GLOBAL_MEAN_FIELD: self.mean}

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean = state["mean"]
