"""Client-side loss terms, one function each."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def proximal_term(
    params: Iterable[tuple[str, Tensor]], anchor: dict[str, Tensor], mu: float
) -> Tensor:
    r"""FedProx's proximal term (Li et al., 2020, Eq. (2)), :math:`\frac{\mu}{2} \lVert w -
    w^t \rVert_2^2`, over ``(name, parameter)`` pairs of ``w`` and the round's global
    weights ``anchor`` (name -> :math:`w^t`)."""
    total = sum(((p - anchor[name]).pow(2).sum() for name, p in params), torch.zeros(()))
    return 0.5 * mu * total


def restrict_logits(logits: Tensor, classes: Tensor) -> Tensor:
    """The logits of ``classes`` only (long indices, ascending): the known-class head."""
    return logits.index_select(-1, classes)


def distillation_kl(student_logits: Tensor, teacher_logits: Tensor, tau: float) -> Tensor:
    r"""Task-start distillation term of FedOGL Eq. (5), without its weight:
    :math:`\tau^2 \mathrm{KL}(\sigma(z^{-}/\tau) \,\|\, \sigma(z/\tau))` averaged over
    nodes, ``z^-`` the frozen teacher's logits ``[n, C_old]``, ``z`` the student's."""
    log_p_student = torch.log_softmax(student_logits / tau, dim=-1)
    log_p_teacher = torch.log_softmax(teacher_logits / tau, dim=-1)
    kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1).mean()
    return tau**2 * kl


def retention_objective(
    ce_current: Tensor, ce_replay: Tensor, kl: Tensor, lambda_rep: float, lambda_dis: float
) -> Tensor:
    r"""FedOGL Eq. (5): current-stage CE, replay CE and task-start distillation.

    .. math::
        \mathcal{L}_k^t = \mathcal{L}_{\mathrm{CE}}(\mathcal{D}_k^t)
        + \lambda_{\mathrm{rep}} \mathcal{L}_{\mathrm{CE}}(\mathcal{R}_k(t))
        + \lambda_{\mathrm{dis}} \tau^2 \mathrm{KL}(p^{-} \| p)

    ``kl`` already carries ``tau^2`` (:func:`distillation_kl`)."""
    return ce_current + lambda_rep * ce_replay + lambda_dis * kl
