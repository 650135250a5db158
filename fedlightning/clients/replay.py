"""Class-balanced replay memory and the per-stage training graph of a client."""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from torch_geometric.data import Data


def class_balanced_sample(
    nodes: Tensor, labels: Tensor, budget: int, generator: torch.Generator
) -> Tensor:
    """Up to ``budget`` of the candidate ``nodes`` ``[n]`` of each class (``labels`` ``[n]``),
    uniformly without replacement, sorted; ``budget=0`` keeps nothing."""
    if budget <= 0 or nodes.numel() == 0:
        return nodes[:0]
    keep = []
    for c in labels.unique(sorted=True).tolist():
        members = nodes[labels == c]
        perm = torch.randperm(members.numel(), generator=generator)[:budget]
        keep.append(members[perm])
    return torch.cat(keep).sort().values


def stage_batch(data: Data, known: Tensor, supervised_classes: Tensor, replay: Tensor) -> Data:
    """A client's training graph at a stage, induced on its nodes of known classes (so
    unknown-class nodes appear only in evaluation), with ``sup_mask`` (training nodes of the
    classes it observes this stage) and ``replay_mask`` (the ``replay`` nodes)."""
    keep = torch.isin(data.y, known)
    sup = data.train_mask & torch.isin(data.y, supervised_classes)
    rep = torch.zeros_like(sup)
    rep[replay] = True
    batch = copy.copy(data)  # shallow: subgraph makes new tensors, data keeps its own
    batch.sup_mask, batch.replay_mask = sup, rep & ~sup
    return batch.subgraph(keep.nonzero().view(-1))  # indices: a sparse modality too
