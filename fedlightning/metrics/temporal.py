r"""FedTIP's server-side scores and AUC-ROC (paper 001, Sec. 5.1; docs/metrics.md)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fedlightning.metrics.open_set import binary_auroc_of_scores


def auroc(scores: Tensor, target: Tensor) -> float:
    """AUC-ROC of raw ``scores`` (any magnitude, no sigmoid: ranks mapped into [0, 1] by
    :func:`~fedlightning.metrics.open_set.unit_scores`) against 0/1 ``target``; NaN when a
    class is absent or a score is NaN (a diverged model scores nothing)."""
    if len(target) == 0 or bool((target == target[0]).all()) or bool(scores.isnan().any()):
        return math.nan
    return binary_auroc_of_scores(scores, target)


def class_score(h: Tensor, prototypes: dict[int, Tensor]) -> Tensor:
    r"""Node classification score :math:`s(\tilde{\mathbf{h}}, \mathbf{q}_1) -
    s(\tilde{\mathbf{h}}, \mathbf{q}_0)` (cosine :math:`s`)."""
    q1, q0 = prototypes[1].to(h), prototypes[0].to(h)
    return F.cosine_similarity(h, q1.unsqueeze(0), dim=-1) - F.cosine_similarity(
        h, q0.unsqueeze(0), dim=-1
    )


def link_auroc(h_pos: Tensor, h_i: Tensor, h_neg: Tensor, h_j: Tensor) -> float:
    r"""AUC-ROC of :math:`s(\tilde{\mathbf{h}}_{u,i,t}, \mathbf{h}_i)` (positives) against
    :math:`s(\tilde{\mathbf{h}}_{u,j,t}, \mathbf{h}_j)` (their negatives)."""
    pos = F.cosine_similarity(h_pos, h_i, dim=-1)
    neg = F.cosine_similarity(h_neg, h_j, dim=-1)
    target = torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])
    return auroc(torch.cat([pos, neg]), target)
