r"""Memory-drift diagnostics of the FedOGL paper: semantic, structural, federated (Eqs. 2-4).

Pure functions; they compute in float64 and return floats (centroids and bases: tensors in
the input dtype)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fedlightning.utils.linalg import fix_signs

__all__ = [
    "basis_drift",
    "class_centroids",
    "discrepancy_spread",
    "dispersion_of",
    "principal_basis",
    "prototype_discrepancies",
    "prototype_dispersion",
    "semantic_drift",
]


def _cos_dist(a: Tensor, b: Tensor) -> float:
    """``1 - cos(a, b)`` in float64 (a zero vector has cosine 0 to anything)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten().to(a.device)
    return 1.0 - float(F.cosine_similarity(a, b, dim=0))


def class_centroids(z: Tensor, y: Tensor, classes: Sequence[int]) -> dict[int, Tensor]:
    r"""Mean embedding of each class, the :math:`\boldsymbol{\mu}_c` of Eq. (2).

    .. math::
        \boldsymbol{\mu}_c = \frac{1}{|\{i : y_i = c\}|} \sum_{i : y_i = c} \mathbf{z}_i

    Classes without any node are left out (so drift functions skip them).

    Shapes: input ``z`` :math:`(N, d)`, ``y`` :math:`(N,)`; output ``{c: (d,)}``."""
    if z.dim() != 2 or y.shape != (z.shape[0],):
        raise ValueError(f"expected z [N, d] and y [N], got {tuple(z.shape)}, {tuple(y.shape)}")
    y = y.to(z.device)
    out: dict[int, Tensor] = {}
    for c in classes:
        mask = y == c
        if mask.any():
            out[int(c)] = z[mask].mean(dim=0)
    return out


def semantic_drift(then: Mapping[int, Tensor], now: Mapping[int, Tensor]) -> float:
    r"""Semantic drift of class centroids between two times, FedOGL Eq. (2).

    .. math::
        D_{sem}(t) = \frac{1}{|\mathcal{C}^t_{old}|} \sum_{c \in \mathcal{C}^t_{old}}
        \Big[ 1 - \cos\big(\boldsymbol{\mu}_c^{t_c}, \boldsymbol{\mu}_c^{t}\big) \Big]

    ``then`` holds each class's centroid when it appeared (stage :math:`t_c`), ``now`` at
    stage :math:`t`; :math:`\mathcal{C}^t_{old}` is the classes in both (NaN if none).

    Shapes: input ``{c: (d,)}`` each."""
    common = sorted(set(then) & set(now))
    if not common:
        return math.nan
    return sum(_cos_dist(then[c], now[c]) for c in common) / len(common)


def principal_basis(z: Tensor, r: int, center: bool = True) -> Tensor:
    r"""Top-:math:`r` principal directions of embeddings: the structural basis :math:`\mathbf{U}`.

    .. math::
        \mathbf{Z} - \mathbf{1}\bar{\mathbf{z}}^\top = \mathbf{P} \boldsymbol{\Sigma}
        \mathbf{V}^\top, \qquad \mathbf{U} = \mathbf{V}_{:, :r}

    :math:`1 \le r \le \min(N, d)`; ``center=False`` skips the centring. Signs are fixed by
    :func:`~fedlightning.utils.linalg.fix_signs`, so the basis is deterministic.

    Shapes: input :math:`(N, d)`; output :math:`(d, r)` in the dtype of ``z``."""
    if z.dim() != 2:
        raise ValueError(f"expected z [N, d], got {tuple(z.shape)}")
    n, d = z.shape
    if not 1 <= r <= min(n, d):
        raise ValueError(f"r must be in [1, min(N, d) = {min(n, d)}], got {r}")
    x = z.detach().double()
    if center:
        x = x - x.mean(dim=0, keepdim=True)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    return fix_signs(vh[:r].T).to(z.dtype)


def basis_drift(u_then: Tensor, u_now: Tensor) -> float:
    r"""Structural drift between two orthonormal bases, FedOGL Eq. (3).

    .. math::
        D_{str}(i \to t) = \frac{1}{\sqrt{2r}} \big\| \mathbf{U}^{(i)} \mathbf{U}^{(i)\top} -
        \mathbf{U}^{(t)} \mathbf{U}^{(t)\top} \big\|_F

    0 for the same subspace, 1 for orthogonal ones (``u_then`` right after task :math:`i`,
    ``u_now`` after task :math:`t`, orthonormal columns).

    Shapes: input :math:`(d, r)` each."""
    if u_then.dim() != 2 or u_then.shape != u_now.shape:
        raise ValueError(
            f"expected two [d, r] bases of one shape, got {tuple(u_then.shape)} and "
            f"{tuple(u_now.shape)}"
        )
    a, b = u_then.detach().double(), u_now.detach().double().to(u_then.device)
    r = a.shape[1]
    diff = a @ a.T - b @ b.T
    return float(torch.linalg.matrix_norm(diff, ord="fro")) / math.sqrt(2 * r)


def prototype_discrepancies(
    local: Mapping[int, Mapping[int, Tensor]], global_: Mapping[int, Tensor]
) -> dict[int, dict[int, float]]:
    r"""The terms of FedOGL Eq. (4), client by class (the matrix of the paper's Fig. 3):
    ``{c: {k: 1 - cos(p_kc, pbar_c)}}``.

    ``local[c]`` maps each client :math:`k \in \mathcal{K}_c` to its prototype
    :math:`\mathbf{p}_{k,c}`, ``global_[c]`` is :math:`\bar{\mathbf{p}}_c`; only the classes
    with both appear, in ascending order (the clients in ``local[c]``'s order)."""
    classes = sorted(c for c in set(local) & set(global_) if len(local[c]) > 0)
    return {c: {k: _cos_dist(p, global_[c]) for k, p in local[c].items()} for c in classes}


def dispersion_of(terms: Mapping[int, Mapping[int, float]]) -> float:
    """Eq. (4)'s averages of :func:`prototype_discrepancies`: over each class's clients, then
    over the classes, each class weighing the same (NaN with no class)."""
    if not terms:
        return math.nan
    per_class = [sum(t.values()) / len(t) for t in terms.values()]
    return sum(per_class) / len(per_class)


def discrepancy_spread(
    terms: Mapping[int, Mapping[int, float]], name: str = "d_fed"
) -> dict[str, float]:
    """How unevenly the terms of Eq. (4) fall (Fig. 3's "class- and client-wise variation"):
    the population standard deviation of all (client, class) terms (``<name>_std``), of the
    per-class means over their clients (``<name>_class_std``), and of the per-client means
    over their classes (``<name>_client_std``); NaN with no term."""
    by_client: dict[int, list[float]] = {}
    for t in terms.values():
        for k, v in t.items():
            by_client.setdefault(k, []).append(v)

    def std(values: list[float]) -> float:
        if not values:
            return math.nan
        return float(torch.tensor(values, dtype=torch.float64).std(correction=0))

    return {
        f"{name}_std": std([v for t in terms.values() for v in t.values()]),
        f"{name}_class_std": std([sum(t.values()) / len(t) for t in terms.values()]),
        f"{name}_client_std": std([sum(v) / len(v) for v in by_client.values()]),
    }


def prototype_dispersion(
    local: Mapping[int, Sequence[Tensor]], global_: Mapping[int, Tensor]
) -> float:
    r"""Cross-client prototype inconsistency, FedOGL Eq. (4).

    .. math::
        D_{fed} = \frac{1}{|\mathcal{C}_K|} \sum_{c \in \mathcal{C}_K}
        \frac{1}{|\mathcal{K}_c|} \sum_{k \in \mathcal{K}_c}
        \Big[ 1 - \cos\big(\mathbf{p}_{k,c}, \bar{\mathbf{p}}_c\big) \Big]

    ``local[c]`` holds the prototypes :math:`\mathbf{p}_{k,c}` of the clients
    :math:`\mathcal{K}_c`, ``global_[c]`` :math:`\bar{\mathbf{p}}_c`. :math:`\mathcal{C}_K` is
    the classes with both (NaN if none); each class weighs the same.

    Shapes: input ``local`` ``{c: [(d,), ...]}``, ``global_`` ``{c: (d,)}``."""
    return dispersion_of(
        prototype_discrepancies({c: dict(enumerate(ps)) for c, ps in local.items()}, global_)
    )
