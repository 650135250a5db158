"""FedIIH's disentangled GNN at node level (Yu et al., AAAI 2025; docs/fedogl.md, "FedIIH"):
an input layer into ``K`` factor channels and parameter-free neighbourhood-routing layers
(DisenGCN's DisenConv, Ma et al., ICML 2019), then a linear classifier."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch_geometric.data import Data

from fedlightning.models.dropout import Dropout, InputDropout, coalesced
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
    return torch.where(nonzero, x / torch.where(nonzero, norm, 1.0), 0.0)


class _Gathered(torch.autograd.Function):
    """``z.index_select(0, index)`` whose value ``rows`` was gathered once, with
    ``index_select``'s own backward (``zeros.index_add_(0, index, grad)``): each use is its
    own node of the graph, as a separate gather was, so the gradient of ``z`` is summed in
    the same order and bitwise the same, for one gather per routing layer instead of two per
    iteration."""

    @staticmethod
    def forward(ctx: FunctionCtx, z: Tensor, index: Tensor, rows: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.shape = z.shape
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).index_add_(0, index, grad), None, None


def neighbourhood_routing(
    x: Tensor, edge_index: Tensor, iterations: int = 6, tau: float = 1.0
) -> Tensor:
    r"""One DisenConv layer (DisenGCN, Alg. 1) on factor channels ``x`` ``[N, K, d]``:
    :math:`z_{u,k} = x_{u,k}/\lVert x_{u,k}\rVert`, :math:`c_{u,k} = z_{u,k}`; then
    ``iterations`` times, for every edge ``v -> u``,
    :math:`p_{v,k} = \mathrm{softmax}_k(z_{v,k}^\top c_{u,k} / \tau)` and
    :math:`c_{u,k} = \mathrm{normalize}(z_{u,k} + \sum_{v} p_{v,k} z_{v,k})`
    (:func:`unit_channels`: a zero channel stays zero). Self loops are ignored (a node's own
    ``z`` is always in its sum). Returns ``c`` ``[N, K, d]``.

    ``z_v`` on the edges is gathered once per layer (:class:`_Gathered`), not twice per
    iteration: the same values and gradient, bit for bit."""
    z = unit_channels(x)
    src, dst = edge_index
    keep = src != dst
    src, dst = src[keep], dst[keep]
    with torch.no_grad():
        z_src = z.index_select(0, src)
    c = z  # rows by index_select: z[src]'s backward adds in no fixed order on threads
    for _ in range(iterations):
        logits = (gathered(z, src, z_src) * c.index_select(0, dst)).sum(-1)
        p = torch.softmax(logits if tau == 1.0 else logits / tau, dim=1)  # x / 1 is x
        c = unit_channels(z.index_add(0, dst, p.unsqueeze(-1) * gathered(z, src, z_src)))
    return c


def gathered(z: Tensor, index: Tensor, rows: Tensor) -> Tensor:
    """``rows`` (``z.index_select(0, index)``, gathered once) as a gather of ``z``: with
    :class:`_Gathered`'s backward when ``z`` takes a gradient."""
    if torch.is_grad_enabled() and z.requires_grad:
        return _Gathered.apply(z, index, rows)
    return rows


def sparse_coalesced(x: Tensor) -> Tensor:
    """A sparse COO input coalesced once per tensor (:func:`~fedlightning.models.dropout.coalesced`,
    kept while it lives): an evaluation's input, not coalesced by a dropout, was coalesced
    again, and its CSR structure found again, at every forward. Other inputs as they are."""
    return coalesced(x) if x.layout == torch.sparse_coo else x


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
            x_m = sparse_coalesced(data[f"x_{m}"])
            s = s + a[:, i : i + 1] * self.inputs[m](self.input_dropout(x_m))
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
