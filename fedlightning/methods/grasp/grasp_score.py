"""GRASP's post-hoc score propagation (Ma et al., NeurIPS 2024): select the set ``G``, then
propagate over the graph with ``G`` fully connected (docs/fedogl.md, "GRASP")."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["grasp_propagate", "grasp_selection"]


def _top(idx: Tensor, values: Tensor, k: int, largest: bool) -> Tensor:
    """The ``k`` entries of ``idx`` with the largest (smallest) ``values``; ties by index."""
    order = torch.argsort(values, descending=largest, stable=True)
    return idx[order[:k]]


def grasp_selection(
    scores: Tensor,
    edge_index: Tensor,
    candidates: Tensor,
    train: Tensor,
    tau1: float = 0.05,
    tau2: float = 0.5,
) -> Tensor:
    """``G`` (sorted ids): the ``ceil(tau2 |train|)`` training nodes of highest
    ``|N(v) & S_id| / (1 + |N(v) & S_ood|)``, ``S_id``/``S_ood`` the ``ceil(tau1 |T|)``
    highest/lowest-scored ``candidates``."""
    n = scores.numel()
    cand = candidates.nonzero().squeeze(1)
    tr = train.nonzero().squeeze(1)
    if cand.numel() == 0 or tr.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    k1 = math.ceil(round(tau1 * cand.numel(), 6))
    is_id = torch.zeros(n, dtype=torch.bool)
    is_ood = torch.zeros(n, dtype=torch.bool)
    is_id[_top(cand, scores[cand], k1, largest=True)] = True
    is_ood[_top(cand, scores[cand], k1, largest=False)] = True
    src, dst = edge_index
    n_id = torch.zeros(n).index_add_(0, dst, is_id[src].float())
    n_ood = torch.zeros(n).index_add_(0, dst, is_ood[src].float())
    ratio = n_id / (1 + n_ood)
    k2 = math.ceil(round(tau2 * tr.numel(), 6))
    return torch.sort(_top(tr, ratio[tr], k2, largest=True)).values


def grasp_propagate(
    scores: Tensor, edge_index: Tensor, g: Tensor, steps: int = 8, delta: float = 1.02
) -> Tensor:
    """``steps`` rounds of ``s_i <- (sum_N(i) s_j + delta [i in G] sum_G s_j) / d_i`` with
    ``G`` (ids ``g``) fully connected (GRASP with alpha = 0)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    n = scores.numel()
    src, dst = edge_index.to(scores.device)
    in_g = torch.zeros(n, dtype=torch.bool, device=scores.device)
    in_g[g.to(scores.device)] = True
    d = torch.zeros(n, dtype=scores.dtype, device=scores.device).index_add_(
        0, dst, torch.ones(dst.numel(), dtype=scores.dtype, device=scores.device)
    )
    d = d + in_g.to(scores.dtype) * in_g.sum()
    inv = torch.where(d > 0, 1 / d.clamp(min=1e-12), torch.zeros_like(d))
    s = scores
    for _ in range(steps):
        agg = torch.zeros_like(s).index_add_(0, dst, s[src])
        agg = agg + delta * in_g.to(s.dtype) * s[in_g].sum()
        s = agg * inv
    return s
