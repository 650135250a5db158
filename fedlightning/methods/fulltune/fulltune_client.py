r"""The full-model FedAvg comparator's client: the bank's encoder fine-tuned with the adapter.

Paper 001, Table 3 and Sec. 5.4: the encoder trains too, so the message is the whole model.
Every step restarts from the bank's snapshot state and embeds the client's support (Eq. 12)
with the encoder's current weights (gradients flow through the states, TGN's memory updates
and the time encoding). The task loss is the family's (Eqs. 19 or 20-21), as for FedTIP,
without proximal or anchor terms.
"""

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
    """The adapter's inputs (:func:`~fedlightning.temporal.contexts.event_batch`'s, one client
    stacked) of the support, embedded as one batch from ``enc``'s current state (gradients
    to the encoder), which then ingests it."""
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
    """Encoder (a trainable copy of the bank's) and adapter (one copy) trained together on
    one client's support; every step restarts from ``snapshot``'s state. ``lr`` is the
    adapter's Adam step, ``encoder_lr`` the encoder's."""

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
        """The adapter follows ``mode``; the encoder stays in evaluation mode, as the bank's
        contexts were built (gradients still reach all of its parameters)."""
        super().train(mode)
        self.encoder.eval()
        return self

    def receive(self, state: dict[str, Tensor]) -> None:
        """Start a round from the global encoder and adapter (``encoder.*``, ``adapter.*``)."""
        self.load_state_dict(state, strict=False)

    def streamed(self, batch: Batch) -> Batch:
        """The support streamed from the bank's snapshot with the current weights."""
        restore_state(self.encoder, self._snapshot)
        return stream_support(self.encoder, self.stream, batch)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        views = family_views(self.adapter, self.streamed(batch), self.family)
        loss = task_loss(views, self.family, self.tau)
        self.last_loss = float(loss.detach())
        return loss

    @torch.no_grad()
    def prototypes(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """Eq. (18) after the fit: ``([C, d], [C])``."""
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
