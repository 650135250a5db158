r"""GRASP's post-hoc score propagation (Ma et al., *Revisiting Score Propagation in Graph
OOD Detection*, NeurIPS 2024), one function per step.

1. :func:`grasp_selection`: among the candidate (test-time) nodes, the top ``tau1`` by score
   are predicted known, the bottom ``tau1`` predicted unknown; every training node gets the
   ratio #known-predicted neighbours / (1 + #unknown-predicted neighbours) and the top
   ``tau2`` of the training nodes form the set :math:`G`.
2. :func:`grasp_propagate`: :math:`G` is fully connected and the score is propagated
   ``K`` times over the augmented graph, :math:`G`'s edges weighted by ``delta``.

With positive scores (MSP) the added edges raise the scores of :math:`G` and, from the
second step on, of :math:`G`'s neighbours: nodes near the training nodes that sit among
predicted-known nodes are pushed towards "known".
"""

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
    r"""The node set :math:`G` (sorted node ids) of GRASP's augmentation.

    :math:`S_{id}` = the :math:`\lceil \tau_1 |T| \rceil` candidates (bool mask ``candidates``,
    :math:`T`) of highest score, :math:`S_{ood}` the as many of lowest score; for each
    training node :math:`v` (bool mask ``train``)

    .. math::
        r_v = \frac{|\mathcal{N}(v) \cap S_{id}|}{1 + |\mathcal{N}(v) \cap S_{ood}|}

    and :math:`G` = the :math:`\lceil \tau_2 |\mathrm{train}| \rceil` training nodes of
    highest :math:`r_v` (ties by node id). Empty without candidates or training nodes.
    """
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
    r"""``steps`` rounds of propagation over the graph with :math:`G` fully connected.

    .. math::
        d_i = |\mathcal{N}(i)| + [i \in G]\,|G|, \qquad
        s_i \leftarrow \frac{1}{d_i}\Big(\sum_{j \in \mathcal{N}(i)} s_j
        + \delta\,[i \in G] \sum_{j \in G} s_j\Big)

    (GRASP's propagation with :math:`\alpha = 0`; a node with :math:`d_i = 0` gets 0).
    ``g``: node ids of :math:`G` (:func:`grasp_selection`).

    Shapes:
        - **input:** ``scores`` :math:`(N,)`, ``edge_index`` :math:`(2, E)`, ``g`` :math:`(|G|,)`
        - **output:** :math:`(N,)`
    """
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
