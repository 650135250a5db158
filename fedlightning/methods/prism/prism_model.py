"""PRISM's imputing backbone (docs/fedogl.md, "PRISM"): a missing modality retrieved from the
server's paired class prototypes ``paired`` [C, M, hidden] under a topology-aware gate, plus
a structural prompt."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.models.multimodal import MultimodalGNN

PAIRED_BUFFER, PAIRED_SEEN_BUFFER = "paired", "paired_seen"


def retrieval_similarity(h: list[Tensor], mask: Tensor, paired: Tensor) -> Tensor:
    """[N, C]: the mean cosine of a node's available modalities to each class's prototypes."""
    sims = torch.stack(
        [F.normalize(x, dim=-1) @ F.normalize(paired[:, j], dim=-1).t() for j, x in enumerate(h)],
        dim=1,
    )  # [N, M, C]
    a = mask.to(sims.dtype).unsqueeze(-1)
    return (sims * a).sum(1) / a.sum(1).clamp(min=1.0)


def retrieval_weights(sim: Tensor, seen: Tensor, k: int, tau: float) -> Tensor:
    """[N, C]: the softmax of ``sim / tau`` over each node's top-``k`` ``seen`` classes."""
    n_seen = int(seen.sum())
    if n_seen == 0:
        return torch.zeros_like(sim)
    masked = sim.masked_fill(~seen, float("-inf"))
    top = masked.topk(min(k, n_seen), dim=-1)
    w = torch.softmax(top.values / tau, dim=-1)
    return torch.zeros_like(sim).scatter(-1, top.indices, w)


def impute(weights: Tensor, paired: Tensor, modality: int) -> Tensor:
    """The retrieved embedding of ``modality``, ``weights @ P[:, m]``."""
    return weights @ paired[:, modality]


def neighbour_agreement(weights: Tensor, edge_index: Tensor) -> Tensor:
    """[N]: the cosine of a node's weights to its neighbours' mean."""
    src, dst = edge_index
    total = torch.zeros_like(weights).index_add(0, dst, weights[src])
    deg = torch.zeros(weights.size(0), dtype=weights.dtype, device=weights.device)
    deg = deg.index_add(0, dst, torch.ones_like(dst, dtype=weights.dtype))
    mean = total / deg.clamp(min=1.0).unsqueeze(-1)
    return F.cosine_similarity(weights, mean, dim=-1, eps=1e-8)


def gate_features(weights: Tensor, edge_index: Tensor) -> Tensor:
    """The gate's input [N, 3]: log degree, neighbour agreement, retrieval confidence."""
    deg = torch.zeros(weights.size(0), dtype=weights.dtype, device=weights.device)
    deg = deg.index_add(0, edge_index[1], torch.ones_like(edge_index[1], dtype=weights.dtype))
    conf = weights.max(dim=-1).values
    return torch.stack([torch.log1p(deg), neighbour_agreement(weights, edge_index), conf], dim=-1)


def gated_fusion(h: list[Tensor], imputed: list[Tensor], mask: Tensor, gate: Tensor) -> Tensor:
    """Masked fusion [N, d] in which an imputed modality counts with the node's ``gate``."""
    a = mask.to(h[0].dtype)  # [N, M]
    soft = a + (1.0 - a) * gate.unsqueeze(-1)
    stacked = torch.stack(
        [a[:, j : j + 1] * x + (1.0 - a[:, j : j + 1]) * gate.unsqueeze(-1) * xh
         for j, (x, xh) in enumerate(zip(h, imputed, strict=True))],
        dim=1,
    )  # fmt: skip
    return stacked.sum(1) / soft.sum(1, keepdim=True).clamp(min=1.0)


class PrismNet(MultimodalGNN):
    """Eq. (10)'s backbone with PRISM's gated imputation and the structural prompt (times the
    missing fraction) before the GNN; ``top_k``, ``tau``: :func:`retrieval_weights`'."""

    def __init__(
        self,
        in_dims: dict[str, int],
        num_classes: int,
        hidden: int = 64,
        gnn_layers: int = 2,
        conv: str = "gcn",
        dropout: float = 0.5,
        top_k: int = 3,
        tau: float = 0.1,
    ) -> None:
        super().__init__(in_dims, num_classes, hidden, gnn_layers, conv, dropout)
        if top_k < 1 or tau <= 0:
            raise ValueError(f"model.net.top_k must be >= 1 and tau > 0, got {top_k}, {tau}")
        self.top_k, self.tau = int(top_k), float(tau)
        self.gate = nn.Linear(3, 1)
        self.structural_prompt = nn.Parameter(torch.zeros(hidden))
        self.register_buffer(PAIRED_BUFFER, torch.zeros(num_classes, len(in_dims), hidden))
        self.register_buffer(PAIRED_SEEN_BUFFER, torch.zeros(num_classes))

    def modality_embeddings(self, data: Data) -> list[Tensor]:
        return self.encoders({m: data[f"x_{m}"] for m in self.modalities})

    def imputation(self, data: Data, h: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        mask = data.modality_mask
        w = retrieval_weights(
            retrieval_similarity(h, mask, self.paired), self.paired_seen > 0, self.top_k, self.tau
        )
        gate = torch.sigmoid(self.gate(gate_features(w, data.edge_index))).squeeze(-1)
        return [impute(w, self.paired, j) for j in range(len(h))], gate * (w.sum(-1) > 0)

    def gnn_inputs(self, data: Data) -> dict[str, Tensor]:
        h = self.modality_embeddings(data)
        imputed, gate = self.imputation(data, h)
        mask = data.modality_mask
        s = gated_fusion(h, imputed, mask, gate)
        missing = (1.0 - mask.to(s.dtype)).mean(-1, keepdim=True)
        return {"gnn": s + missing * self.structural_prompt}
