r"""FedTIP's client: the prompt adapter's local fit (paper 001, Sec. 4.3, Eq. (26)).

.. math::
    \mathcal{L}_k = \mathcal{L}_k^{task} + \lambda_p \lVert \Omega_k - \Omega^{(r)} \rVert_2^2
    + \lambda_a \mathcal{L}_k^{anchor}

with the prototypical loss (Eqs. 18-19, ``family="nc"``) or the two-way softmax over the
positive and the client-visible negative (Eqs. 20-21, 25, ``family="lp"``, whose "classes"
are the negative (0) and the positive pair (1)), and the anchor term (Eq. 22). Only the
adapter :math:`\Omega` of Eq. (17) trains, on the bank's precomputed contexts
(:func:`fedlightning.temporal.contexts.event_batch`), a round's clients stacked."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from fedlightning.metrics.temporal import auroc, class_score, link_auroc
from fedlightning.temporal.adapter import (
    ClassMasks,
    PromptAdapter,
    anchor_loss,
    class_masks,
    class_prototypes,
    event_context,
    flat_start,
    link_loss,
    prototypical_loss,
    proximal_flat,
)

FAMILIES = ("nc", "lp")
NUM_CLASSES = 2  # state labels are binary; link prediction: negative (0), positive (1)

Batch = dict[str, Tensor]


def stack_batches(batches: Sequence[Batch], length: int = 0) -> Batch:
    """Client batches ``[n_k, ...]`` stacked to ``[K, N, ...]`` (zero-padded to the largest
    ``n_k``, or to ``length`` if larger: a share of a round padded as the round's stack) with
    ``mask`` ``[K, N]`` marking the real events."""
    n = max(length, *(len(b["h_u"]) for b in batches))
    out = {
        k: torch.zeros((len(batches), n, *v.shape[1:]), dtype=v.dtype)
        for k, v in batches[0].items()
    }
    out["mask"] = torch.zeros(len(batches), n, dtype=torch.bool)
    for k, b in enumerate(batches):
        for key in batches[0]:
            out[key][k, : len(b[key])] = b[key]
        out["mask"][k, : len(b["h_u"])] = True
    return out


def view_inputs(batch: Batch, family: str) -> dict[str, Any]:
    r"""What :func:`family_views` and :func:`family_prototypes` read of a stacked ``batch``
    (``[K, N, ...]``) that no parameter touches: each side's event context (Eq. 13) and
    :math:`[\mathbf{h}_u \| \mathbf{h}_\cdot]`, the family's mask, and the class masks
    of Eq. (18): built once a batch, the views and prototypes are bitwise those built without."""
    b = batch
    out: dict[str, Any] = {}
    for side in ("i",) if family == "nc" else ("i", "j"):
        h = b[f"h_{side}"]
        out[f"z_{side}"] = event_context(b["h_u"], h, b["te"], b["x"], b["r_u"], b[f"r_{side}"])
        out[f"pair_{side}"] = torch.cat([b["h_u"], h], -1)
    if family == "nc":
        out["mask"] = b["mask"]
        out["classes"] = class_masks(b["y"], b["mask"], NUM_CLASSES, b["h_u"].dtype)
    else:
        mask = out["mask"] = b["mask"] & b["neg_ok"]
        y = torch.cat([torch.zeros_like(mask), torch.ones_like(mask)], 1).long()
        both = torch.cat([mask, mask], 1)
        out["classes"] = class_masks(y, both, NUM_CLASSES, b["h_u"].dtype)
    return out


def family_views(
    adapter: PromptAdapter, batch: Batch, family: str, inputs: dict[str, Any] | None = None
) -> tuple[Tensor, ...]:
    r"""The prompted representations (Eq. 16) a family's loss and prototypes read: ``"nc"``
    :math:`(\tilde{\mathbf{h}}_e, y, \mathrm{mask})`; ``"lp"`` (in
    :func:`~fedlightning.temporal.adapter.link_loss`'s order) :math:`(\tilde{\mathbf{h}}_{u,i,t},
    \mathbf{h}_i, \tilde{\mathbf{h}}_{u,j,t}, \mathbf{h}_j, \mathrm{mask})`, positive and
    negative sharing TE and the features, masked to the events whose negative exists.
    ``inputs``: :func:`view_inputs` of ``batch``, if already built."""
    b = batch

    def prompt(side: str) -> Tensor:
        if inputs is not None:
            return adapter.prompted(inputs[f"z_{side}"], inputs[f"pair_{side}"], b["te"], b["x"])
        return adapter(b["h_u"], b[f"h_{side}"], b["te"], b["x"], b["r_u"], b[f"r_{side}"])

    if family == "nc":
        return prompt("i"), b["y"], b["mask"]
    mask = inputs["mask"] if inputs is not None else b["mask"] & b["neg_ok"]
    return prompt("i"), b["h_i"], prompt("j"), b["h_j"], mask


def family_prototypes(
    views: tuple[Tensor, ...], family: str, classes: ClassMasks | None = None
) -> tuple[Tensor, Tensor]:
    """Eq. (18) per client and class from :func:`family_views`: ``([K, C, d], [K, C])``
    (``classes``: :func:`view_inputs`' ``classes``, if already built)."""
    if family == "nc":
        h, y, mask = views
        return class_prototypes(h, y, mask, NUM_CLASSES, classes)
    h_pos, _, h_neg, _, mask = views
    if classes is not None:
        return class_prototypes(torch.cat([h_neg, h_pos], 1), mask, mask, NUM_CLASSES, classes)
    y = torch.cat([torch.zeros_like(mask), torch.ones_like(mask)], 1).long()
    return class_prototypes(
        torch.cat([h_neg, h_pos], 1), y, torch.cat([mask, mask], 1), NUM_CLASSES
    )


def class_members(views: tuple[Tensor, ...], family: str, k: int, c: int) -> Tensor:
    """Client ``k``'s prompted representations of class ``c`` (for the release of Eq. 7)."""
    if family == "nc":
        h, y, mask = views
        return h[k][mask[k] & (y[k] == c)]
    h_pos, _, h_neg, _, mask = views
    return (h_pos if c == 1 else h_neg)[k][mask[k]]


def task_loss(
    views: tuple[Tensor, ...], family: str, tau: float, classes: ClassMasks | None = None
) -> Tensor:
    """Eq. (19) (``nc``) or Eqs. (20)-(21) (``lp``) from :func:`family_views`, summed over
    the supports of all stacked clients (``classes``: as :func:`family_prototypes`')."""
    if family == "nc":
        h, y, mask = views
        return prototypical_loss(h, y, mask, NUM_CLASSES, tau, classes)
    return link_loss(*views, tau=tau)


def as_single(batch: Batch) -> Batch:
    """One segment as a one-client stack (the server's evaluation batches)."""
    return stack_batches([batch])


@torch.no_grad()
def score_segment(
    adapter: PromptAdapter, prototypes: dict[int, Tensor], batch: Batch, family: str
) -> dict[str, float]:
    """Server-side AUC-ROC of one segment (a one-client stack): ``auc_nc`` against the
    class prototypes, or ``auc_tlp`` and ``auc_ilp`` (the events flagged inductive). A model
    with a ``views(batch, family)`` method (the published baselines) gives the family's
    representations itself."""
    adapter.eval()
    own = getattr(adapter, "views", None)  # a baseline's model reads its own inputs
    views = own(batch, family) if own is not None else family_views(adapter, batch, family)
    if family == "nc":
        h, y, mask = views
        if not {0, 1} <= set(prototypes):
            return {"auc_nc": math.nan}
        return {"auc_nc": auroc(class_score(h[mask], prototypes), y[mask])}
    h_pos, h_i, h_neg, h_j, mask = views
    out = {"auc_tlp": link_auroc(h_pos[mask], h_i[mask], h_neg[mask], h_j[mask])}
    ind = mask & batch["inductive"]
    out["auc_ilp"] = link_auroc(h_pos[ind], h_i[ind], h_neg[ind], h_j[ind])
    return out


class FedTIPClient(pl.LightningModule):
    """The local objective of Eq. (26) over the stacked supports of a round's clients:
    ``tau`` is the temperature of Eqs. (19)-(21), ``lambda_p`` and ``lambda_a`` the proximal
    and anchor weights, ``lr`` and ``weight_decay`` Adam's."""

    def __init__(
        self,
        adapter: PromptAdapter,
        family: str,
        tau: float = 0.1,
        lambda_p: float = 1e-2,
        lambda_a: float = 1e-1,
        lr: float = 1e-3,
        weight_decay: float = 1e-5,
    ) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        self.adapter, self.family = adapter, family
        self.tau, self.lambda_p, self.lambda_a = tau, lambda_p, lambda_a
        self.lr, self.weight_decay = lr, weight_decay
        self.start: dict[str, Tensor] = {}
        self.start_flat = torch.zeros(0)
        self.adapter_params: list[Tensor] = []
        self.anchors = torch.zeros(NUM_CLASSES, adapter.d_h)
        self.has_anchor = torch.zeros(NUM_CLASSES, dtype=torch.bool)
        self.last_loss = float("nan")
        self._inputs: tuple[Batch, dict[str, Any]] | None = None

    def receive(
        self,
        omega: dict[str, Tensor],
        anchors: dict[int, Tensor],
        copies: int,
        first: int = 0,
        total: int | None = None,
    ) -> None:
        r"""Start ``copies`` clients (the round's ``first ..`` of ``total``, default all:
        :meth:`~fedlightning.temporal.adapter.PromptAdapter.place`) from the server's
        :math:`\Omega^{(r)}` and anchors :math:`\bar{\mathbf{q}}_c^{(r)}`."""
        if self.adapter.copies != copies:
            self.adapter = self.adapter.stacked(copies)
        self.adapter.place(first, copies if total is None else total)
        self.adapter.load_copies(omega)
        self.start = {k: v.detach().clone() for k, v in omega.items()}
        self.start_flat = flat_start(self.adapter, self.start)
        self.adapter_params = list(self.adapter.parameters())
        self.has_anchor = torch.zeros(NUM_CLASSES, dtype=torch.bool)
        self.anchors = torch.zeros(NUM_CLASSES, self.adapter.d_h)
        for c, a in anchors.items():
            self.anchors[c], self.has_anchor[c] = a, True

    def inputs_of(self, batch: Batch) -> dict[str, Any] | None:
        """:func:`view_inputs` of ``batch``, built on the first step that reads it and kept
        while the fits read the same tensors (a task's rounds: each step gets a shallow
        copy of the batch); ``None`` for an adapter without
        :meth:`~fedlightning.temporal.adapter.PromptAdapter.prompted`."""
        if not isinstance(self.adapter, PromptAdapter):
            return None
        kept = self._inputs[0] if self._inputs is not None else None
        if (
            kept is None
            or kept.keys() != batch.keys()
            or any(batch[k] is not v for k, v in kept.items())
        ):
            self._inputs = (dict(batch), view_inputs(batch, self.family))
        return self._inputs[1]

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        inputs = self.inputs_of(batch)
        classes = inputs["classes"] if inputs is not None else None
        views = family_views(self.adapter, batch, self.family, inputs)
        loss = task_loss(views, self.family, self.tau, classes)
        if self.lambda_p:
            loss = loss + self.lambda_p * proximal_flat(self.adapter_params, self.start_flat)
        if self.lambda_a and bool(self.has_anchor.any()):
            q, counts = family_prototypes(views, self.family, classes)
            loss = loss + self.lambda_a * anchor_loss(q, counts, self.anchors, self.has_anchor)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(
            self.adapter.parameters(), lr=self.lr, weight_decay=self.weight_decay, foreach=True
        )

    def optimizer_zero_grad(
        self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer
    ) -> None:
        """``optimizer.zero_grad()`` (its ``set_to_none`` default) without the profiler
        range and grouping torch wraps it in: a step of these tiny tensors felt them."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
