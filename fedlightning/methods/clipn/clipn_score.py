r"""CLIPN's "no" branch at embedding level (Wang et al., *CLIPN for Zero-Shot OOD
Detection: Teaching CLIP to Say No*, ICCV 2023): the yes/no probability of a (node, class)
pair, its two training losses (ITBO, TSO) and the ATD score.

The "yes" prototype of class :math:`c` is :math:`t_c` (the classifier's row), its "no"
prototype :math:`\bar t_c = g(t_c) + o_c` (a learned MLP and offset). With cosine
similarities and scale :math:`s`, CLIPN's two-way softmax is a sigmoid of the difference.
"""

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
    r""":math:`p^{yes}_{i,c}` of CLIPN's two-way softmax.

    .. math::
        p^{yes}_{i,c} = \frac{e^{s \cos(f_i, t_c)}}{e^{s \cos(f_i, t_c)} + e^{s \cos(f_i,
        \bar t_c)}} = \sigma\big(s(\cos(f_i, t_c) - \cos(f_i, \bar t_c))\big)

    Shapes:
        - **input:** ``f`` :math:`(N, d)`, ``t``, ``t_no`` :math:`(C, d)`
        - **output:** :math:`(N, C)`
    """
    fn = F.normalize(f, dim=1)
    yes = fn @ F.normalize(t, dim=1).T
    no = fn @ F.normalize(t_no, dim=1).T
    return torch.sigmoid(scale * (yes - no))


def no_probability(f: Tensor, t: Tensor, t_no: Tensor, scale: float) -> Tensor:
    r""":math:`p^{no}_{i,c} = 1 - p^{yes}_{i,c}`, computed as
    :math:`\sigma(s(\cos(f_i, \bar t_c) - \cos(f_i, t_c)))` (no cancellation)."""
    return yes_probability(f, t_no, t, scale)


def itbo_losses(
    f: Tensor, t: Tensor, t_no: Tensor, y: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    r"""CLIPN's image-text binary-opposite loss, split as it is summed: matched pairs must
    say yes, unmatched pairs no.

    .. math::
        \mathcal{L}_{yes} = -\frac{1}{N}\sum_i \log p^{yes}_{i,y_i}, \qquad
        \mathcal{L}_{no} = -\frac{1}{N(C-1)}\sum_i \sum_{c \ne y_i} \log p^{no}_{i,c}

    ``y``: each row's class as a column of ``t`` (``0..C-1``); :math:`\mathcal{L}_{no} = 0`
    when :math:`C = 1`. Returns ``(L_yes, L_no)``, scalars.
    """
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
    r"""CLIPN's text semantic-opposite loss: push each class's "no" prototype away from its
    "yes" prototype on the unit sphere (distance at most 2).

    .. math::
        \mathcal{L}_{tso} = \frac{1}{C}\sum_c \big(2 - \lVert \hat t_c - \hat{\bar t}_c
        \rVert_2\big), \qquad \hat v = v / \lVert v \rVert
    """
    return (2 - (F.normalize(t, dim=1) - F.normalize(t_no, dim=1)).norm(dim=1)).mean()


def atd_known_score(p_yes: Tensor, logits: Tensor) -> Tensor:
    r"""CLIPN's agreeing-to-differ score as a known-class score (higher = more known).

    .. math::
        p^{ood}_i = 1 - \sum_c p^{yes}_{i,c}\, p_{i,c}, \qquad
        s_i = 1 - p^{ood}_i = \sum_c p^{yes}_{i,c}\, \mathrm{softmax}(\ell_i)_c

    ``p_yes`` and ``logits`` over the same (known) classes.

    Shapes:
        - **input:** ``p_yes``, ``logits`` :math:`(N, C)`
        - **output:** :math:`(N,)`
    """
    return (p_yes * logits.softmax(dim=1)).sum(dim=1)


def retrieval_atd(
    q: Tensor, items: Tensor, items_no: Tensor, scale: float, temperature: float
) -> Tensor:
    r"""ATD of queries over items: :math:`s_i = \sum_l p^{yes}_{i,l}\,
    \mathrm{softmax}_l(\cos(q_i, k_l) / T)`, the items playing CLIPN's classes and the
    InfoNCE similarity logits its class posterior (:func:`atd_known_score`).

    Shapes:
        - **input:** ``q`` :math:`(n, d)`, ``items``, ``items_no`` :math:`(m, d)`
        - **output:** :math:`(n,)`
    """
    sim = F.normalize(q, dim=1) @ F.normalize(items, dim=1).T
    return atd_known_score(yes_probability(q, items, items_no, scale), sim / temperature)
