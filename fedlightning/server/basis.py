r"""Structure-basis memory shielding of FedOGL, Eqs. (7)-(9), as pure functions.

A protected structural weight :math:`W \in \mathbb{R}^{\mathrm{out} \times \mathrm{in}}`
(PyTorch's layout) maps the tensor :math:`X` that multiplies it to :math:`X W^\top`. If a
weight change :math:`\Delta W` satisfies :math:`\Delta W U = 0` for an orthonormal basis
:math:`U` of the rows of the old stages' :math:`X`, the layer's linear output on those rows
is unchanged. Clients extract a residual basis from their stage's inputs (Eq. (7)), the
server merges the clients' bases by summing projectors (Eq. (8)), and the next stage
removes the basis directions from the gradient (Eq. (9)) -- see
:class:`fedlightning.callbacks.GradientProjection` for the training side.

Everything here is plain ``torch`` (and PyG for :func:`protected_input`); the server never
imports Lightning. Eigen-decompositions run in float64 and the result is cast back to the
input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Eigenvalues below ``EIG_RTOL`` times the reference (largest) eigenvalue are dropped.
EIG_RTOL = 1e-8


def _fix_signs(u: Tensor) -> Tensor:
    """Flip each column so that its largest-magnitude entry is positive (first on ties)."""
    if u.size(1) == 0:
        return u
    idx = u.abs().argmax(dim=0)
    signs = torch.sign(u.gather(0, idx.unsqueeze(0))).squeeze(0)
    signs[signs == 0] = 1.0
    return u * signs


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
    r"""Class-balanced sample weights :math:`\mathbf{W}_{k,t}` of Eq. (7).

    .. math::
        w_i = \frac{n}{\sum_j 1/n_{y_j}} \cdot \frac{1}{n_{y_i}}

    where :math:`n_c` is the number of nodes of class :math:`c`: every present class gets
    the same total weight, and the weights sum to :math:`n`.

    Args:
        y (Tensor): integer labels ``[n]`` (non-negative).

    Returns:
        float weights ``[n]``.
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

    with :math:`\mathbf{W} = \mathrm{diag}(w)` (all ones without ``weights``). Eigenvalues
    at or below ``1e-8`` times the reference eigenvalue (the largest eigenvalue of the
    centred, non-residual :math:`\mathbf{H}^\top\mathbf{W}\mathbf{H}`, or
    :math:`\sum_i w_i \lVert\boldsymbol{\mu}\rVert^2` if that is larger and
    ``include_mean``) are dropped, so data already spanned by ``prev`` gives no vectors.

    With ``include_mean``, the unit mean direction -- which the centring removes, although
    the layer's inputs (not their deviations) are what must keep their outputs -- is
    residualised against ``prev`` and the chosen eigenvectors and appended, unless its
    residual is negligible by the same tolerance (:math:`\sum_i w_i\lVert
    \tilde{\boldsymbol{\mu}}\rVert^2`). ``rank`` bounds the total number of columns: with
    ``include_mean`` the eigenvectors take at most ``rank - 1`` slots and the mean the
    last; if the mean is negligible the ``rank``-th eigenvector takes its slot.

    Args:
        z (Tensor): structural embeddings ``[n, d]`` (for gradient shielding, the exact
            input of the protected weight, see :func:`protected_input`).
        prev (Tensor, optional): previous global basis ``U_{t-1}`` ``[d, r0]`` with
            orthonormal columns, or ``None``.
        rank (int): the most columns to return (``r_l``).
        weights (Tensor, optional): sample weights ``[n]``, e.g.
            :func:`class_balanced_weights`. (default: ``None``)
        include_mean (bool, optional): append the residual mean direction.
            (default: ``True``)

    Returns:
        ``[d, r]`` with ``r <= rank``, orthonormal columns, orthogonal to ``prev``, each
        column's largest-magnitude entry positive.
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
        return _fix_signs(cand).to(dtype)

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
    return _fix_signs(out).to(dtype)


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

    Summing projectors, not basis vectors, makes the result independent of each client's
    choice of basis (rotations, signs) for its subspace. Eigenvalues at or below ``1e-8``
    times the largest are dropped, so the result can have fewer than ``rank`` columns.
    Eigenvectors of a repeated eigenvalue are any orthonormal basis of its eigenspace.

    Args:
        prev (Tensor, optional): ``U_{t-1}`` ``[d, r0]``, or ``None`` at the first stage.
        client_bases (list[Tensor]): ``U_{k,t}`` ``[d, r_k]`` (``r_k`` may be ``0``).
        client_weights (list[float]): ``n_{k,t}`` (normalised here to ``alpha_k``).
        rho (float): decay of the old projector.
        rank (int): the most columns ``r`` to return.

    Returns:
        ``[d, r']`` with ``r' <= rank``, orthonormal columns, largest-magnitude entry of
        each column positive, in the dtype of the inputs.
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
    return _fix_signs(_top_eig(s, rank, top)).to(dtype)


def project_out(grad: Tensor, basis: Tensor) -> Tensor:
    r"""Residual gradient projection, Eq. (9), in PyTorch's ``(out, in)`` weight layout.

    .. math::
        \mathcal{P}_\perp(\mathbf{G}) = \mathbf{G}(\mathbf{I} - \mathbf{U}\mathbf{U}^\top)
        = \mathbf{G} - (\mathbf{G}\mathbf{U})\mathbf{U}^\top

    For a weight ``W`` with output ``X W^T``, a change ``G`` with ``G U = 0`` leaves
    ``X W^T`` unchanged on every row of ``X`` in ``span(U)``.

    Args:
        grad (Tensor): a gradient or weight change ``[out, in]``.
        basis (Tensor): ``U`` ``[in, r]`` with orthonormal columns (``r`` may be ``0``).

    Returns:
        ``[out, in]``, a new tensor.
    """
    if grad.dim() != 2 or basis.dim() != 2 or basis.size(0) != grad.size(1):
        raise ValueError(
            f"project_out needs grad [out, in] and basis [in, r], got {tuple(grad.shape)} "
            f"and {tuple(basis.shape)}"
        )
    u = basis.to(device=grad.device, dtype=grad.dtype)
    return grad - (grad @ u) @ u.T
