"""Class-balanced replay memory and the per-stage training graph of a client."""

from __future__ import annotations

import torch
from torch import Tensor
from torch_geometric.data import Data


def class_balanced_sample(
    nodes: Tensor, labels: Tensor, budget: int, generator: torch.Generator
) -> Tensor:
    """Up to ``budget`` nodes of each class, uniformly without replacement (sorted).

    Args:
        nodes: candidate node indices ``[n]``. labels: their classes ``[n]``.
        budget: per-class budget; ``0`` keeps nothing.
    """
    if budget <= 0 or nodes.numel() == 0:
        return nodes[:0]
    keep = []
    for c in labels.unique(sorted=True).tolist():
        members = nodes[labels == c]
        perm = torch.randperm(members.numel(), generator=generator)[:budget]
        keep.append(members[perm])
    return torch.cat(keep).sort().values


def stage_batch(data: Data, known: Tensor, supervised_classes: Tensor, replay: Tensor) -> Data:
    """A client's training graph at a stage: induced on its nodes of known classes.

    Unknown-class nodes and their edges are absent, so they can only appear in evaluation.
    ``sup_mask`` marks the training nodes of the classes the client observes this stage;
    ``replay_mask`` marks the replayed nodes (indices into ``data``).
    """
    keep = torch.isin(data.y, known)
    sup = data.train_mask & torch.isin(data.y, supervised_classes)
    rep = torch.zeros_like(sup)
    rep[replay] = True
    batch = data.clone()
    batch.sup_mask, batch.replay_mask = sup, rep & ~sup
    return batch.subgraph(keep)
