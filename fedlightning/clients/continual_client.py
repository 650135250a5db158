"""Class-incremental node classification: known-class head, replay and task-start teacher."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.clients.losses import distillation_kl, restrict_logits, retention_objective
from fedlightning.clients.node_classifier import NodeClassifier
from fedlightning.models.constant import kept_output

DISTILL_ON = ("replay", "current", "both")


class ContinualNodeClassifier(NodeClassifier):
    r"""Local training at stage ``t`` with FedOGL's retention objective, Eq. (5), over logits
    restricted to the known classes :math:`\mathcal{C}_K^t`: CE on ``batch.sup_mask``, plus
    ``lambda_rep`` x CE on ``batch.replay_mask``, plus ``lambda_dis * tau^2 * KL(teacher ||
    student)`` over the teacher's known classes on the nodes ``distill_on`` names
    (``"replay"``, ``"current"`` or ``"both"``), plus FedProx's term when ``prox_mu > 0``.
    ``lambda_dis=0`` disables the teacher; replay off leaves distillation on. ``net``,
    ``optimizer``, ``prox_mu``: as in :class:`NodeClassifier`."""

    stackable = True  # training_step is objective(net, teacher) + the proximal term
    loss_masks = ("sup_mask", "replay_mask")  # Eq. (5)'s nodes: a mini-batch's seeds

    def __init__(
        self,
        net: nn.Module,
        optimizer: Any,
        prox_mu: float = 0.0,
        lambda_rep: float = 1.0,
        lambda_dis: float = 0.0,
        tau: float = 2.0,
        distill_on: str = "replay",
    ) -> None:
        super().__init__(net, optimizer, prox_mu)
        if distill_on not in DISTILL_ON:
            raise ValueError(f"distill_on must be one of {DISTILL_ON}, got {distill_on!r}")
        self.lambda_rep, self.lambda_dis, self.tau = lambda_rep, lambda_dis, tau
        self.distill_on = distill_on
        self.known = torch.zeros(0, dtype=torch.long)  # known class ids, ascending
        self.teacher_known = torch.zeros(0, dtype=torch.long)
        self._teacher: list[nn.Module] = []  # a list keeps it out of parameters()/state_dict()

    def set_stage(
        self, known: Tensor, teacher_state: dict[str, Tensor] | None, teacher_known: Tensor | None
    ) -> None:
        """Known classes for this stage, and the frozen task-start teacher (or none)."""
        self.known = known
        if teacher_state is None or self.lambda_dis == 0 or teacher_known is None:
            self._teacher, self.teacher_known = [], torch.zeros(0, dtype=torch.long)
            return
        if not self._teacher:
            self._teacher = [copy.deepcopy(self.net).requires_grad_(False)]
        self._teacher[0].load_state_dict(teacher_state)
        self._teacher[0].eval()
        self._teacher_state = teacher_state  # what its logits depend on (teacher_logits)
        self.teacher_known = teacher_known

    def on_fit_start(self) -> None:
        """Move what Lightning does not manage (teacher, class ids, anchor) to the device."""
        dev = self.device
        self.known, self.teacher_known = self.known.to(dev), self.teacher_known.to(dev)
        if self._teacher:
            self._teacher[0].to(dev)
        self.anchor = {k: v.to(dev) for k, v in self.anchor.items()}

    def class_index(self, y: Tensor) -> Tensor:
        """Map class ids to positions in the known-class head."""
        lookup = torch.full((int(self.known.max()) + 1,), -1, dtype=torch.long, device=y.device)
        lookup[self.known] = torch.arange(self.known.numel(), device=y.device)
        return lookup[y]

    def _ce(self, logits: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        if not bool(mask.any()):
            return logits.sum() * 0.0
        return F.cross_entropy(logits[mask], self.class_index(y[mask]))

    def distill_mask(self, batch: Data) -> Tensor:
        if self.distill_on == "current":
            return batch.sup_mask
        if self.distill_on == "replay":
            return batch.replay_mask
        return batch.sup_mask | batch.replay_mask

    def training_step(self, batch: Data, batch_idx: int = 0) -> Tensor:
        full = self.net(batch)
        return self.with_proximal(self.objective(full, batch, self.teacher_logits(batch)))

    def teacher_logits(self, batch: Data) -> Tensor | None:
        """The task-start teacher's logits on ``batch`` (no gradient), or ``None`` when the
        distillation term is off (no teacher, no distilled node, no old class)."""
        mask = self.distill_mask(batch) if self._teacher else None
        if mask is None or not bool(mask.any()) or self.teacher_known.numel() == 0:
            return None
        # frozen, in eval mode: the same logits on a stage's batch every step and round
        return kept_output(self._teacher[0], batch, [self._teacher_state])

    def objective(self, full: Tensor, batch: Data, teacher: Tensor | None = None) -> Tensor:
        """Eq. (5) from the net's logits ``full`` on ``batch`` and the teacher's (``None``:
        no distillation term)."""
        logits = restrict_logits(full, self.known)
        ce_cur = self._ce(logits, batch.y, batch.sup_mask)
        ce_rep = self._ce(logits, batch.y, batch.replay_mask) if self.lambda_rep else ce_cur * 0
        kl = ce_cur * 0
        mask = self.distill_mask(batch) if teacher is not None else None
        if mask is not None and bool(mask.any()) and self.teacher_known.numel() > 0:
            old = restrict_logits(teacher, self.teacher_known)[mask]
            kl = distillation_kl(restrict_logits(full, self.teacher_known)[mask], old, self.tau)
        return retention_objective(ce_cur, ce_rep, kl, self.lambda_rep, self.lambda_dis)
