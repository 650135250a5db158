r"""Open-world rejection: known-class scores, the Eq. (6) threshold rule, FPR95 and AUROC.

Known classes are the positive class everywhere: a higher score means "more known". A
node is accepted when its score is ``>= threshold`` and rejected as OOD otherwise (FedOGL
Eq. (6)). Rates are fractions in [0, 1]."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics.functional.classification import binary_auroc

__all__ = [
    "auroc_known_vs_unknown",
    "binary_auroc_of_scores",
    "energy_score",
    "fpr_at_threshold",
    "fpr_at_tpr",
    "msp_score",
    "open_accuracy",
    "score_sign",
    "threshold_at_tpr",
    "unit_scores",
]


def _known_logits(logits: Tensor, known: Tensor) -> Tensor:
    known = torch.as_tensor(known, device=logits.device).bool()
    if logits.dim() != 2 or known.shape != (logits.shape[1],):
        raise ValueError(
            f"expected logits [N, C] and a bool mask [C], got {tuple(logits.shape)} and "
            f"{tuple(known.shape)}"
        )
    if not known.any():
        raise ValueError("no known class in the mask")
    return logits[:, known]


def msp_score(logits: Tensor, known: Tensor) -> Tensor:
    r"""Maximum softmax probability over the known classes (FedOGL Eq. (6), :math:`\rho`).

    .. math::
        \rho_i = \max_{c \in \mathcal{C}_K} \frac{\exp(\ell_{i,c})}
        {\sum_{c' \in \mathcal{C}_K} \exp(\ell_{i,c'})}

    Logits outside :math:`\mathcal{C}_K` (bool mask ``known``) are dropped before the softmax.

    Shapes: input ``logits`` :math:`(N, C)`, ``known`` :math:`(C,)`; output :math:`(N,)`."""
    return _known_logits(logits, known).softmax(dim=1).amax(dim=1)


def energy_score(logits: Tensor, known: Tensor, temperature: float = 1.0) -> Tensor:
    r"""Negative free energy over the known classes (Liu et al., 2020); higher = more known.

    .. math::
        s_i = T \log \sum_{c \in \mathcal{C}_K} \exp(\ell_{i,c} / T), \qquad T > 0

    Shapes: input ``logits`` :math:`(N, C)`, ``known`` :math:`(C,)`; output :math:`(N,)`."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return temperature * torch.logsumexp(_known_logits(logits, known) / temperature, dim=1)


def _scores(x: Tensor) -> Tensor:
    x = torch.as_tensor(x).detach().flatten()
    if x.is_floating_point() and torch.isnan(x).any():
        raise ValueError("scores contain NaN")
    return x


def threshold_at_tpr(known_scores: Tensor, tpr: float = 0.95) -> float:
    r"""The largest threshold that accepts at least a fraction ``tpr`` of known scores.

    .. math::
        \delta = \max \Big\{ \delta' : \frac{1}{n} \sum_i [s_i \ge \delta'] \ge \mathrm{tpr}
        \Big\} = s_{(\lceil \mathrm{tpr} \cdot n \rceil)}

    where :math:`s_{(k)}` is the :math:`k`-th largest of the (non-empty) known scores; with
    ties the accepted fraction can exceed ``tpr`` in (0, 1]. Calibrates :math:`\delta_t` of
    Eq. (6) on validation known-class nodes; FPR95 uses it on test nodes."""
    s = _scores(known_scores)
    if not 0.0 < tpr <= 1.0:
        raise ValueError(f"tpr must be in (0, 1], got {tpr}")
    n = s.numel()
    if n == 0:
        raise ValueError("no known scores to calibrate a threshold on")
    # round before ceil: float noise in tpr * n must not demand one more accepted node
    k = max(1, math.ceil(round(tpr * n, 6)))
    return float(torch.sort(s, descending=True).values[k - 1])


def fpr_at_threshold(unknown_scores: Tensor, threshold: float) -> float:
    """Fraction of unknown-class scores accepted (``>= threshold``); NaN if there are none."""
    u = _scores(unknown_scores)
    if u.numel() == 0:
        return math.nan
    return float((u >= threshold).double().mean())


def fpr_at_tpr(known_scores: Tensor, unknown_scores: Tensor, tpr: float = 0.95) -> float:
    r"""False-positive rate on unknowns at the threshold giving ``tpr`` on knowns (FPR95).

    .. math::
        \mathrm{FPR}@\mathrm{tpr} = \frac{1}{m} \sum_{i=1}^{m} [u_i \ge \delta],
        \qquad \delta = \texttt{threshold\_at\_tpr}(s, \mathrm{tpr})

    NaN if either side is empty."""
    s, u = _scores(known_scores), _scores(unknown_scores)
    if s.numel() == 0 or u.numel() == 0:
        return math.nan
    return fpr_at_threshold(u, threshold_at_tpr(s, tpr))


def unit_scores(scores: Tensor) -> Tensor:
    """Raw scores mapped monotonically into [0, 1]: dense ranks (float64) over the largest
    rank, keeping order and ties (one distinct value maps to 0).

    ``torchmetrics``' binary metrics apply a sigmoid to predictions outside [0, 1]; on
    large-magnitude scores (logits, energies) the sigmoid saturates in float32 and merges
    distinct scores into ties. Ranks are already in [0, 1], so no sigmoid is applied, and
    any rank-based metric (AUROC, average precision) is unchanged by the mapping."""
    x = torch.as_tensor(scores).detach().flatten().double()
    _, ranks = torch.unique(x, sorted=True, return_inverse=True)
    return ranks.double() / max(1, int(ranks.max()) if ranks.numel() else 0)


def binary_auroc_of_scores(scores: Tensor, target: Tensor) -> float:
    r"""AUROC of raw ``scores`` against 0/1 ``target`` (1 positive), via ``torchmetrics``
    on :func:`unit_scores`:

    .. math::
        \mathrm{AUROC} = P(s^+ > s^-) + \tfrac{1}{2} P(s^+ = s^-)

    Both classes must be present (the callers return NaN otherwise)."""
    preds = unit_scores(scores)
    return float(binary_auroc(preds, torch.as_tensor(target).long().flatten().to(preds.device)))


def auroc_known_vs_unknown(known_scores: Tensor, unknown_scores: Tensor) -> float:
    r"""AUROC of separating known (positive) from unknown nodes by score
    (:func:`binary_auroc_of_scores`).

    .. math::
        \mathrm{AUROC} = P(s > u) + \tfrac{1}{2} P(s = u)

    NaN if either side is empty."""
    s, u = _scores(known_scores), _scores(unknown_scores)
    if s.numel() == 0 or u.numel() == 0:
        return math.nan
    scores = torch.cat([s.double(), u.double().to(s.device)])
    target = torch.cat(
        [torch.ones(s.numel(), dtype=torch.long), torch.zeros(u.numel(), dtype=torch.long)]
    )
    return binary_auroc_of_scores(scores, target)


def open_accuracy(pred: Tensor, y: Tensor, is_known: Tensor) -> float:
    r"""Open-set accuracy: knowns must get their class, unknowns must be rejected.

    .. math::
        \mathrm{acc} = \frac{1}{N} \sum_i \begin{cases} [\hat{y}_i = y_i], & i
        \text{ known} \\ [\hat{y}_i = -1], & i \text{ unknown} \end{cases}

    A rejected known node counts as an error. NaN for no nodes."""
    pred, y = pred.flatten(), y.flatten().to(pred.device)
    is_known = torch.as_tensor(is_known, device=pred.device).bool().flatten()
    if pred.numel() == 0:
        return math.nan
    ok = torch.where(is_known, pred == y, pred == -1)
    return float(ok.double().mean())


def score_sign(known_scores: Tensor, unknown_scores: Tensor) -> float:
    r"""The direction of a score whose orientation a method does not fix (TopoOOD's
    energy, GRASP's and CLIPN's scores are calibrated on validation): ``+1.0`` when known
    nodes score higher, :math:`\mathrm{AUROC}(s, u) \ge 0.5`, else ``-1.0`` (then
    ``-score`` is the known-class score). ``+1.0`` when either side is empty or the AUROC
    is NaN."""
    auroc = auroc_known_vs_unknown(known_scores, unknown_scores)
    return -1.0 if auroc < 0.5 else 1.0
