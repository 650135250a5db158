"""FedSSP's client (Tan et al., NeurIPS 2024): PGPA's mean-representation regularizer on top
of the class-incremental objective (docs/fedogl.md, "FedSSP")."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data

from fedlightning.clients.continual_client import ContinualNodeClassifier


def mean_representation(h: Tensor, mask: Tensor) -> Tensor:
    """The mean of the rows of ``h`` ``[N, d]`` selected by ``mask`` ``[N]`` (zeros if none)."""
    if not bool(mask.any()):
        return h.new_zeros(h.size(1))
    return h[mask].mean(0)


def momentum_mean(previous: Tensor, current: Tensor, momentum: float = 0.5) -> Tensor:
    r"""PGPA's running mean as FedSSP's code updates it,
    :math:`\bar\mu_k = (1-m)\,\bar\mu_k^{prev} + m\,\mu_k` (``m`` = ``momentum``)."""
    return (1.0 - momentum) * previous.to(current) + momentum * current


def pgpa_penalty(local_mean: Tensor, global_mean: Tensor, tau: float) -> Tensor:
    r"""PGPA's alignment term :math:`\frac{\tau}{2d}\lVert\bar\mu_k - \mu_{glob}\rVert_2^2`
    (``d`` the width: FedSSP's code averages the squared difference over the dimensions)."""
    return 0.5 * tau * (local_mean - global_mean.to(local_mean)).pow(2).mean()


class FedSSPClassifier(ContinualNodeClassifier):
    r"""Eq. (5)'s objective (as :class:`ContinualNodeClassifier`; FedSSP's logits are
    :math:`W(g + b_k)`, the net's) plus :func:`pgpa_penalty` of the client's running mean
    representation :math:`\bar\mu_k` towards the server's mean of the clients' means
    (``None``: no term, e.g. in the first round). FedSSP's code resets the running mean
    before every batch, so with our full-batch steps :math:`\bar\mu_k` is
    :func:`momentum_mean` of zeros and the batch's mean ``g`` over its supervised and
    replayed nodes.

    Args:
        tau_mean: the alignment weight (FedSSP: 100).
        momentum: the running mean's momentum (FedSSP: 0.5).
        *args, **kw: as :class:`ContinualNodeClassifier`.
    """

    def __init__(self, *args: Any, tau_mean: float = 100.0, momentum: float = 0.5, **kw: Any):
        super().__init__(*args, **kw)
        self.tau_mean, self.momentum = float(tau_mean), float(momentum)
        self.global_mean: Tensor | None = None

    def set_global_mean(self, global_mean: Tensor | None) -> None:
        """The server's mean of the clients' means (``None``: none yet)."""
        self.global_mean = global_mean

    def running_mean(self, g: Tensor, batch: Data) -> Tensor:
        r""":math:`\bar\mu_k` on ``batch`` (gradient through this batch's mean)."""
        current = mean_representation(g, batch.sup_mask | batch.replay_mask)
        return momentum_mean(torch.zeros_like(current), current, self.momentum)

    def training_step(self, batch: Data, batch_idx: int = 0) -> Tensor:
        reps = self.net.representations(batch)
        logits = self.net.head(self.net.dropout(reps["z"]))
        loss = self.objective(logits, batch)
        if self.global_mean is not None and self.tau_mean > 0:
            mean = self.running_mean(reps["g"], batch)
            loss = loss + pgpa_penalty(mean, self.global_mean, self.tau_mean)
        return self.with_proximal(loss)

    @torch.no_grad()
    def final_mean(self, batch: Data) -> Tensor:
        """The running mean after the fit (the uplink's ``mean``), in eval mode."""
        was = self.net.training
        self.net.eval()
        mean = self.running_mean(self.net.representations(batch)["g"], batch)
        self.net.train(was)
        return mean.detach().clone()
