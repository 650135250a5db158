"""FedSSP's spectral GNN at node level (Tan et al., NeurIPS 2024; docs/fedogl.md, "FedSSP").

A client's subgraph gives its Laplacian eigenpairs (the top ``k`` of the normalized
adjacency, i.e. the ``k`` smallest Laplacian eigenvalues; :func:`laplacian_eigenpairs`);
the eigenvalues' sine encoding, self-attention over them and a decoder give ``H`` filters;
each filter gives a basis ``U diag(lambda_h) U^T`` on the graph's edges, which a filter
encoder turns into per-channel edge weights for the message passing. The two spectral
encoders (the eigenvalue encoder and the filter encoder, as FedSSP's code names them) are
what the federation shares (GSKS); the rest, with the preference vector ``b_k`` of PGPA,
stays on the client.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
import torch.nn.functional as F
from scipy.sparse import coo_matrix
from scipy.sparse.linalg import lobpcg
from torch import Tensor, nn
from torch_geometric.data import Data
from torch_geometric.utils import softmax as edge_softmax

from fedlightning.models.dropout import Dropout, coalesced
from fedlightning.models.multimodal import ModalityEncoders, masked_fusion

SHARED_PREFIXES = ("eig_encoder.", "filter_encoder.")  # GSKS: the spectral encoders


DENSE_UP_TO = 2000  # nodes: a dense symmetric eigensolver below, LOBPCG above


def laplacian_eigenpairs(edge_index: Tensor, num_nodes: int, k: int) -> tuple[Tensor, Tensor]:
    r"""The ``k`` smallest eigenvalues ``e`` ``[k]`` (ascending) of the normalized Laplacian
    :math:`L = I - D^{-1/2} A D^{-1/2}` of the undirected graph ``edge_index`` and their
    eigenvectors ``U`` ``[num_nodes, k]`` (each signed so that its inner product with
    ``(1, 2, ..., n)`` is >= 0), as the largest ``k`` of the normalized adjacency. Up to
    :data:`DENSE_UP_TO` nodes a dense ``eigh``; above, ``scipy.sparse.linalg.lobpcg`` from a
    seeded start. Not ``eigsh``: ARPACK restarts from a process-wide random state, so the
    same graph gives eigenvectors that differ in the last bits from one process to another
    (a resumed run would not be bitwise). ``k`` is capped at ``num_nodes``."""
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
    if n <= DENSE_UP_TO or 5 * k >= n:
        vals, vecs = np.linalg.eigh(norm.toarray())
        vals, vecs = vals[-k:], vecs[:, -k:]
    else:
        start = np.random.default_rng(0).standard_normal((n, k))
        vals, vecs = lobpcg(norm, start, largest=True, tol=1e-6, maxiter=200)
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
    r"""The bases' values on the graph's edges and self loops: the identity, then for each
    filter ``h`` (a column of ``e_filters`` ``[k, H]``) and edge ``j -> i``,
    :math:`(U \mathrm{diag}(\lambda_h) U^\top)_{ij}`. Returns ``(edges [2, E'], values [E',
    H + 1])``, the self loops appended to ``edge_index``."""
    loops = torch.arange(num_nodes, device=edge_index.device)
    edges = torch.cat([edge_index, torch.stack([loops, loops])], dim=1)
    src, dst = edges
    raw = torch.einsum("eq,qh,eq->eh", U[dst], e_filters, U[src])
    identity = (src == dst).to(raw.dtype).unsqueeze(1)
    return edges, torch.cat([identity, raw], dim=1)


class SpectralConv(nn.Module):
    """FedSSP's message passing: messages ``GELU(W x_j)`` scaled channel-wise by the edge's
    basis weights, summed into each node, a residual, then a residual feed-forward."""

    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.pre = nn.Linear(hidden, hidden)
        self.ffn = nn.Sequential(
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, edges: Tensor, weights: Tensor) -> Tensor:
        src, dst = edges
        # index_select, not [src]: the latter's backward accumulates in any order on threads
        msg = F.gelu(self.pre(x)).index_select(0, src) * weights
        x = x + self.dropout(x.new_zeros(x.shape).index_add_(0, dst, msg))
        return x + self.dropout(self.ffn(x))


class SpectralGNN(nn.Module):
    r"""FedSSP's network at node level: modality encoders and masked fusion (``s``); the
    eigenvalues' sine encoding and its linear map (``eig_encoder``), one pre-norm
    self-attention block over them and a decoder to ``filters`` new eigenvalue sets; the
    identity and the filters' bases on the edges, mapped by the ``filter_encoder`` to
    per-channel edge weights (softmax over each node's incoming edges); ``layers``
    :class:`SpectralConv` layers (``g``); the preference vector (``z = g + b_k``) and a
    linear head, :math:`\hat{y} = W(g + b_k)` (PGPA). The ``eig_encoder`` and
    ``filter_encoder`` are the spectral encoders GSKS shares (:data:`SHARED_PREFIXES`).

    Args:
        in_dims, num_classes, hidden, dropout: as
            :class:`~fedlightning.models.multimodal.MultimodalGNN`.
        layers: message-passing layers.
        eigs: eigenpairs per graph (``k``).
        filters, heads: the decoder's filters and the attention's heads.
    """

    def __init__(
        self,
        in_dims: dict[str, int],
        num_classes: int,
        hidden: int = 64,
        layers: int = 2,
        eigs: int = 64,
        filters: int = 4,
        heads: int = 4,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        self.modalities, self.hidden, self.eigs = list(in_dims), hidden, eigs
        self.encoders = ModalityEncoders(in_dims, hidden, dropout)
        self.eig_encoder = nn.Linear(hidden + 1, hidden)
        self.mha_norm, self.ffn_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.mha = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.eig_ffn = nn.Sequential(
            nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden)
        )
        self.decoder = nn.Linear(hidden, filters)
        self.filter_encoder = nn.Sequential(
            nn.Linear(filters + 1, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU()
        )
        self.convs = nn.ModuleList(SpectralConv(hidden, dropout) for _ in range(layers))
        self.preference = nn.Parameter(torch.zeros(hidden))
        self.dropout = Dropout(dropout)
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

    def filters(self, e: Tensor) -> Tensor:
        """The decoder's new eigenvalues ``[k, filters]`` from the eigenvalues ``e`` ``[k]``."""
        x = self.eig_encoder(sine_encoding(e, self.hidden)).unsqueeze(0)  # [1, k, hidden]
        h = self.mha_norm(x)
        x = x + self.mha(h, h, h, need_weights=False)[0]
        x = x + self.eig_ffn(self.ffn_norm(x))
        return self.decoder(x.squeeze(0))

    def representations(self, data: Data) -> dict[str, Tensor]:
        """``s`` (fused input), ``g`` (after message passing), ``z = g + b_k``; ``[N, hidden]``."""
        # a sparse input coalesced once per tensor: else every evaluation's forward coalesced
        # it and found its CSR structure again
        feats = {m: data[f"x_{m}"] for m in self.modalities}
        feats = {m: coalesced(x) if x.layout == torch.sparse_coo else x for m, x in feats.items()}
        s = masked_fusion(self.encoders(feats), data.modality_mask)
        e, U = self.eigenpairs(data)
        edges, bases = edge_bases(self.filters(e), U, data.edge_index, s.size(0))
        weights = edge_softmax(self.filter_encoder(bases), edges[1], num_nodes=s.size(0))
        x = s
        for conv in self.convs:
            x = conv(x, edges, weights)
        return {"s": s, "g": x, "z": x + self.preference}

    def forward(self, data: Data) -> Tensor:
        return self.head(self.dropout(self.representations(data)["z"]))
