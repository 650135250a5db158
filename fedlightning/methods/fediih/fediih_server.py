"""FedIIH's server (Yu et al., AAAI 2025): per-factor similarity of the clients' uploaded
posteriors and the personalized mixing of each factor's weight blocks. No Lightning here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedlightning.messages import ClientUpdate
from fedlightning.server.aggregate import fedavg, model_state
from fedlightning.server.server import ServerModule

MU_FIELD, LOGVAR_FIELD = "posterior.mu", "posterior.logvar"  # uplink, [K, d] each
PERSONAL_PREFIX = "personal."  # downlink: personal.<client>.<state key>


def gaussian_kl(mu_a: Tensor, logvar_a: Tensor, mu_b: Tensor, logvar_b: Tensor) -> Tensor:
    r""":math:`KL(\mathcal{N}_a\Vert\mathcal{N}_b) = \frac12\sum_j\left(\log\sigma_{b,j}^2 -
    \log\sigma_{a,j}^2 + \frac{\sigma_{a,j}^2 + (\mu_{a,j}-\mu_{b,j})^2}{\sigma_{b,j}^2} -
    1\right)` of diagonal Gaussians."""
    var_a, var_b = logvar_a.exp(), logvar_b.exp()
    return 0.5 * (logvar_b - logvar_a + (var_a + (mu_a - mu_b) ** 2) / var_b - 1).sum()


def gaussian_js(mu_a: Tensor, logvar_a: Tensor, mu_b: Tensor, logvar_b: Tensor) -> Tensor:
    r"""FedIIH's Jensen-Shannon divergence of diagonal Gaussians:
    :math:`\frac12 KL(\mathcal{N}_a\Vert\mathcal{N}_M) + \frac12 KL(\mathcal{N}_b\Vert
    \mathcal{N}_M)` with :math:`\mathcal{N}_M` of mean :math:`(\mu_a+\mu_b)/2` and variance
    :math:`(\sigma_a^2+\sigma_b^2)/2` (the mixture's moment-matched Gaussian)."""
    mu_m = 0.5 * (mu_a + mu_b)
    logvar_m = torch.log(0.5 * (logvar_a.exp() + logvar_b.exp()))
    return 0.5 * (gaussian_kl(mu_a, logvar_a, mu_m, logvar_m) + gaussian_kl(mu_b, logvar_b, mu_m, logvar_m))  # fmt: skip


def posterior_similarity(mus: Tensor, logvars: Tensor) -> Tensor:
    r""":math:`S_{ij} = 1 - JS(\mathcal{N}_i, \mathcal{N}_j)/\ln 2` of one factor's posteriors
    ``mus``, ``logvars`` ``[n, d]``; ``[n, n]``, in float64."""
    mus, logvars = mus.double(), logvars.double()
    n = mus.size(0)
    S = torch.empty(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            S[i, j] = 1 - gaussian_js(mus[i], logvars[i], mus[j], logvars[j]) / math.log(2)
    return S


def mixing_weights(S: Tensor, scale: float = 10.0) -> Tensor:
    r"""FedIIH's aggregation weights :math:`W_{ij} = e^{scale\,S_{ij}} / \sum_l e^{scale\,S_{il}}`
    (rows sum to one)."""
    return torch.softmax(scale * S.double(), dim=1)


def mix_factor_blocks(
    states: Sequence[dict[str, Tensor]], weights: Sequence[Tensor], axes: dict[str, int]
) -> list[dict[str, Tensor]]:
    r"""Client ``i``'s personalized blocks: for every key of ``axes`` (the axis it splits
    along into ``K = len(weights)`` equal blocks), block ``k`` is
    :math:`\sum_j W^{(k)}_{ij}\,\theta_j^{(k)}` over the ``states`` of the ``n`` clients;
    ``weights[k]`` is factor ``k``'s ``[n, n]`` matrix. One dict per client, in order."""
    K = len(weights)
    out: list[dict[str, Tensor]] = [{} for _ in states]
    for key, axis in axes.items():
        stacked = torch.stack([s[key].double() for s in states])  # [n, ...]
        blocks = stacked.chunk(K, dim=axis + 1)
        for i in range(len(states)):
            mixed = [torch.tensordot(weights[k][i], blocks[k], dims=1) for k in range(K)]
            out[i][key] = torch.cat(mixed, dim=axis).to(states[0][key].dtype)
    return out


def fediih_average(updates: Sequence[ClientUpdate]) -> dict[str, Tensor]:
    """FedIIH's global model: FedAvg by ``num_examples`` (the code's train-size ratio). Its
    own function, not :func:`fedavg` itself, so that secure sums, which hide each client's
    message from the server, refuse it: :class:`FactorMixing` reads every client's weights
    and posteriors."""
    return fedavg(updates)


class FactorMixing(ServerModule):
    """After the FedAvg of the whole model: per factor, the similarity of this round's
    clients' posteriors (:func:`posterior_similarity`, :func:`mixing_weights`) and, for each
    of them, the personalized factor blocks (:func:`mix_factor_blocks`) it receives next as
    ``personal.<client>.<key>``. A client that did not take part keeps its last blocks."""

    def __init__(self, axes: dict[str, int], factors: int, scale: float = 10.0) -> None:
        self.axes, self.factors, self.scale = dict(axes), int(factors), float(scale)
        self.personal: dict[int, dict[str, Tensor]] = {}
        self.weights: list[Tensor] = []

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        mus = torch.stack([u.tensors[MU_FIELD] for u in updates])  # [n, K, d]
        logvars = torch.stack([u.tensors[LOGVAR_FIELD] for u in updates])
        self.weights = [
            mixing_weights(posterior_similarity(mus[:, k], logvars[:, k]), self.scale)
            for k in range(self.factors)
        ]
        states = [model_state(u.tensors) for u in updates]
        for u, blocks in zip(
            updates, mix_factor_blocks(states, self.weights, self.axes), strict=True
        ):
            self.personal[u.client_id] = blocks

    def broadcast_fields(self) -> dict[str, Tensor]:
        return {
            f"{PERSONAL_PREFIX}{c}.{k}": v
            for c in sorted(self.personal)
            for k, v in self.personal[c].items()
        }

    def state_dict(self) -> dict[str, Any]:
        return {"personal": self.personal, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.personal = {int(c): dict(v) for c, v in state["personal"].items()}
        self.weights = list(state["weights"])
