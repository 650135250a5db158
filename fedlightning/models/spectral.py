"""FedSSP's spectral GNN at node level (Tan et al., NeurIPS 2024; docs/fedogl.md, "FedSSP").

A client's subgraph gives its Laplacian eigenpairs (the top ``k`` of the normalized
adjacency, i.e. the ``k`` smallest Laplacian eigenvalues, by ``scipy.sparse.linalg.eigsh``);
a *spectral encoder* (sine encoding of the eigenvalues, self-attention over them, a decoder)
turns them into ``H`` filters; each filter gives edge bases ``U diag(lambda_h) U^T`` on the
graph's edges, softmax-normalized per target node, which weight the message passing. The
encoder is what the federation shares (GSKS); the rest, with the preference vector ``b_k``
of PGPA, stays on the client.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from scipy.sparse import coo_matrix
from scipy.sparse.linalg import ArpackNoConvergence, eigsh
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.utils import softmax as edge_softmax

from fedlightning.models.multimodal import ModalityEncoders, masked_fusion

SPECTRAL_PREFIX = "spectral."  # the state keys of the shared spectral encoder


def laplacian_eigenpairs(edge_index: Tensor, num_nodes: int, k: int) -> tuple[Tensor, Tensor]:
    r"""The ``k`` smallest eigenvalues ``e`` ``[k]`` (ascending) of the normalized Laplacian
    :math:`L = I - D^{-1/2} A D^{-1/2}` of the undirected graph ``edge_index`` and their
    eigenvectors ``U`` ``[num_nodes, k]`` (each signed so that its inner product with
    ``(1, 2, ..., n)`` is >= 0). ``eigsh`` on the normalized adjacency (its largest ``k``) with a fixed start
    vector, so the result is deterministic; a dense ``eigh`` when ``k`` is close to
    ``num_nodes`` or ARPACK does not converge. ``k`` is capped at ``num_nodes``."""
    n = int(num_nodes)
    k = max(1, min(int(k), n))
    src, dst = edge_index.cpu().numpy()
    keep = src != dst
    rows, cols = np.concatenate([src[keep], dst[keep]]), np.concatenate([dst[keep], src[keep]])
    adj = coo_matrix((np.ones(rows.size), (rows, cols)), shape=(n, n)).tocsr()
    adj.data[:] = 1.0  # duplicates summed above: back to a 0/1 matrix
    deg = np.asarray(adj.sum(1)).ravel()
    inv = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1e-12)), 0.0)
    norm = adj.multiply(inv[:, None]).multiply(inv[None, :]).tocsr()
    vals = vecs = None
    if k < n - 1:
        try:
            vals, vecs = eigsh(norm, k=k, which="LA", v0=np.ones(n) / math.sqrt(n), tol=1e-8)
        except ArpackNoConvergence:
            vals = None
    if vals is None:
        vals, vecs = np.linalg.eigh(norm.toarray())
        vals, vecs = vals[-k:], vecs[:, -k:]
    order = np.argsort(-vals, kind="stable")  # adjacency descending = Laplacian ascending
    vals, vecs = 1.0 - vals[order], vecs[:, order]
    sign = np.sign(np.arange(1, n + 1) @ vecs)  # a fixed ramp: no ties between +/- u
    vecs = vecs * np.where(sign == 0, 1.0, sign)[None, :]
    return torch.tensor(vals, dtype=torch.float32), torch.tensor(vecs, dtype=torch.float32)


def sine_encoding(e: Tensor, dim: int, scale: float = 100.0) -> Tensor:
    r"""Specformer's eigenvalue encoding, as FedSSP uses it: for ``e`` ``[k]``,
    :math:`[e,\ \sin(s e \omega_j),\ \cos(s e \omega_j)]_{j<dim/2}` with
    :math:`\omega_j = 10000^{-2j/dim}` and ``s = scale``; ``[k, dim + 1]``."""
    j = torch.arange(dim // 2, dtype=e.dtype, device=e.device)
    omega = torch.exp(-2.0 * j / dim * math.log(10000.0))
    pe = scale * e.unsqueeze(1) * omega
    return torch.cat([e.unsqueeze(1), torch.sin(pe), torch.cos(pe)], dim=1)


def edge_bases(
    e_filters: Tensor, U: Tensor, edge_index: Tensor, num_nodes: int
) -> tuple[Tensor, Tensor]:
    r"""The filters' values on the graph's edges and self loops: for filter ``h`` (a column of
    ``e_filters`` ``[k, H]``) and edge ``j -> i``, :math:`(U \mathrm{diag}(\lambda_h)
    U^\top)_{ij}`, then a softmax over the edges into each node ``i`` (per filter). Returns
    ``(edges [2, E'], weights [E', H])``, the self loops appended to ``edge_index``."""
    loops = torch.arange(num_nodes, device=edge_index.device)
    edges = torch.cat([edge_index, torch.stack([loops, loops])], dim=1)
    src, dst = edges
    raw = torch.einsum("eq,qh,eq->eh", U[dst], e_filters, U[src])
    return edges, edge_softmax(raw, dst, num_nodes=num_nodes)


class SpectralEncoder(nn.Module):
    """Eigenvalues -> ``filters`` new eigenvalue sets: sine encoding, a linear lift to
    ``width``, one pre-norm self-attention block over the ``k`` eigenvalues (``heads``
    heads) with a feed-forward, and a linear decoder to ``filters`` values per eigenvalue
    (Specformer's encoder, FedSSP's shared part)."""

    def __init__(self, width: int = 32, heads: int = 4, filters: int = 4) -> None:
        super().__init__()
        self.width = width
        self.lift = nn.Linear(width + 1, width)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.decoder = nn.Linear(width, filters)

    def forward(self, e: Tensor) -> Tensor:
        x = self.lift(sine_encoding(e, self.width)).unsqueeze(0)  # [1, k, width]
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        x = x + self.ffn(self.norm2(x))
        return self.decoder(x.squeeze(0))  # [k, filters]


class SpectralGNN(nn.Module):
    r"""Modality encoders and masked fusion (``s``), ``layers`` message-passing layers over
    the spectral encoder's edge bases (``g``), FedSSP's preference vector (``z = g +
    b_k``), a linear head: :math:`\hat{y} = W(g + b_k)` (PGPA).

    Args:
        in_dims, num_classes, hidden, dropout: as
            :class:`~fedlightning.models.multimodal.MultimodalGNN`.
        layers: message-passing layers (each: the ``filters`` bases' aggregations of its
            input, concatenated, a linear map, ReLU).
        eigs: eigenpairs per graph (``k``).
        filters, width, heads: the spectral encoder's output filters, width and heads.
    """

    def __init__(
        self,
        in_dims: dict[str, int],
        num_classes: int,
        hidden: int = 64,
        layers: int = 2,
        eigs: int = 64,
        filters: int = 4,
        width: int = 32,
        heads: int = 4,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        self.modalities, self.hidden, self.eigs = list(in_dims), hidden, eigs
        self.encoders = ModalityEncoders(in_dims, hidden, dropout)
        self.spectral = SpectralEncoder(width, heads, filters)
        self.convs = nn.ModuleList(nn.Linear(filters * hidden, hidden) for _ in range(layers))
        self.preference = nn.Parameter(torch.zeros(hidden))
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, num_classes)
        self._eig_cache: dict[str, tuple[Tensor, Tensor]] = {}

    def eigenpairs(self, data: Data) -> tuple[Tensor, Tensor]:
        """:func:`laplacian_eigenpairs` of ``data``'s graph, cached by its content."""
        key = hashlib.sha1(data.edge_index.cpu().numpy().tobytes()).hexdigest()
        key += f":{data.num_nodes}"
        if key not in self._eig_cache:
            if len(self._eig_cache) > 64:
                self._eig_cache.clear()
            self._eig_cache[key] = laplacian_eigenpairs(data.edge_index, data.num_nodes, self.eigs)
        e, U = self._eig_cache[key]
        return e.to(data.edge_index.device), U.to(data.edge_index.device)

    def representations(self, data: Data) -> dict[str, Tensor]:
        """``s`` (fused input), ``g`` (after message passing), ``z = g + b_k``; ``[N, hidden]``."""
        feats = {m: data[f"x_{m}"] for m in self.modalities}
        s = masked_fusion(self.encoders(feats), data.modality_mask)
        e, U = self.eigenpairs(data)
        edges, w = edge_bases(self.spectral(e), U, data.edge_index, s.size(0))
        src, dst = edges
        x = s
        for i, conv in enumerate(self.convs):
            x = self.dropout(x) if i else x
            msg = (w.unsqueeze(2) * x[src].unsqueeze(1)).flatten(1)  # [E', filters * d]
            agg = x.new_zeros(x.size(0), msg.size(1)).index_add_(0, dst, msg)
            x = torch.relu(conv(agg))
        return {"s": s, "g": x, "z": x + self.preference}

    def forward(self, data: Data) -> Tensor:
        return self.head(self.dropout(self.representations(data)["z"]))
