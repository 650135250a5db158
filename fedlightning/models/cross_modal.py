"""The cross-modal retrieval backbone of the FedOGL setting: one tower per modality."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.errors import ConfigError
from fedlightning.models.dropout import InputDropout
from fedlightning.models.multimodal import GNNEncoder
from fedlightning.models.sparse import SparseLinear


class CrossModalGNN(nn.Module):
    r"""Two modality towers (query :math:`q`, item :math:`v`), each with its own encoder, GNN
    and projection head, that embed queries and items in one space:

    .. math::
        h_{i,m} = a_{i,m}\, \mathrm{ReLU}(W_m x_{i,m} + b_m), \qquad
        g_m = \mathrm{GNN}_m(h_m, A), \qquad
        e_{i,m} = \frac{P_m g_{i,m}}{\lVert P_m g_{i,m} \rVert_2}

    where :math:`a_{i,m} \in \{0, 1\}` is the availability of modality :math:`m` at node
    :math:`i` (a missing modality propagates zeros). :math:`S_{i,l} = e_{i,q}^\top e_{l,v}`
    is the cosine similarity of the symmetric InfoNCE (the retrieval reading of FedOGL
    Eq. (5)), of Recall@1 and of the rejection score :math:`\max_l S_{i,l}` (Eq. (6)). The
    last GNN layer of each tower is the structural layer (:math:`\Omega_{\mathrm{str}}` of
    Eq. (9)).

    Built like :class:`~fedlightning.models.MultimodalGNN` (``num_classes`` is unused), with
    the same input; the output is ``(q, k)``, each ``[N, hidden]`` with rows of unit norm.
    """

    def __init__(
        self,
        in_dims: dict[str, int],
        num_classes: int | None = None,
        query: str = "text",
        item: str = "bow",
        hidden: int = 64,
        gnn_layers: int = 2,
        conv: str = "gcn",
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        for key, m in (("query", query), ("item", item)):
            if m not in in_dims:
                raise ConfigError(
                    f"model.net.{key}",
                    f"modality {m!r} is not in the dataset; it has {sorted(in_dims)}",
                )
        if query == item:
            raise ConfigError("model.net.item", f"must differ from model.net.query ({query!r})")
        self.modalities = list(in_dims)
        self.query, self.item, self.conv = query, item, conv
        self.sides = (query, item)
        self.encoders = nn.ModuleDict({m: SparseLinear(in_dims[m], hidden) for m in self.sides})
        self.gnns = nn.ModuleDict(
            {m: GNNEncoder(hidden, hidden, gnn_layers, conv, dropout) for m in self.sides}
        )
        self.heads = nn.ModuleDict({m: nn.Linear(hidden, hidden) for m in self.sides})
        self.dropout = InputDropout(dropout)

    def availability(self, data: Data, modality: str) -> Tensor:
        """Bool ``[N]``: nodes that have ``modality``."""
        return data.modality_mask[:, self.modalities.index(modality)]

    def pair_mask(self, data: Data) -> Tensor:
        """Bool ``[N]``: nodes with both the query and the item modality (usable pairs)."""
        return self.availability(data, self.query) & self.availability(data, self.item)

    def tower_input(self, data: Data, modality: str) -> Tensor:
        """``h_m``: the encoded modality, zero where it is missing ``[N, hidden]``."""
        a = self.availability(data, modality).to(data[f"x_{modality}"].dtype).unsqueeze(-1)
        return torch.relu(self.encoders[modality](self.dropout(data[f"x_{modality}"]))) * a

    def tower(self, data: Data, modality: str) -> Tensor:
        """``g_m``: the tower's propagated representation before its head ``[N, hidden]``."""
        return self.gnns[modality](self.tower_input(data, modality), data.edge_index)

    def gnn_inputs(self, data: Data) -> dict[str, Tensor]:
        """Each GNN's input on ``data``, by module name: ``{"gnns.<m>": h_m}``."""
        return {f"gnns.{m}": self.tower_input(data, m) for m in self.sides}

    def embed(self, data: Data, modality: str) -> Tensor:
        """``e_m``: one tower, its projection head and L2 normalisation ``[N, hidden]``."""
        return F.normalize(self.heads[modality](self.tower(data, modality)), dim=-1)

    def forward(self, data: Data) -> tuple[Tensor, Tensor]:
        return self.embed(data, self.query), self.embed(data, self.item)
