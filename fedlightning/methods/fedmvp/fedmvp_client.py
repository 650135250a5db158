"""FedMVP's local training: Eq. (5)'s CE terms on the prompted cosine classifier plus the
consistency of the prompted feature with the frozen view (docs/fedogl.md, "FedMVP")."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.clients.continual_client import ContinualNodeClassifier


def consistency_loss(prompted: Tensor, frozen: Tensor) -> Tensor:
    """FedMVP's consistency term: the mean ``1 - cos`` of the prompted and frozen features."""
    if prompted.size(0) == 0:
        return prompted.sum() * 0.0
    return (1.0 - F.cosine_similarity(prompted, frozen, dim=-1)).mean()


class FedMVPClassifier(ContinualNodeClassifier):
    """The parent's objective plus ``alpha`` times the consistency of ``z`` with the frozen
    view's unprompted ``f`` (eval mode, clean input) on the training nodes."""

    stackable = False  # the loss reads the frozen view's features

    def __init__(self, net: nn.Module, optimizer: Any, alpha: float = 10.0, **kw: Any) -> None:
        super().__init__(net, optimizer, **kw)
        self.alpha = float(alpha)
        self._frozen: list[nn.Module] = []  # a list keeps it out of parameters()/state_dict()
        self._view: tuple[Data, Tensor] | None = None  # (batch, frozen f) of the current fit

    def set_frozen(self, state: dict[str, Tensor] | None) -> None:
        self._view = None
        if state is None or self.alpha <= 0:
            self._frozen = []
            return
        if not self._frozen:
            self._frozen = [copy.deepcopy(self.net).requires_grad_(False)]
        self._frozen[0].load_state_dict(state)
        self._frozen[0].eval()

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self._frozen:
            self._frozen[0].to(self.device)

    def training_step(self, batch: Data, batch_idx: int = 0) -> Tensor:
        reps = self.net.representations(batch)
        logits = self.net.head(self.net.dropout(reps["z"]))
        loss = self.objective(logits, batch, self.teacher_logits(batch))
        if self.alpha > 0 and self._frozen:
            m = batch.sup_mask | batch.replay_mask
            loss = loss + self.alpha * consistency_loss(reps["z"][m], self.frozen_view(batch)[m])
        return self.with_proximal(loss)

    @torch.no_grad()
    def frozen_view(self, batch: Data) -> Tensor:
        """The frozen view's unprompted ``f``, once per fit."""
        if self._view is None or self._view[0] is not batch:
            self._view = (batch, self._frozen[0].unprompted(batch)["f"])
        return self._view[1]
