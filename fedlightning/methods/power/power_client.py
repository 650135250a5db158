"""POWER's client side (Zhu, Hu and Wu, KDD 2025; docs/fedogl.md, "POWER"): the
coverage-maximising replay selection and the replay-weighted local objective."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.clients.continual_client import ContinualNodeClassifier
from fedlightning.clients.losses import restrict_logits


def coverage_max(embedding: Tensor, budget: int, eta: float = 0.1) -> Tensor:
    """POWER's greedy coverage selection of ``budget`` rows (positions, in choice order): a
    row covers those nearer than ``eta`` times the mean distance; at 90% covered, restart."""
    n = embedding.size(0)
    if n == 0 or budget <= 0:
        return torch.zeros(0, dtype=torch.long)
    dist = torch.cdist(embedding, embedding, p=2)
    cover = dist < dist.mean() * eta
    live = cover.clone()
    chosen: list[int] = []
    covered: set[int] = set()
    while len(chosen) < min(budget, n):
        counts = live.sum(0)
        if chosen:
            counts[chosen] = -1  # a chosen node is never chosen again
        i = int(counts.argmax())
        chosen.append(i)
        new = live[i].nonzero().view(-1)
        covered |= set(new.tolist())
        live[new, :] = False
        live[:, new] = False
        if len(covered) >= 0.9 * n:
            covered = set(chosen)
            live = cover.clone()
            live[chosen, :] = False
            live[:, chosen] = False
    return torch.tensor(chosen, dtype=torch.long)


def power_objective(ce_new: Tensor, ce_replay: Tensor | None, beta: float) -> Tensor:
    """POWER's local loss ``beta CE_new + (1 - beta) CE_replay`` (``CE_new`` alone if empty)."""
    if ce_replay is None:
        return ce_new
    return beta * ce_new + (1.0 - beta) * ce_replay


class PowerNodeClassifier(ContinualNodeClassifier):
    """POWER's local training: :func:`power_objective` over the known-class logits."""

    def __init__(self, net: nn.Module, optimizer: Any, beta: float = 0.01) -> None:
        super().__init__(net, optimizer, lambda_dis=0.0)
        self.beta = beta

    def objective(self, full: Tensor, batch: Data, teacher: Tensor | None = None) -> Tensor:
        logits = restrict_logits(full, self.known)
        ce_new = self._ce(logits, batch.y, batch.sup_mask)
        replay = batch.replay_mask
        ce_rep = self._ce(logits, batch.y, replay) if bool(replay.any()) else None
        return power_objective(ce_new, ce_rep, self.beta)


def fused_input(data: Data, modalities: list[str], nodes: Tensor) -> Tensor:
    """GE's input: the modalities' raw features (zeros where absent), concatenated."""
    parts = []
    for j, m in enumerate(modalities):
        x = data[f"x_{m}"].index_select(0, nodes)
        x = x.to_dense() if x.layout == torch.sparse_coo else x
        parts.append(x.float() * data.modality_mask[nodes, j].unsqueeze(1).float())
    return torch.cat(parts, dim=1)


def pseudo_graph(x: Tensor, dims: dict[str, int]) -> Data:
    """Pseudo-nodes ``x`` as isolated nodes with every modality available."""
    parts = torch.split(x, list(dims.values()), dim=1)
    graph = Data(edge_index=torch.zeros(2, 0, dtype=torch.long), num_nodes=x.size(0))
    for m, part in zip(dims, parts, strict=True):
        graph[f"x_{m}"] = part
    graph.modality_mask = torch.ones(x.size(0), len(dims), dtype=torch.bool)
    return graph
