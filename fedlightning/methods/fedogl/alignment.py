"""Retrieval's reading of FedOGL's Eqs. (13)-(14) (docs/fedogl.md): the heads refined on
``gamma [lambda_lab InfoNCE(S/T) + lambda_tr (KL rows + KL cols) / 2]`` over the class
descriptors' similarity ``S``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.methods.fedogl.prototypes import sgd_refine
from fedlightning.objectives import symmetric_info_nce
from fedlightning.server.aggregate import normalized_weights

__all__ = ["alignment_loss", "class_descriptors", "refine_heads", "similarity_consensus"]


def class_descriptors(P_tilde: Tensor, labels: Tensor, classes: Sequence[int]) -> Tensor:
    r"""Mean propagated prototype :math:`(|C|, d)` of each class, in ``classes``' order."""
    rows = []
    for c in classes:
        hit = labels == c
        if not bool(hit.any()):
            raise ValueError(f"class {c} has no prototype among labels {labels.tolist()}")
        rows.append(P_tilde[hit].mean(0))
    return torch.stack(rows)


def _embed(head: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """``normalize(x W^T + b)`` for a head given as a ``Linear`` state dict."""
    b = head.get("bias")
    return F.normalize(F.linear(x, head["weight"].to(x), None if b is None else b.to(x)), dim=-1)


def similarity_consensus(
    heads: Sequence[tuple[Mapping[str, Tensor], Mapping[str, Tensor]]],
    weights: Sequence[float],
    A: Tensor,
    B: Tensor,
    temperature: float,
) -> tuple[Tensor, Tensor]:
    """The alignment's ``q_cli`` (rows, columns) [n, n]: the weighted mean of the recent
    ``(query, item)`` heads' softmax of ``A B^T / T``."""
    w = normalized_weights(heads, weights, "head pair")
    a, b = A.detach().double(), B.detach().double()
    rows = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    cols = torch.zeros(b.shape[0], a.shape[0], dtype=torch.float64)
    for wr, (hq, hv) in zip(w.tolist(), heads, strict=True):
        s = _embed(hq, a) @ _embed(hv, b).T / temperature
        rows += wr * s.softmax(1)
        cols += wr * s.T.softmax(1)
    return rows.to(A.dtype), cols.to(A.dtype)


def alignment_loss(
    eq: Tensor,
    ev: Tensor,
    targets: tuple[Tensor, Tensor] | None,
    temperature: float,
    lambda_lab: float = 1.0,
    lambda_tr: float = 1.0,
) -> Tensor:
    """The bracket of the alignment loss; ``targets=None`` drops the KL term."""
    loss = lambda_lab * symmetric_info_nce(eq, ev, temperature)
    if targets is not None:
        s = eq @ ev.T / temperature
        rows, cols = (t.detach().to(s) for t in targets)
        kl_rows = F.kl_div(s.log_softmax(1), rows, reduction="batchmean")
        kl_cols = F.kl_div(s.T.log_softmax(1), cols, reduction="batchmean")
        loss = loss + lambda_tr * 0.5 * (kl_rows + kl_cols)
    return loss


def refine_heads(
    head_q: nn.Linear,
    head_v: nn.Linear,
    A: Tensor,
    B: Tensor,
    targets: tuple[Tensor, Tensor] | None,
    temperature: float,
    gamma: float,
    lambda_lab: float = 1.0,
    lambda_tr: float = 1.0,
    steps: int = 5,
    lr: float = 0.05,
) -> dict[str, float]:
    """:func:`sgd_refine` of both heads on :func:`alignment_loss`."""
    params = [*head_q.parameters(), *head_v.parameters()]
    A, B = A.detach().to(params[0]), B.detach().to(params[0])

    def loss_fn() -> Tensor:
        eq = F.normalize(head_q(A), dim=-1)
        ev = F.normalize(head_v(B), dim=-1)
        return alignment_loss(eq, ev, targets, temperature, lambda_lab, lambda_tr)

    return sgd_refine(loss_fn, params, gamma, steps, lr)
