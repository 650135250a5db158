r"""Memory-drift diagnostics of the FedOGL paper: semantic, structural, federated (Eqs. 2-4).

All are pure functions of embeddings, centroids, bases or prototypes; they compute in
float64 and return Python floats (or tensors in the input dtype for centroids and bases).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "basis_drift",
    "class_centroids",
    "principal_basis",
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

    Classes of ``classes`` without any node are left out of the result (they have no
    centroid), so drift functions skip them.

    Args:
        z: node embeddings.
        y: node labels.
        classes: the classes to compute centroids for.

    Shapes:
        - **input:** ``z`` :math:`(N, d)`, ``y`` :math:`(N,)`
        - **output:** ``{c: (d,)}``
    """
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

    :math:`\mathcal{C}^t_{old}` is taken as the classes present in both mappings. NaN when
    there is no common class.

    Args:
        then: centroid of each class when it first appeared (stage :math:`t_c`).
        now: centroid of each class at stage :math:`t`.

    Shapes:
        - **input:** ``{c: (d,)}`` each
    """
    common = sorted(set(then) & set(now))
    if not common:
        return math.nan
    return sum(_cos_dist(then[c], now[c]) for c in common) / len(common)


def principal_basis(z: Tensor, r: int, center: bool = True) -> Tensor:
    r"""Top-:math:`r` principal directions of embeddings: the structural basis :math:`\mathbf{U}`.

    .. math::
        \mathbf{Z} - \mathbf{1}\bar{\mathbf{z}}^\top = \mathbf{P} \boldsymbol{\Sigma}
        \mathbf{V}^\top, \qquad \mathbf{U} = \mathbf{V}_{:, :r}

    Columns are orthonormal. Singular vectors are only defined up to sign, so each column
    is flipped to make its largest-magnitude entry positive (first such entry on ties);
    this makes the basis a deterministic function of the span and the data.

    Args:
        z: embeddings.
        r: number of directions, :math:`1 \le r \le \min(N, d)`.
        center: subtract the mean embedding first.

    Shapes:
        - **input:** :math:`(N, d)`
        - **output:** :math:`(d, r)` in the dtype of ``z``
    """
    if z.dim() != 2:
        raise ValueError(f"expected z [N, d], got {tuple(z.shape)}")
    n, d = z.shape
    if not 1 <= r <= min(n, d):
        raise ValueError(f"r must be in [1, min(N, d) = {min(n, d)}], got {r}")
    x = z.detach().double()
    if center:
        x = x - x.mean(dim=0, keepdim=True)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    u = vh[:r].T  # [d, r]
    idx = u.abs().argmax(dim=0)
    sign = torch.sign(u[idx, torch.arange(r, device=u.device)])
    sign[sign == 0] = 1.0
    return (u * sign).to(z.dtype)


def basis_drift(u_then: Tensor, u_now: Tensor) -> float:
    r"""Structural drift between two orthonormal bases, FedOGL Eq. (3).

    .. math::
        D_{str}(i \to t) = \frac{1}{\sqrt{2r}} \big\| \mathbf{U}^{(i)} \mathbf{U}^{(i)\top} -
        \mathbf{U}^{(t)} \mathbf{U}^{(t)\top} \big\|_F

    It compares projectors, so it depends only on the spanned subspaces: 0 for the same
    subspace (any rotation of the basis within it), 1 for orthogonal subspaces.

    Args:
        u_then: basis right after task :math:`i` (orthonormal columns).
        u_now: basis of the same task after task :math:`t`.

    Shapes:
        - **input:** :math:`(d, r)` each
    """
    if u_then.dim() != 2 or u_then.shape != u_now.shape:
        raise ValueError(
            f"expected two [d, r] bases of one shape, got {tuple(u_then.shape)} and "
            f"{tuple(u_now.shape)}"
        )
    a, b = u_then.detach().double(), u_now.detach().double().to(u_then.device)
    r = a.shape[1]
    diff = a @ a.T - b @ b.T
    return float(torch.linalg.matrix_norm(diff, ord="fro")) / math.sqrt(2 * r)


def prototype_dispersion(
    local: Mapping[int, Sequence[Tensor]], global_: Mapping[int, Tensor]
) -> float:
    r"""Cross-client prototype inconsistency, FedOGL Eq. (4).

    .. math::
        D_{fed} = \frac{1}{|\mathcal{C}_K|} \sum_{c \in \mathcal{C}_K}
        \frac{1}{|\mathcal{K}_c|} \sum_{k \in \mathcal{K}_c}
        \Big[ 1 - \cos\big(\mathbf{p}_{k,c}, \bar{\mathbf{p}}_c\big) \Big]

    Each class weighs the same whatever its number of clients. :math:`\mathcal{C}_K` is
    taken as the classes with a global prototype and at least one local one. NaN when
    there is no such class.

    Args:
        local: for each class, the local prototypes :math:`\mathbf{p}_{k,c}` of the clients
            :math:`\mathcal{K}_c` observing it.
        global_: the aggregated prototype :math:`\bar{\mathbf{p}}_c` of each class.

    Shapes:
        - **input:** ``local`` ``{c: [(d,), ...]}``, ``global_`` ``{c: (d,)}``
    """
    classes = sorted(c for c in set(local) & set(global_) if len(local[c]) > 0)
    if not classes:
        return math.nan
    per_class = [sum(_cos_dist(p, global_[c]) for p in local[c]) / len(local[c]) for c in classes]
    return sum(per_class) / len(per_class)
