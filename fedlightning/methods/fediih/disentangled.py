"""FedIIH's disentangled GNN at node level (Yu et al., AAAI 2025; docs/fedogl.md, "FedIIH"):
an input layer into ``K`` factor channels and parameter-free neighbourhood-routing layers
(DisenGCN's DisenConv, Ma et al., ICML 2019), then a linear classifier."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.models.dropout import Dropout, InputDropout
from fedlightning.models.sparse import SparseLinear


def unit_channels(x: Tensor) -> Tensor:
    r""":math:`x_{u,k}/\lVert x_{u,k}\rVert` along the last axis; a zero channel stays zero
    and takes no gradient, as the norm's own gradient at zero (its direction is undefined).

    ``F.normalize``'s ``x / max(||x||, eps)`` has gradient ``1 / eps = 1e12`` there: a
    factor channel that ReLU and dropout leave all zero multiplied its gradient by 1e12 in
    every routing layer, and two such layers overflowed it to ``inf`` (``NaN`` after the
    dropout mask's zeros) in the input layer's weights."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    nonzero = norm > 0
    return torch.where(nonzero, x / torch.where(nonzero, norm, torch.ones_like(norm)), 0.0)


def neighbourhood_routing(
    x: Tensor, edge_index: Tensor, iterations: int = 6, tau: float = 1.0
) -> Tensor:
    r"""One DisenConv layer (DisenGCN, Alg. 1) on factor channels ``x`` ``[N, K, d]``:
    :math:`z_{u,k} = x_{u,k}/\lVert x_{u,k}\rVert`, :math:`c_{u,k} = z_{u,k}`; then
    ``iterations`` times, for every edge ``v -> u``,
    :math:`p_{v,k} = \mathrm{softmax}_k(z_{v,k}^\top c_{u,k} / \tau)` and
    :math:`c_{u,k} = \mathrm{normalize}(z_{u,k} + \sum_{v} p_{v,k} z_{v,k})`
    (:func:`unit_channels`: a zero channel stays zero). Self loops are ignored (a node's own
    ``z`` is always in its sum). Returns ``c`` ``[N, K, d]``."""
    z = unit_channels(x)
    src, dst = edge_index
    keep = src != dst
    src, dst = src[keep], dst[keep]
    c = z  # rows by index_select: z[src]'s backward adds in no fixed order on threads
    for _ in range(iterations):
        p = torch.softmax((z.index_select(0, src) * c.index_select(0, dst)).sum(-1) / tau, dim=1)
        c = unit_channels(z.index_add(0, dst, p.unsqueeze(-1) * z.index_select(0, src)))
    return c


def factor_moments(h: Tensor, mask: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    r"""A client's per-factor Gaussian :math:`\mathcal{N}(\mu_k, \mathrm{diag}\,\sigma_k^2)`
    from its factor representations ``h`` ``[N, K, d]`` on the nodes of ``mask``: the mean
    and :math:`\log(\sigma^2 + \epsilon)` (population variance) over those nodes, each
    ``[K, d]`` (zeros and ``log 1 = 0`` without nodes)."""
    if not bool(mask.any()):
        zeros = h.new_zeros(h.shape[1:])
        return zeros, zeros.clone()
    sel = h[mask]
    return sel.mean(0), torch.log(sel.var(0, unbiased=False) + eps)


class DisentangledGNN(nn.Module):
    r"""FedIIH's net: an input layer over the concatenated modalities and their availability
    bits, :math:`s = \mathrm{ReLU}(\sum_m a_m W_m x_m + W_a a + b)` ``[N, hidden]``, read as
    ``factors`` channels of ``hidden / factors``; ``routing_layers`` parameter-free
    :func:`neighbourhood_routing` layers (``g``); a linear classifier on ``g`` (``z = g``).

    Factor ``k`` owns rows ``k`` of the input layer's weights and bias and columns ``k`` of
    the classifier's weight (:meth:`factor_axes`); FedIIH mixes those blocks per factor.
    """

    def __init__(
        self,
        in_dims: dict[str, int],
        num_classes: int,
        factors: int = 2,
        hidden: int = 64,
        routing_layers: int = 3,
        iterations: int = 6,
        tau: float = 1.0,
        dropout: float = 0.35,
    ) -> None:
        super().__init__()
        if hidden % factors:
            raise ValueError(f"model.net.hidden={hidden} must be a multiple of factors={factors}")
        self.modalities, self.factors, self.hidden = list(in_dims), factors, hidden
        self.routing_layers, self.iterations, self.tau = routing_layers, iterations, tau
        self.inputs = nn.ModuleDict({m: SparseLinear(d, hidden) for m, d in in_dims.items()})
        self.availability = nn.Linear(len(in_dims), hidden)
        self.input_dropout = InputDropout(dropout)
        self.dropout = Dropout(dropout)
        self.head = nn.Linear(hidden, num_classes)

    def factor_axes(self) -> dict[str, int]:
        """State keys split into factor blocks, with the axis they split along."""
        axes = {f"inputs.{m}.{p}": 0 for m in self.modalities for p in ("weight", "bias")}
        return {**axes, "availability.weight": 0, "availability.bias": 0, "head.weight": 1}

    def factor_channels(self, data: Data) -> tuple[Tensor, Tensor]:
        """``(s [N, hidden], routed factors [N, K, hidden / K])``."""
        a = data.modality_mask.to(self.availability.weight.dtype)
        s = self.availability(a)
        for i, m in enumerate(self.modalities):
            s = s + a[:, i : i + 1] * self.inputs[m](self.input_dropout(data[f"x_{m}"]))
        s = torch.relu(s)
        x = s.view(s.size(0), self.factors, -1)
        for layer in range(self.routing_layers):
            x = self.dropout(x) if layer else x
            x = neighbourhood_routing(x, data.edge_index, self.iterations, self.tau)
        return s, x

    def representations(self, data: Data) -> dict[str, Tensor]:
        s, x = self.factor_channels(data)
        g = x.flatten(1)
        return {"s": s, "g": g, "z": g}

    def posterior(self, data: Data, mask: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`factor_moments` of the routed factors on ``mask``: ``(mu, logvar)``, ``[K, d]``."""
        return factor_moments(self.factor_channels(data)[1], mask)

    def forward(self, data: Data) -> Tensor:
        return self.head(self.dropout(self.representations(data)["z"]))
