r"""The retrieval reading of FedOGL's server refinement, Eqs. (13)-(14) (docs/fedogl.md).

Per modality (own bank, Eq. (12), and graph, Eq. (13)), the class descriptors are the mean
propagated prototypes :math:`\mathbf{a}_c, \mathbf{b}_c`; with :math:`S_{cc'} =
\hat{H}_q(\mathbf{a}_c)^\top \hat{H}_v(\mathbf{b}_{c'})` (L2-normalised heads), only the
heads are refined on

.. math::
    \mathcal{L}_{align} = \gamma_t \Big[\lambda_{lab}\, \mathcal{L}_{nce}(S / T)
    + \lambda_{tr}\, \tfrac{1}{2}\big(\mathrm{KL}(\bar{\mathbf{q}}_{cli} \,\|\,
    \sigma(S/T)) + \mathrm{KL}(\bar{\mathbf{q}}^{\top}_{cli} \,\|\, \sigma(S^\top/T))\big)
    \Big]

No Lightning here.
"""

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
    r"""Soft targets of the alignment, the counterpart of
    :func:`~fedlightning.methods.fedogl.prototypes.client_consensus`:

    .. math::
        \bar{\mathbf{q}}_{cli} = \sum_r \frac{w_r}{\sum_s w_s}
        \sigma\big(\hat{H}^r_q(\mathbf{A}) \hat{H}^r_v(\mathbf{B})^\top / T\big)

    ``heads`` are the recent clients' ``(query, item)`` head state dicts; ``A``, ``B``
    :math:`(n, d)` pair by row. Returns the row and the column (transposed) targets,
    :math:`(n, n)` each, rows summing to 1.
    """
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
    r"""The bracket of :math:`\mathcal{L}_{align}` on L2-normalised class embeddings ``eq``,
    ``ev`` :math:`(n, d)` (row pairs); ``targets`` of :obj:`None` drops the KL term."""
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
    r""":func:`~fedlightning.methods.fedogl.prototypes.sgd_refine` on both projection heads, in
    place, against :math:`\gamma_t \cdot` :func:`alignment_loss`."""
    params = [*head_q.parameters(), *head_v.parameters()]
    A, B = A.detach().to(params[0]), B.detach().to(params[0])

    def loss_fn() -> Tensor:
        eq = F.normalize(head_q(A), dim=-1)
        ev = F.normalize(head_v(B), dim=-1)
        return alignment_loss(eq, ev, targets, temperature, lambda_lab, lambda_tr)

    return sgd_refine(loss_fn, params, gamma, steps, lr)
