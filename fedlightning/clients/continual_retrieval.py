r"""Class-incremental cross-modal retrieval: the retrieval reading of FedOGL's retention
objective, Eq. (5). Cross-entropy becomes the symmetric InfoNCE over paired nodes (node
:math:`i`'s query modality against its item modality, every other paired node a negative);
the task-start distillation acts on the teacher's similarity logits."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.clients.continual_client import ContinualNodeClassifier
from fedlightning.clients.losses import distillation_kl, retention_objective
from fedlightning.clients.node_classifier import OptimizerFactory
from fedlightning.objectives import symmetric_info_nce

__all__ = ["ContinualRetrievalClient", "similarity_distillation_kl"]


def similarity_distillation_kl(student_sim: Tensor, teacher_sim: Tensor, tau: float) -> Tensor:
    r"""Task-start distillation of Eq. (5) on similarity logits ``[n, m]``, without its
    weight: :math:`\tau^2 \frac{1}{n} \sum_i \mathrm{KL}(\sigma(S^{-}_{i,:}/\tau) \,\|\,
    \sigma(S_{i,:}/\tau))`, :math:`S^{-}` the frozen teacher's, :math:`S` the student's,
    :math:`\sigma` the row softmax; a scalar."""
    if student_sim.shape != teacher_sim.shape:
        raise ValueError(
            f"student and teacher similarities differ in shape: {tuple(student_sim.shape)} vs "
            f"{tuple(teacher_sim.shape)}"
        )
    if student_sim.numel() == 0:
        return student_sim.sum() * 0.0
    return distillation_kl(student_sim, teacher_sim, tau)  # rows of S play the logits' part


class ContinualRetrievalClient(ContinualNodeClassifier):
    r"""Local training at stage ``t`` for cross-modal retrieval: Eq. (5) with InfoNCE.

    .. math::
        \mathcal{L}_{k,t} = \mathcal{L}_{\mathrm{nce}}(\mathcal{D}_k^t)
        + \lambda_{\mathrm{rep}} \mathcal{L}_{\mathrm{nce}}(\mathcal{R}_k(t))
        + \lambda_{\mathrm{dis}} \tau^2 \tfrac{1}{2}\big[\mathrm{KL}(\sigma(S^-/\tau) \|
        \sigma(S/\tau)) + \mathrm{KL}(\sigma(S^{-\top}/\tau) \| \sigma(S^\top/\tau))\big]
        + \frac{\mu}{2}\lVert w - w^t \rVert^2

    over the paired nodes (``net.pair_mask``) of ``batch.sup_mask`` (in-batch negatives),
    of ``batch.replay_mask``, and, for the distillation, of what ``distill_on`` names, with
    :math:`S = q k^\top / T` of the student and :math:`S^-` of the frozen task-start
    teacher. Arguments as :class:`ContinualNodeClassifier`'s; ``net`` returns ``(q, k)``
    (e.g. :class:`~fedlightning.models.cross_modal.CrossModalGNN`); ``temperature`` is the
    InfoNCE temperature :math:`T` (default ``0.1``)."""

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        prox_mu: float = 0.0,
        lambda_rep: float = 1.0,
        lambda_dis: float = 0.0,
        tau: float = 2.0,
        distill_on: str = "replay",
        temperature: float = 0.1,
    ) -> None:
        if temperature <= 0 or tau <= 0:
            raise ValueError(f"temperature and tau must be > 0, got {temperature}, {tau}")
        super().__init__(net, optimizer, prox_mu, lambda_rep, lambda_dis, tau, distill_on)
        self.temperature = temperature

    def _distill(self, batch: Data, q: Tensor, k: Tensor, mask: Tensor) -> Tensor:
        with torch.no_grad():
            tq, tk = self._teacher[0](batch)
            teacher = tq[mask] @ tk[mask].T / self.temperature
        student = q[mask] @ k[mask].T / self.temperature
        return 0.5 * (
            similarity_distillation_kl(student, teacher, self.tau)
            + similarity_distillation_kl(student.T, teacher.T, self.tau)
        )

    def training_step(self, batch: Data, batch_idx: int = 0) -> Tensor:
        q, k = self.net(batch)
        return self.with_proximal(self.retrieval_loss(batch, q, k))

    def retrieval_loss(self, batch: Data, q: Tensor, k: Tensor) -> Tensor:
        """Eq. (5) with InfoNCE on the embeddings ``q``, ``k`` of ``batch``, without the
        proximal term."""
        pairs = self.net.pair_mask(batch)
        cur = batch.sup_mask & pairs
        nce_cur = symmetric_info_nce(q[cur], k[cur], self.temperature)
        zero = nce_cur * 0.0
        rep = batch.replay_mask & pairs
        nce_rep = symmetric_info_nce(q[rep], k[rep], self.temperature) if self.lambda_rep else zero
        kl = zero
        if self._teacher:
            mask = self.distill_mask(batch) & pairs
            if bool(mask.any()):
                kl = self._distill(batch, q, k, mask)
        return retention_objective(nce_cur, nce_rep, kl, self.lambda_rep, self.lambda_dis)
