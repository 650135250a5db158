"""A linear layer whose input may be a sparse matrix (a bag-of-words or multi-hot modality)."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx

# CSR products are what this layer is for; torch calls their support "beta" on every first use.
warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)


class _SparseAffine(torch.autograd.Function):
    """``x W^T + b`` for a sparse COO ``x`` ``[N, d]``: CSR products in both passes.

    The forward pass multiplies the CSR form of ``x``; the weight's gradient ``g^T x`` is
    computed as ``(x^T g)^T`` with ``x^T`` a COO view of the same indices, never a dense
    ``[N, d]`` matrix. ``x`` takes no gradient (it is data)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        x = x.coalesce()
        ctx.save_for_backward(x)
        return torch.addmm(bias, x.to_sparse_csr(), weight.t())

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[None, Tensor, Tensor]:
        (x,) = ctx.saved_tensors
        x_t = torch.sparse_coo_tensor(x.indices().flip(0), x.values(), (x.size(1), x.size(0)))
        return None, torch.sparse.mm(x_t, grad).t(), grad.sum(0)


class SparseLinear(nn.Linear):
    """:class:`torch.nn.Linear` that also takes a torch sparse COO input ``[N, in_features]``.

    A dense input takes ``nn.Linear``'s own path (the same bits); a sparse one costs its
    non-zero entries, not ``N * in_features`` (``benchmarks/graph_20k.py``). The parameters
    and their names are ``nn.Linear``'s, so checkpoints do not tell the two apart."""

    def forward(self, x: Tensor) -> Tensor:
        if x.layout != torch.sparse_coo:
            return super().forward(x)
        if x.requires_grad:
            raise ValueError("SparseLinear: a sparse input takes no gradient (it is data)")
        return _SparseAffine.apply(x, self.weight, self.bias)
