"""FedOGL's structure-basis shielding, Eqs. (7)-(9): a weight change with ``dW U = 0`` leaves
the old stages' outputs unchanged. Eigen-decompositions in float64, results in the input's
dtype."""

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
    """Eq. (7)'s class-balanced weights ``W_{k,t}`` of labels [n]: each present class the same
    total, summing to n."""
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
    """A client's residual basis ``U_{k,t}`` [d, <= rank] of Eq. (7): TopEig of the weighted
    covariance of the centred inputs ``z`` [n, d] with ``prev`` projected out (eigenvalues
    under ``EIG_RTOL`` of the non-residual top dropped); ``include_mean`` puts the unit mean
    direction, residualised, in the last column unless negligible."""
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
    """The global basis ``U_t`` [d, <= rank] of Eq. (8): TopEig of ``rho U_{t-1} U_{t-1}^T``
    plus the weight-normalised client projectors."""
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
    """Eq. (9): ``G - (G U) U^T`` for ``grad`` [out, in] and orthonormal ``basis`` [in, r]."""
    if grad.dim() != 2 or basis.dim() != 2 or basis.size(0) != grad.size(1):
        raise ValueError(
            f"project_out needs grad [out, in] and basis [in, r], got {tuple(grad.shape)} "
            f"and {tuple(basis.shape)}"
        )
    u = basis.to(device=grad.device, dtype=grad.dtype)
    return grad - (grad @ u) @ u.T
