"""The multimodal graph backbone shared by every node-level method of the FedOGL setting."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.nn import SAGEConv

from fedlightning.models.constant import KeptNormGCNConv
from fedlightning.models.dropout import Dropout, InputDropout
from fedlightning.models.sparse import SparseLinear


def masked_fusion(embeddings: list[Tensor], mask: Tensor) -> Tensor:
    r""":math:`s_i = \sum_m a_{i,m} h_{i,m} / \max(1, \sum_m a_{i,m})` of ``M`` embeddings
    ``[N, d]`` and the availability ``mask`` ``a`` ``[N, M]``; ``[N, d]`` (zeros for a node
    with no modality)."""
    stacked = torch.stack(embeddings, dim=1)  # [N, M, d], a new tensor
    a = mask.to(stacked.dtype).unsqueeze(-1)
    # in place: the product's values without a second [N, M, d] (stack's backward keeps no
    # output, mul's keeps only ``a`` while ``a`` takes no gradient)
    weighted = stacked * a if a.requires_grad else stacked.mul_(a)
    return weighted.sum(1) / a.sum(1).clamp(min=1.0)


class ModalityEncoders(nn.Module):
    """One linear+ReLU encoder per modality (``in_dims``: name -> width) to ``hidden``, after
    an :class:`InputDropout` of the features; a modality may be dense or sparse COO."""

    def __init__(self, in_dims: dict[str, int], hidden: int = 64, dropout: float = 0.5) -> None:
        super().__init__()
        self.modalities = list(in_dims)
        self.encoders = nn.ModuleDict({m: SparseLinear(d, hidden) for m, d in in_dims.items()})
        self.dropout = InputDropout(dropout)

    def forward(self, features: dict[str, Tensor]) -> list[Tensor]:
        return [torch.relu(self.encoders[m](self.dropout(features[m]))) for m in self.modalities]


class GNNEncoder(nn.Module):
    """``layers`` PyG convolutions (``gcn`` or ``sage``) of width ``hidden``, with ReLU and
    dropout between layers; a GCN layer normalises each graph once
    (:class:`~fedlightning.models.constant.KeptNormGCNConv`)."""

    CONVS = {"gcn": KeptNormGCNConv, "sage": SAGEConv}

    def __init__(
        self,
        in_dim: int,
        hidden: int = 64,
        layers: int = 2,
        conv: str = "gcn",
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        if conv not in self.CONVS:
            raise ValueError(f"model.net.conv must be one of {sorted(self.CONVS)}, got {conv!r}")
        dims = [in_dim] + [hidden] * layers
        self.convs = nn.ModuleList(
            self.CONVS[conv](a, b) for a, b in zip(dims[:-1], dims[1:], strict=False)
        )
        self.dropout = Dropout(dropout)

    def forward_until(self, x: Tensor, edge_index: Tensor, layer: int) -> Tensor:
        """The input of ``convs[layer]`` (before its dropout): what its weight sees."""
        for conv in self.convs[:layer]:
            x = torch.relu(conv(x, edge_index))
        return x

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(self.dropout(x) if i else x, edge_index)
            if i < len(self.convs) - 1:
                x = torch.relu(x)
        return x


class MultimodalGNN(nn.Module):
    r"""Modality encoders, masked fusion, a GNN, and the fused representation of Eq. (10).

    .. math::
        s_i = \mathrm{fuse}(\{h_{i,m}\}),\quad g_i = \mathrm{GNN}(s)_i,\quad
        z_i = \Pi_\omega([s_i \,\|\, g_i \,\|\, a_i]),\quad \hat{y}_i = W z_i

    (FedOGL, Eq. (10)); ``a_i`` is the modality-availability indicator, ``hidden`` the width
    of encoders, GNN and ``z``. Input: a PyG ``Data`` with ``x_<modality>`` ``[N, d_m]``,
    ``modality_mask`` ``[N, M]``, ``edge_index``; output: logits ``[N, num_classes]``.
    """

    def __init__(
        self,
        in_dims: dict[str, int],
        num_classes: int,
        hidden: int = 64,
        gnn_layers: int = 2,
        conv: str = "gcn",
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        self.modalities = list(in_dims)
        self.encoders = ModalityEncoders(in_dims, hidden, dropout)
        self.gnn = GNNEncoder(hidden, hidden, gnn_layers, conv, dropout)
        self.project = nn.Linear(2 * hidden + len(in_dims), hidden)
        self.dropout = Dropout(dropout)
        self.head = nn.Linear(hidden, num_classes)

    def representations(self, data: Data) -> dict[str, Tensor]:
        """The semantic ``s``, structural ``g`` and fused ``z`` (Eq. (10)) vectors, ``[N, hidden]``."""
        s = self.gnn_inputs(data)["gnn"]
        g = self.gnn(s, data.edge_index)
        z = torch.relu(self.project(torch.cat([s, g, data.modality_mask.to(s.dtype)], dim=-1)))
        return {"s": s, "g": g, "z": z}

    def gnn_inputs(self, data: Data) -> dict[str, Tensor]:
        """Each GNN's input on ``data``, by module name: ``{"gnn": s}``."""
        feats = {m: data[f"x_{m}"] for m in self.modalities}
        return {"gnn": masked_fusion(self.encoders(feats), data.modality_mask)}

    def embed(self, data: Data) -> Tensor:
        """The fused representation ``z`` of Eq. (10), ``[N, hidden]``."""
        return self.representations(data)["z"]

    def forward(self, data: Data) -> Tensor:
        return self.head(self.dropout(self.embed(data)))
