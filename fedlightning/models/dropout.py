"""Input dropout that costs what the input's non-zero entries cost: a zero entry stays zero
whatever its mask (docs/fedogl.md, "Input dropout on sparse inputs")."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.models.constant import kept

#: Above this fraction of non-zero entries a dense CPU input takes standard dropout (measured
#: break-even about 0.5: ``benchmarks/input_dropout.py --sweep``).
MAX_DENSITY = 0.3
#: The density is that of an evenly spaced sample of about this many entries (cost only).
DENSITY_SAMPLE = 4096

_COMPRESSED = {  # layout -> its compressed and its plain index getters
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


def keep_scale(shape: torch.Size, p: float, like: Tensor) -> Tensor:
    """``m / (1-p)`` with ``m ~ Bernoulli(1-p)`` i.i.d., drawn from torch's global generator
    of ``like``'s device; ``1/(1-p)`` is rounded as standard dropout rounds it."""
    return scaled(nonzero_keep(shape, p, like), p, like.dtype)


def nonzero_keep(shape: torch.Size, p: float, like: Tensor) -> Tensor:
    """The mask ``m`` of :func:`keep_scale` (bool): ``u >= p`` for one uniform ``u`` of
    torch's default dtype per entry, from the global generator of ``like``'s device."""
    return torch.rand(shape, device=like.device) >= p  # P(u >= p) = 1 - p


def scaled(keep: Tensor, p: float, dtype: torch.dtype) -> Tensor:
    """The multiplier ``m / (1-p)`` of a bool mask ``m`` (a new tensor of ``dtype``)."""
    return keep.to(dtype).div_(1.0 - p)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """:func:`torch.nn.functional.dropout` of ``x``, bitwise: the same values, gradient and
    random draws, about twice as fast on a contiguous float32/float64 CPU ``x``. There torch
    draws the mask with ``bernoulli_(1-p)``, one float64 uniform ``u`` per entry (kept iff
    ``u < 1-p``); ``torch.rand(..., dtype=float64)`` draws the same uniforms from the same
    generator without bernoulli's per-entry overhead (docs/fedogl.md, "Input dropout on
    sparse inputs"). Anything else (other devices or dtypes, ``p`` of 0 or 1) takes
    :func:`torch.nn.functional.dropout` itself."""
    if not training or not drawn_as_torch(x, p):
        return F.dropout(x, p, training)
    return x * dropout_noise(x.shape, p, x.dtype)


def drawn_as_torch(x: Tensor, p: float) -> bool:
    """Whether :func:`dropout` draws ``x``'s mask itself (:func:`dropout_noise`): a
    contiguous float32/float64 CPU ``x`` and ``0 < p < 1``."""
    return (
        0.0 < p < 1.0
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and x.is_contiguous()
    )


def dropout_noise(
    shape: torch.Size, p: float, dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """The multiplier :func:`torch.nn.functional.dropout` draws on the CPU, ``m / (1-p)``
    with ``m = [u < 1-p]`` for one float64 uniform ``u`` per entry from torch's global
    generator (into ``out`` when given: a contiguous block of ``dtype``)."""
    keep = dropout_keep(shape, p)
    if out is None:
        return scaled(keep, p, dtype)
    return out.copy_(keep).div_(1.0 - p)


def dropout_keep(shape: torch.Size, p: float) -> Tensor:
    """The mask ``m`` of :func:`dropout_noise` (bool): ``u < 1-p`` for one float64 uniform
    ``u`` per entry from torch's global CPU generator."""
    return torch.rand(shape, dtype=torch.float64) < 1.0 - p


class PackedMask:
    """A CPU bool mask kept as bits (numpy's ``packbits``, little bit order): an eighth of
    its bytes. :meth:`unpack` gives the same mask back, a new bool tensor of its shape."""

    def __init__(self, keep: Tensor) -> None:
        if keep.dtype != torch.bool or keep.device.type != "cpu":
            raise ValueError(f"PackedMask takes a CPU bool mask, got {keep.dtype} on {keep.device}")
        self.shape = keep.shape
        self.bits = np.packbits(keep.reshape(-1).numpy(), bitorder="little")

    def unpack(self) -> Tensor:
        """The mask, bool, of its shape."""
        count = math.prod(self.shape)
        flat = np.unpackbits(self.bits, count=count, bitorder="little")  # 0/1 bytes
        return torch.from_numpy(flat).view(torch.bool).view(self.shape)


def _dropped(values: Tensor, p: float) -> Tensor:
    """A sparse tensor's stored ``values`` after dropout."""
    return values * 0.0 if p == 1.0 else values * keep_scale(values.shape, p, values)


def nonzero_dropout(
    x: Tensor,
    p: float = 0.5,
    training: bool = True,
    max_density: float = MAX_DENSITY,
    out: Tensor | None = None,
) -> Tensor:
    """Inverted dropout drawn for the non-zero (stored) entries of ``x`` only: the
    distribution of :func:`torch.nn.functional.dropout`, other random draws (torch's global
    generator). ``p`` lies in ``[0, 1]``; ``training=False`` returns ``x`` itself.

    - torch sparse input (COO, CSR, CSC, BSR, BSC): a mask per stored value; the result keeps
      the layout and sparsity pattern, a gradient reaches the kept stored values only.
    - dense CPU input not requiring grad, with at most ``max_density`` non-zero entries (in a
      sample of :data:`DENSITY_SAMPLE`): masks for the non-zeros, zeros returned untouched.
    - any other dense input (denser, on an accelerator, or requiring grad, whose gradient at
      a zero entry is its mask): :func:`torch.nn.functional.dropout`.

    Returns a tensor of ``x``'s shape, dtype, device and layout; with ``out`` (a dense
    contiguous tensor of ``x``'s shape, e.g. a row block of a larger one) a dense result is
    written there instead, the same values and random draws.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must lie in [0, 1], got {p}")
    if not training or p == 0.0:
        return x if out is None else out.copy_(x)
    if x.layout == torch.sparse_coo:
        xc = coalesced(x)
        return torch.sparse_coo_tensor(
            xc.indices(),
            _dropped(xc.values(), p),
            x.shape,
            dtype=x.dtype,
            device=x.device,
            check_invariants=False,  # the indices of a valid tensor
            is_coalesced=True,
        )
    if x.layout in _COMPRESSED:
        compressed, plain = _COMPRESSED[x.layout]
        return torch.sparse_compressed_tensor(
            getattr(x, compressed)(),
            getattr(x, plain)(),
            _dropped(x.values(), p),
            x.shape,
            dtype=x.dtype,
            device=x.device,
            layout=x.layout,
            check_invariants=False,
        )
    if (
        p == 1.0
        or x.device.type != "cpu"
        or (x.requires_grad and torch.is_grad_enabled())
        or x.numel() == 0
    ):
        return _into(dropout(x, p), out)
    flat = x.reshape(-1)
    idx, values = nonzeros(x, max_density)
    if idx is None:
        return _into(dropout(x, p), out)
    res = flat.clone() if out is None else out.view(-1).copy_(flat)
    res[idx] = values * keep_scale(idx.shape, p, flat)
    return res.view(x.shape)


def coalesced(x: Tensor) -> Tensor:
    """``x.coalesce()`` of a sparse COO ``x``, kept per input tensor (:func:`kept`) when it
    takes no gradient: a client's sparse features, built from sorted indices, are not
    flagged coalesced, and coalescing them again every step cost about 0.5 ms on Cora."""
    if x.is_coalesced() or x.requires_grad:
        return x.coalesce()
    return kept(x, "coalesced", x.coalesce)


def nonzeros(x: Tensor, max_density: float = MAX_DENSITY) -> tuple[Tensor | None, Tensor | None]:
    """The flat positions of a dense input's non-zero entries and their values
    (:func:`nonzero_positions`; ``(None, None)``: too dense), found once per input tensor
    and kept while it is unchanged (:func:`~fedlightning.models.constant.kept`): a client's
    features are the same tensor every step of its fit and every round."""

    def find() -> tuple[Tensor | None, Tensor | None]:
        flat = x.reshape(-1)
        pos = nonzero_positions(flat, max_density) if flat.numel() else None
        return (None, None) if pos is None else (pos, flat[pos])

    return kept(x, ("nonzeros", max_density), find)


def nonzero_positions(flat: Tensor, max_density: float = MAX_DENSITY) -> Tensor | None:
    """The positions of a flat dense input's non-zero entries (NaN included), the entries
    :func:`nonzero_dropout` draws masks for; ``None`` when the input is denser than
    ``max_density`` (in a sample of :data:`DENSITY_SAMPLE`) and takes standard dropout.
    They depend on the input alone, so a caller whose input is constant data may keep them
    (:class:`~fedlightning.models.stacked.SegmentDropout`)."""
    sample = flat[:: max(1, flat.numel() // DENSITY_SAMPLE)]
    if int(torch.count_nonzero(sample)) > max_density * sample.numel():
        return None
    return flat.to(torch.bool).nonzero().squeeze(1)  # x != 0 (NaN too); the cast is faster


def _into(result: Tensor, out: Tensor | None) -> Tensor:
    return result if out is None else out.copy_(result)


class Dropout(nn.Dropout):
    """:class:`torch.nn.Dropout` computed by :func:`dropout`: bitwise the same, faster on
    the CPU."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


class InputDropout(nn.Dropout):
    """:class:`torch.nn.Dropout` for modality inputs, computed by :func:`nonzero_dropout`
    (same distribution, other random draws; identity in eval mode)."""

    def __init__(self, p: float = 0.5, max_density: float = MAX_DENSITY) -> None:
        super().__init__(p)
        self.max_density = max_density

    def forward(self, x: Tensor) -> Tensor:
        return nonzero_dropout(x, self.p, self.training, self.max_density)

    def extra_repr(self) -> str:
        return f"p={self.p}, max_density={self.max_density}"
