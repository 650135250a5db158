"""A linear layer whose input may be a sparse matrix (a bag-of-words or multi-hot modality)."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx

# CSR products are what this layer is for; torch calls their support "beta" on every first use.
warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)


#: CSR structures of the last few sparse inputs' index tensors (:func:`csr_structure`).
_STRUCTURES: OrderedDict[tuple, tuple[Tensor, ...]] = OrderedDict()
_MAX_STRUCTURES = 64


def csr_structure(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """For a coalesced sparse COO ``x`` ``[N, d]``: ``(crow, col)``, the index arrays of its
    CSR form, and ``(crow_t, row_t, perm)``, those of the CSR form of ``x^T`` whose values
    are ``x.values()[perm]``. Kept per index tensor (by its storage, offset, shape and
    version; the entry holds the tensor, so its storage stays this one's while kept): a
    dropout of a sparse input keeps its indices, so every step of a fit reuses them."""
    idx = x.indices()
    key = (
        idx.untyped_storage().data_ptr(),
        idx.storage_offset(),
        tuple(idx.shape),
        tuple(idx.stride()),
        idx._version,
        tuple(x.shape),
        idx.device,
    )
    hit = _STRUCTURES.get(key)
    if hit is not None:
        _STRUCTURES.move_to_end(key)
        return hit[1:]
    n, d = x.shape
    row, col = idx
    perm = torch.argsort(col * n + row)
    crow = torch._convert_indices_from_coo_to_csr(row, n)
    crow_t = torch._convert_indices_from_coo_to_csr(col[perm], d)
    _STRUCTURES[key] = (idx, crow, col, crow_t, row[perm], perm)
    while len(_STRUCTURES) > _MAX_STRUCTURES:
        _STRUCTURES.popitem(last=False)
    return _STRUCTURES[key][1:]


class _SparseAffine(torch.autograd.Function):
    """``x W^T + b`` for a sparse COO ``x`` ``[N, d]``: CSR products in both passes.

    The forward pass multiplies the CSR form of ``x``; the weight's gradient ``g^T x`` is
    computed as ``(x^T g)^T`` with ``x^T`` in CSR form, never a dense ``[N, d]`` matrix.
    Both index structures are found once per sparsity pattern (:func:`csr_structure`).
    ``x`` takes no gradient (it is data)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        x = x.coalesce()
        crow, col, crow_t, row_t, perm = csr_structure(x)
        values = x.values()
        ctx.save_for_backward(crow_t, row_t, perm, values)
        ctx.shape = tuple(x.shape)
        csr = torch.sparse_csr_tensor(crow, col, values, x.shape, check_invariants=False)
        return torch.addmm(bias, csr, weight.t())

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[None, Tensor, Tensor]:
        crow_t, row_t, perm, values = ctx.saved_tensors
        n, d = ctx.shape
        x_t = torch.sparse_csr_tensor(crow_t, row_t, values[perm], (d, n), check_invariants=False)
        return None, torch.mm(x_t, grad).t(), grad.sum(0)


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
