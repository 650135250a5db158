r"""TopoOOD's topology score (Bao et al., ICML 2024): the Dirichlet energy of a node's
degree-normalised logits against its neighbours', optionally smoothed over the graph.

Higher energy means a node disagrees with its neighbourhood. Which way that points (known
or unknown) is not fixed by the method: the loop calibrates the sign on validation
(:func:`~fedlightning.metrics.open_set.score_sign`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dirichlet_energy", "mean_propagation"]


def _degree(edge_index: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    return torch.zeros(n, dtype=dtype).index_add_(
        0, edge_index[1], torch.ones(edge_index.size(1), dtype=dtype)
    )


def dirichlet_energy(logits: Tensor, edge_index: Tensor) -> Tensor:
    r"""Per-node Dirichlet energy of degree-normalised logits.

    .. math::
        E_i = \frac{1}{d_i} \sum_{j \in \mathcal{N}(i)} \Big\lVert
        \frac{z_i}{\sqrt{1 + d_i}} - \frac{z_j}{\sqrt{1 + d_j}} \Big\rVert_2^2

    ``edge_index`` ``[2, E]`` lists both directions of every undirected edge (``j -> i`` in
    columns ``(j, i)``); :math:`d_i` is the in-degree. An isolated node has energy 0.

    Shapes:
        - **input:** ``logits`` :math:`(N, C)`, ``edge_index`` :math:`(2, E)`
        - **output:** :math:`(N,)`
    """
    n = logits.size(0)
    d = _degree(edge_index, n, logits.dtype).to(logits.device)
    zn = logits / (1 + d).sqrt().unsqueeze(1)
    src, dst = edge_index.to(logits.device)
    diff = (zn[dst] - zn[src]).pow(2).sum(dim=1)
    total = torch.zeros(n, dtype=logits.dtype, device=logits.device).index_add_(0, dst, diff)
    return torch.where(d > 0, total / d.clamp(min=1), torch.zeros_like(total))


def mean_propagation(scores: Tensor, edge_index: Tensor, steps: int, alpha: float) -> Tensor:
    r"""``steps`` rounds of :math:`e \leftarrow \alpha e + (1 - \alpha) D^{-1} A e` (the
    neighbourhood mean; an isolated node keeps :math:`\alpha e_i`), TopoOOD's optional
    smoothing of the score (:math:`K_d = 2`, :math:`\alpha = 0.5` in its code).

    Shapes:
        - **input:** ``scores`` :math:`(N,)`, ``edge_index`` :math:`(2, E)`
        - **output:** :math:`(N,)`
    """
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
