"""The full-model comparator's client: every step restarts from the bank's snapshot and embeds
the support (Eq. 12) with the encoder's current weights; the family's loss (Eqs. 19-21)."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from fedlightning.clients.temporal_prompt import (
    FAMILIES,
    family_prototypes,
    family_views,
    task_loss,
)
from fedlightning.data.temporal.events import EventStream
from fedlightning.temporal.adapter import PromptAdapter
from fedlightning.temporal.bank import event_tensors
from fedlightning.temporal.contexts import pre_event_states, restore_state
from fedlightning.temporal.encoders import time_encoder

Batch = dict[str, Tensor]


def stream_support(enc, stream: EventStream, batch: Batch) -> Batch:
    """The support's adapter inputs embedded from ``enc``'s state (with gradients), which
    then ingests it."""
    idx = batch["events"].numpy()
    if len(idx) == 0:
        raise ValueError("a client's support has no event")
    src, dst, t, msg = event_tensors(enc, stream, idx)
    h, dt = pre_event_states(enc, src, dst, t, batch["neg_id"].clamp(min=0))
    out = dict(zip(("h_u", "h_i", "h_j"), h.split(len(idx)), strict=True))
    out["te"] = time_encoder(enc)(dt[: len(idx)]).float()
    out.update(zip(("r_u", "r_i", "r_j"), dt.log1p().split(len(idx)), strict=True))
    enc.ingest(src, dst, t, msg, torch.from_numpy(np.ascontiguousarray(idx)))
    out = {k: v.unsqueeze(0) for k, v in out.items()}
    for key in ("x", "y", "neg_ok"):
        out[key] = batch[key].unsqueeze(0)
    out["mask"] = torch.ones(1, len(idx), dtype=torch.bool)
    return out


class FullTuneClient(pl.LightningModule):
    """A trainable copy of the bank's encoder and the adapter, trained together."""

    def __init__(
        self,
        encoder: torch.nn.Module,
        snapshot: torch.nn.Module,
        adapter: PromptAdapter,
        stream: EventStream,
        family: str,
        tau: float = 0.1,
        lr: float = 1e-3,
        encoder_lr: float = 1e-4,
        weight_decay: float = 1e-5,
    ) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        self.encoder, self.adapter = encoder, adapter
        object.__setattr__(self, "_snapshot", snapshot)  # read-only: not a submodule
        self.stream, self.family = stream, family
        self.tau, self.lr, self.encoder_lr, self.weight_decay = tau, lr, encoder_lr, weight_decay
        for p in self.encoder.parameters():
            p.requires_grad_(True)
        self.last_loss = float("nan")

    def train(self, mode: bool = True) -> FullTuneClient:
        """The encoder stays in evaluation mode, as the bank's contexts were built."""
        super().train(mode)
        self.encoder.eval()
        return self

    def receive(self, state: dict[str, Tensor]) -> None:
        self.load_state_dict(state, strict=False)

    def streamed(self, batch: Batch) -> Batch:
        restore_state(self.encoder, self._snapshot)
        return stream_support(self.encoder, self.stream, batch)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        views = family_views(self.adapter, self.streamed(batch), self.family)
        loss = task_loss(views, self.family, self.tau)
        self.last_loss = float(loss.detach())
        return loss

    @torch.no_grad()
    def prototypes(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """Eq. (18) after the fit."""
        self.eval()
        q, counts = family_prototypes(
            family_views(self.adapter, self.streamed(batch), self.family), self.family
        )
        return q[0], counts[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(
            [
                {"params": list(self.adapter.parameters()), "lr": self.lr},
                {"params": list(self.encoder.parameters()), "lr": self.encoder_lr},
            ],
            weight_decay=self.weight_decay,
        )
