"""CLIPN's (Wang et al., ICCV 2023) yes/no probabilities, its losses ITBO and TSO and the ATD
score, at embedding level (docs/fedogl.md, "CLIPN")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "atd_known_score",
    "itbo_losses",
    "no_probability",
    "retrieval_atd",
    "tso_loss",
    "yes_probability",
]


def yes_probability(f: Tensor, t: Tensor, t_no: Tensor, scale: float) -> Tensor:
    """``p_yes`` [N, C] of CLIPN's two-way softmax: ``sigmoid(s (cos(f, t) - cos(f, t_no)))``."""
    fn = F.normalize(f, dim=1)
    yes = fn @ F.normalize(t, dim=1).T
    no = fn @ F.normalize(t_no, dim=1).T
    return torch.sigmoid(scale * (yes - no))


def no_probability(f: Tensor, t: Tensor, t_no: Tensor, scale: float) -> Tensor:
    """``1 - p_yes``, computed without cancellation."""
    return yes_probability(f, t_no, t, scale)


def itbo_losses(
    f: Tensor, t: Tensor, t_no: Tensor, y: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """CLIPN's ITBO loss ``(L_yes, L_no)``: the mean ``-log p_yes`` of matched pairs (column
    ``y``), the mean ``-log p_no`` of unmatched ones (0 for one class)."""
    if f.size(0) == 0:
        zero = f.sum() * 0.0 + t.sum() * 0.0 + t_no.sum() * 0.0
        return zero, zero
    fn = F.normalize(f, dim=1)
    diff = scale * (fn @ F.normalize(t, dim=1).T - fn @ F.normalize(t_no, dim=1).T)
    matched = F.one_hot(y, t.size(0)).bool()
    log_yes = F.logsigmoid(diff)  # log p_yes
    log_no = F.logsigmoid(-diff)  # log p_no
    l_yes = -log_yes[matched].mean()
    l_no = -log_no[~matched].mean() if t.size(0) > 1 else diff.sum() * 0.0
    return l_yes, l_no


def tso_loss(t: Tensor, t_no: Tensor) -> Tensor:
    """CLIPN's TSO loss: the mean ``2 - |t_hat - t_no_hat|`` on the unit sphere."""
    return (2 - (F.normalize(t, dim=1) - F.normalize(t_no, dim=1)).norm(dim=1)).mean()


def atd_known_score(p_yes: Tensor, logits: Tensor) -> Tensor:
    """CLIPN's ATD as a known-class score: ``sum_c p_yes softmax(logits)`` [N]."""
    return (p_yes * logits.softmax(dim=1)).sum(dim=1)


def retrieval_atd(
    q: Tensor, items: Tensor, items_no: Tensor, scale: float, temperature: float
) -> Tensor:
    """ATD of queries [n] over ``items`` as CLIPN's classes, cosine / T as the logits."""
    sim = F.normalize(q, dim=1) @ F.normalize(items, dim=1).T
    return atd_known_score(yes_probability(q, items, items_no, scale), sim / temperature)
