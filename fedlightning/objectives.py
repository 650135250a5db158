"""Pure tensor objectives shared by client modules and server modules (no Lightning)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["symmetric_info_nce"]


def symmetric_info_nce(q: Tensor, k: Tensor, temperature: float = 0.1) -> Tensor:
    r"""Symmetric InfoNCE of paired embeddings: the CE term of Eq. (5) for retrieval.

    .. math::
        \mathcal{L}_{\mathrm{nce}} = \frac{1}{2n} \sum_{i=1}^{n} \Big[
        -\log \frac{e^{S_{ii}/T}}{\sum_{l} e^{S_{il}/T}}
        -\log \frac{e^{S_{ii}/T}}{\sum_{l} e^{S_{li}/T}} \Big],
        \qquad S = q k^\top

    i.e. the mean of ``CE(q k^T / T, arange(n))`` and ``CE(k q^T / T, arange(n))``; with
    L2-normalised rows :math:`S` is the cosine similarity. ``q`` :math:`(n, d)` pairs row
    by row with ``k`` :math:`(n, d)`; returns a scalar. One pair gives ``0`` (nothing to
    contrast with); no pair gives a zero that keeps the graph."""
    if q.shape != k.shape:
        raise ValueError(f"q and k must pair row by row, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.size(0) == 0:
        return (q.sum() + k.sum()) * 0.0
    logits = q @ k.T / temperature
    target = torch.arange(q.size(0), device=q.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
