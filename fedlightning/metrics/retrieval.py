r"""Cross-modal retrieval: Recall@k of paired embeddings and the max-similarity score.

Query ``i`` and item ``i`` form a pair; every other item is a distractor. Similarity is
cosine similarity."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["cosine_similarity_matrix", "max_similarity", "recall_at_k"]


def cosine_similarity_matrix(queries: Tensor, items: Tensor) -> Tensor:
    r"""Pairwise cosine similarities :math:`S_{i,l} = \cos(q_i, v_l)`.

    Zero vectors have similarity 0 to everything (``F.normalize`` with its epsilon).

    Shapes: input ``queries`` :math:`(n, d)`, ``items`` :math:`(m, d)`; output :math:`(n, m)`."""
    if queries.dim() != 2 or items.dim() != 2 or queries.shape[1] != items.shape[1]:
        raise ValueError(
            f"expected queries [n, d] and items [m, d], got {tuple(queries.shape)} and "
            f"{tuple(items.shape)}"
        )
    return F.normalize(queries, dim=1) @ F.normalize(items, dim=1).T


def recall_at_k(queries: Tensor, items: Tensor, k: int = 1) -> Tensor:
    r"""Whether each query's paired item is among its top-:math:`k` items by cosine similarity.

    .. math::
        \mathrm{rank}_i = \#\{l : S_{i,l} > S_{i,i}\} + \#\{l \ne i : S_{i,l} = S_{i,i}\},
        \qquad \mathrm{hit}_i = [\mathrm{rank}_i < k]

    Ties rank above the pair (pessimistic), so a degenerate encoder (e.g. constant
    embeddings) scores 0. ``hit.float().mean()`` is Recall@k, :math:`k \ge 1`.

    Shapes: input ``queries`` :math:`(n, d)`, ``items`` :math:`(n, d)`; output :math:`(n,)`
    bool."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if queries.shape[0] != items.shape[0]:
        raise ValueError(
            f"queries and items must pair row by row, got {queries.shape[0]} and {items.shape[0]}"
        )
    sim = cosine_similarity_matrix(queries, items)
    # read from the same matrix, so ties compare bit-identical values
    pos = sim.diagonal().unsqueeze(1)
    above = (sim > pos).sum(dim=1)
    ties = (sim == pos).sum(dim=1) - 1  # minus the paired item itself
    return (above + ties) < k


def max_similarity(queries: Tensor, items: Tensor) -> Tensor:
    r"""Rejection score of each query: its highest cosine similarity to any item.

    .. math::
        s_i = \max_{l} \cos(q_i, v_l)

    Shapes: input ``queries`` :math:`(n, d)`, ``items`` :math:`(m, d)`, :math:`m \ge 1`;
    output :math:`(n,)`."""
    if items.shape[0] == 0:
        raise ValueError("no items to compare with")
    return cosine_similarity_matrix(queries, items).amax(dim=1)
