"""TopoOOD's topology score (Bao et al., ICML 2024): the Dirichlet energy of degree-normalised
logits, optionally smoothed; its sign is calibrated on validation."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dirichlet_energy", "mean_propagation"]


def _degree(edge_index: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    return torch.zeros(n, dtype=dtype).index_add_(
        0, edge_index[1], torch.ones(edge_index.size(1), dtype=dtype)
    )


def dirichlet_energy(logits: Tensor, edge_index: Tensor) -> Tensor:
    """[N]: the mean over in-neighbours of ``|z_i / sqrt(1 + d_i) - z_j / sqrt(1 + d_j)|^2``
    (0 for an isolated node)."""
    n = logits.size(0)
    d = _degree(edge_index, n, logits.dtype).to(logits.device)
    zn = logits / (1 + d).sqrt().unsqueeze(1)
    src, dst = edge_index.to(logits.device)
    diff = (zn[dst] - zn[src]).pow(2).sum(dim=1)
    total = torch.zeros(n, dtype=logits.dtype, device=logits.device).index_add_(0, dst, diff)
    return torch.where(d > 0, total / d.clamp(min=1), torch.zeros_like(total))


def mean_propagation(scores: Tensor, edge_index: Tensor, steps: int, alpha: float) -> Tensor:
    """TopoOOD's smoothing: ``steps`` rounds of ``e <- alpha e + (1 - alpha) D^-1 A e``."""
    if steps < 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"steps must be >= 0 and alpha in [0, 1], got {steps}, {alpha}")
    n = scores.numel()
    d = _degree(edge_index, n, scores.dtype).to(scores.device)
    src, dst = edge_index.to(scores.device)
    e = scores
    for _ in range(steps):
        agg = torch.zeros_like(e).index_add_(0, dst, e[src]) / d.clamp(min=1)
        e = alpha * e + (1 - alpha) * agg
    return e
