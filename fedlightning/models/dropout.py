r"""Input dropout that costs what the input's non-zero entries cost.

Inverted dropout multiplies every entry by an independent mask,

.. math::
    \tilde{x}_{ij} = x_{ij}\, \frac{m_{ij}}{1-p},\qquad m_{ij} \sim \mathrm{Bernoulli}(1-p),

and a zero entry gives :math:`0 \cdot m_{ij}/(1-p) = 0` whatever its mask. Drawing masks for
the non-zero entries only therefore gives the same distribution of :math:`\tilde{x}` at the
cost of the non-zeros: on a bag-of-words matrix (Cora: 1.27% of the entries are non-zero),
the dense Bernoulli draw is almost all of the cost of standard dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Above this fraction of non-zero entries a dense CPU input takes standard dropout. On a
#: 540 x 1433 input, one thread, the non-zero path costs 6.7x less than the dense draw at
#: 1.3% non-zero, 1.5x less at 30%, about the same at 50%, 0.9x at 70-100%
#: (``benchmarks/input_dropout.py --sweep``); 0.3 keeps a margin for other shapes and machines.
MAX_DENSITY = 0.3

#: The density compared with :data:`MAX_DENSITY` is that of an evenly spaced sample of about
#: this many entries (a choice of cost only, never of the result; a full count would be one
#: more pass over the input).
DENSITY_SAMPLE = 4096

_COMPRESSED = {
    torch.sparse_csr: "crow_indices",
    torch.sparse_bsr: "crow_indices",
    torch.sparse_csc: "ccol_indices",
    torch.sparse_bsc: "ccol_indices",
}


def _keep_scale(shape: torch.Size, p: float, like: Tensor) -> Tensor:
    """``m / (1-p)`` with ``m ~ Bernoulli(1-p)`` i.i.d., drawn from torch's global generator
    of ``like``'s device; ``1/(1-p)`` is rounded as standard dropout rounds it."""
    keep = torch.rand(shape, device=like.device) >= p  # P(u >= p) = 1 - p
    return keep.to(like.dtype).div_(1.0 - p)


def nonzero_dropout(
    x: Tensor, p: float = 0.5, training: bool = True, max_density: float = MAX_DENSITY
) -> Tensor:
    r"""Inverted dropout drawn for the non-zero (stored) entries of ``x`` only.

    .. math::
        \tilde{x}_{ij} = \begin{cases} x_{ij}\, m_{ij}/(1-p) & x_{ij} \neq 0 \\
        0 & x_{ij} = 0 \end{cases},\qquad m_{ij} \sim \mathrm{Bernoulli}(1-p)\ \text{i.i.d.}

    which is the distribution of :func:`torch.nn.functional.dropout` (a zero entry is zero
    under any mask). The random draws differ from standard dropout's, so the bits of a
    seeded run change, not its distribution. The masks come from torch's global generator:
    the same seed gives the same result.

    Paths:

    - torch sparse input (COO, CSR, CSC, BSR, BSC): the mask is drawn per stored value; the
      result has the input's layout and sparsity pattern (a dropped value is stored as
      zero), and a gradient reaches the kept stored values only.
    - dense CPU input that does not require grad and has at most ``max_density`` non-zero
      entries (in an evenly spaced sample of :data:`DENSITY_SAMPLE` entries): the mask is
      drawn for the non-zeros, every zero is returned untouched.
    - any other dense input: :func:`torch.nn.functional.dropout`. That covers inputs above
      the density threshold, inputs on an accelerator (its fused dropout kernel is cheap and
      finding the non-zeros would wait on the device; not measured here), and inputs that
      require grad (standard dropout's gradient at a zero entry is its random mask, which
      only a dense draw gives).

    Args:
        x: the input, dense or torch sparse, any shape.
        p: drop probability, in ``[0, 1]`` (default ``0.5``).
        training: ``False`` returns ``x`` itself (default ``True``).
        max_density: the largest fraction of non-zero entries for which a dense input takes
            the non-zero path (default :data:`MAX_DENSITY`).

    Returns:
        A tensor of ``x``'s shape, dtype, device and layout.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must lie in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if x.layout == torch.sparse_coo:
        xc = x.coalesce()
        values = xc.values()
        values = values * 0.0 if p == 1.0 else values * _keep_scale(values.shape, p, values)
        return torch.sparse_coo_tensor(
            xc.indices(),
            values,
            x.shape,
            dtype=x.dtype,
            device=x.device,
            check_invariants=False,  # the indices of a valid tensor
            is_coalesced=True,
        )
    if x.layout in _COMPRESSED:
        values = x.values()
        values = values * 0.0 if p == 1.0 else values * _keep_scale(values.shape, p, values)
        return torch.sparse_compressed_tensor(
            getattr(x, _COMPRESSED[x.layout])(),
            x.row_indices()
            if x.layout in (torch.sparse_csc, torch.sparse_bsc)
            else x.col_indices(),
            values,
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
        return F.dropout(x, p, True)
    flat = x.reshape(-1)
    sample = flat[:: max(1, flat.numel() // DENSITY_SAMPLE)]
    if int(torch.count_nonzero(sample)) > max_density * sample.numel():
        return F.dropout(x, p, True)
    idx = flat.to(torch.bool).nonzero().squeeze(1)  # x != 0 (NaN too); the cast is faster
    out = flat.clone()
    out[idx] = flat[idx] * _keep_scale(idx.shape, p, flat)
    return out.view(x.shape)


class InputDropout(nn.Dropout):
    """:class:`torch.nn.Dropout` for modality inputs, computed by :func:`nonzero_dropout`.

    Same distribution as ``nn.Dropout(p)`` (other random draws); identity in eval mode.

    Args:
        p: drop probability (default ``0.5``).
        max_density: see :func:`nonzero_dropout` (default :data:`MAX_DENSITY`).
    """

    def __init__(self, p: float = 0.5, max_density: float = MAX_DENSITY) -> None:
        super().__init__(p)
        self.max_density = max_density

    def forward(self, x: Tensor) -> Tensor:
        return nonzero_dropout(x, self.p, self.training, self.max_density)

    def extra_repr(self) -> str:
        return f"p={self.p}, max_density={self.max_density}"
