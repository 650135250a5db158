r"""Structure-basis memory shielding of FedOGL, Eqs. (7)-(9), as pure ``torch`` functions.

A weight :math:`W` (``(out, in)``) maps its input :math:`X` to :math:`X W^\top`; a change with
:math:`\Delta W U = 0` for an orthonormal basis :math:`U` of the old stages' rows of
:math:`X` leaves their linear output unchanged. Clients extract residual bases (Eq. (7)),
the server merges them (Eq. (8)), later stages project gradients (Eq. (9), training side:
:class:`fedlightning.methods.fedogl.projection.GradientProjection`). Eigen-decompositions run in float64;
results are cast back to the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedlightning.utils.linalg import fix_signs

#: Eigenvalues below ``EIG_RTOL`` times the reference (largest) eigenvalue are dropped.
EIG_RTOL = 1e-8


def _top_eig(mat: Tensor, k: int, ref: float, rtol: float = EIG_RTOL) -> Tensor:
    """The ``<= k`` leading eigenvectors of the symmetric ``mat`` with eigenvalue > ``rtol*ref``."""
    if k <= 0 or ref <= 0:
        return mat.new_zeros(mat.size(0), 0)
    evals, evecs = torch.linalg.eigh(0.5 * (mat + mat.T))  # ascending
    order = torch.argsort(evals, descending=True)
    evals, evecs = evals[order], evecs[:, order]
    keep = evals > rtol * ref
    return evecs[:, keep][:, :k]


def _check_basis(u: Tensor, d: int, what: str) -> None:
    if u.dim() != 2 or u.size(0) != d:
        raise ValueError(f"{what} must have shape [{d}, r], got {tuple(u.shape)}")


def class_balanced_weights(y: Tensor) -> Tensor:
    r"""Class-balanced sample weights :math:`\mathbf{W}_{k,t}` of Eq. (7) for labels ``[n]``.

    .. math::
        w_i = \frac{n}{\sum_j 1/n_{y_j}} \cdot \frac{1}{n_{y_i}}

    (:math:`n_c` nodes of class :math:`c`): every present class gets the same total weight,
    and the weights sum to :math:`n`.
    """
    if y.dim() != 1:
        raise ValueError(f"y must have shape [n], got {tuple(y.shape)}")
    if y.numel() == 0:
        return torch.zeros(0)
    counts = torch.bincount(y.long())
    w = 1.0 / counts[y.long()].to(torch.get_default_dtype())
    return w * (y.numel() / w.sum())


def residual_basis(
    z: Tensor,
    prev: Tensor | None,
    rank: int,
    weights: Tensor | None = None,
    include_mean: bool = True,
) -> Tensor:
    r"""A client's residual structural basis :math:`\mathbf{U}_{k,t}`, Eq. (7).

    .. math::
        \boldsymbol{\mu} = \frac{\sum_i w_i \mathbf{z}_i}{\sum_i w_i},\quad
        \mathbf{H} = \mathbf{Z} - \mathbf{1}\boldsymbol{\mu}^\top,\quad
        \widetilde{\mathbf{H}} = \mathbf{H}(\mathbf{I} - \mathbf{U}_{t-1}\mathbf{U}_{t-1}^\top),

    .. math::
        \mathbf{C} = \widetilde{\mathbf{H}}^\top \mathbf{W} \widetilde{\mathbf{H}},\quad
        \mathbf{U}_{k,t} = \mathrm{TopEig}(\mathbf{C})

    with :math:`\mathbf{W} = \mathrm{diag}(w)` (ones without ``weights``). ``z`` ``[n, d]``
    is the protected weight's exact input (``models.structure.protected_input``), ``prev``
    is :math:`\mathbf{U}_{t-1}` ``[d, r0]`` or ``None``. Eigenvalues at or below ``1e-8``
    times the reference (the top eigenvalue of the non-residual
    :math:`\mathbf{H}^\top\mathbf{W}\mathbf{H}`, or :math:`\sum_i w_i \lVert\boldsymbol{\mu}
    \rVert^2` if larger and ``include_mean``) are dropped, so data spanned by ``prev``
    gives no vectors.

    ``include_mean`` appends the unit mean direction (removed by the centring, though the
    inputs themselves must keep their outputs), residualised against ``prev`` and the
    eigenvectors, in the last of the ``rank`` columns, unless its residual is negligible by
    the same tolerance (then the ``rank``-th eigenvector takes the slot).

    Returns:
        ``[d, r]``, ``r <= rank``, orthonormal, orthogonal to ``prev``, :func:`fix_signs`.
    """
    if z.dim() != 2:
        raise ValueError(f"z must have shape [n, d], got {tuple(z.shape)}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    n, d = z.shape
    dtype = z.dtype if z.is_floating_point() else torch.get_default_dtype()
    zz = z.detach().to(torch.float64)
    if n == 0 or rank == 0:
        return z.new_zeros(d, 0, dtype=dtype)
    if weights is None:
        w = zz.new_ones(n)
    else:
        if weights.shape != (n,):
            raise ValueError(f"weights must have shape [{n}], got {tuple(weights.shape)}")
        w = weights.detach().to(zz)
        if bool((w < 0).any()) or float(w.sum()) <= 0:
            raise ValueError("weights must be non-negative with a positive sum")
    u_prev = None
    if prev is not None:
        _check_basis(prev, d, "prev")
        u_prev = prev.detach().to(zz) if prev.size(1) > 0 else None

    w_sum = float(w.sum())
    mu = (w.unsqueeze(1) * zz).sum(0) / w_sum
    h = zz - mu
    cov = h.T @ (w.unsqueeze(1) * h)
    ref = float(torch.linalg.eigvalsh(0.5 * (cov + cov.T))[-1])
    if include_mean:
        ref = max(ref, w_sum * float(mu @ mu))
    if ref <= 0:
        return z.new_zeros(d, 0, dtype=dtype)

    h_res = h - (h @ u_prev) @ u_prev.T if u_prev is not None else h
    cov_res = h_res.T @ (w.unsqueeze(1) * h_res)
    cand = _top_eig(cov_res, rank, ref)
    if not include_mean:
        return fix_signs(cand).to(dtype)

    chosen = cand[:, : rank - 1]
    m = mu
    for basis in (u_prev, chosen):
        # twice: one Gram-Schmidt pass loses orthogonality when m is nearly in the span
        if basis is not None and basis.size(1) > 0:
            m = m - basis @ (basis.T @ m)
            m = m - basis @ (basis.T @ m)
    if w_sum * float(m @ m) > EIG_RTOL * ref:
        out = torch.cat([chosen, (m / m.norm()).unsqueeze(1)], dim=1)
    else:
        out = cand
    return fix_signs(out).to(dtype)


def aggregate_bases(
    prev: Tensor | None,
    client_bases: list[Tensor],
    client_weights: list[float],
    rho: float,
    rank: int,
) -> Tensor:
    r"""The server's global structural basis :math:`\mathbf{U}_t`, Eq. (8).

    .. math::
        \mathbf{S}_t = \rho\,\mathbf{U}_{t-1}\mathbf{U}_{t-1}^\top
        + \sum_{k} \alpha_k \mathbf{U}_{k,t}\mathbf{U}_{k,t}^\top,\quad
        \alpha_k = \frac{n_{k,t}}{\sum_j n_{j,t}},\quad
        \mathbf{U}_t = \mathrm{TopEig}_r(\mathbf{S}_t)

    Summing projectors makes the result independent of each client's choice of basis
    for its subspace. ``prev`` ``[d, r0]`` may be ``None``; each ``U_{k,t}`` is ``[d, r_k]``
    (``r_k`` may be 0). Eigenvalues at or below ``1e-8`` times the largest are dropped.

    Returns:
        ``[d, r']``, ``r' <= rank``, orthonormal, :func:`fix_signs`, in the inputs' dtype.
    """
    if len(client_bases) != len(client_weights):
        raise ValueError(
            f"{len(client_bases)} client bases but {len(client_weights)} client weights"
        )
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    first = prev if prev is not None else (client_bases[0] if client_bases else None)
    if first is None:
        raise ValueError("aggregate_bases needs a previous basis or at least one client basis")
    d, dtype = first.size(0), first.dtype
    s = torch.zeros(d, d, dtype=torch.float64, device=first.device)
    if prev is not None:
        _check_basis(prev, d, "prev")
        u = prev.detach().to(s)
        s += rho * (u @ u.T)
    if client_bases:
        total = float(sum(client_weights))
        if any(wk < 0 for wk in client_weights) or total <= 0:
            raise ValueError(
                f"client_weights must be non-negative with a positive sum, got {client_weights}"
            )
        for k, (uk, wk) in enumerate(zip(client_bases, client_weights, strict=True)):
            _check_basis(uk, d, f"client_bases[{k}]")
            uk = uk.detach().to(s)
            s += (wk / total) * (uk @ uk.T)
    s = 0.5 * (s + s.T)
    top = float(torch.linalg.eigvalsh(s)[-1])
    return fix_signs(_top_eig(s, rank, top)).to(dtype)


def project_out(grad: Tensor, basis: Tensor) -> Tensor:
    r"""Residual gradient projection, Eq. (9), in PyTorch's ``(out, in)`` weight layout.

    .. math::
        \mathcal{P}_\perp(\mathbf{G}) = \mathbf{G}(\mathbf{I} - \mathbf{U}\mathbf{U}^\top)
        = \mathbf{G} - (\mathbf{G}\mathbf{U})\mathbf{U}^\top

    ``grad`` ``[out, in]``, ``basis`` ``[in, r]`` orthonormal (``r`` may be 0); returns a
    new ``[out, in]`` tensor.
    """
    if grad.dim() != 2 or basis.dim() != 2 or basis.size(0) != grad.size(1):
        raise ValueError(
            f"project_out needs grad [out, in] and basis [in, r], got {tuple(grad.shape)} "
            f"and {tuple(basis.shape)}"
        )
    u = basis.to(device=grad.device, dtype=grad.dtype)
    return grad - (grad @ u) @ u.T
