"""Drift diagnostics of FedOGL Eqs. (2)-(4) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fedlightning.metrics import (
    basis_drift,
    class_centroids,
    discrepancy_spread,
    dispersion_of,
    principal_basis,
    prototype_discrepancies,
    prototype_dispersion,
    semantic_drift,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def test_class_centroids():
    z = t(1, 0, 3, 0, 0, 2).reshape(3, 2)  # rows [1,0], [3,0], [0,2]
    y = torch.tensor([0, 0, 1])
    c = class_centroids(z, y, [0, 1, 5])
    assert set(c) == {0, 1}  # class 5 has no node: no centroid
    assert c[0].tolist() == [2.0, 0.0]
    assert c[1].tolist() == [0.0, 2.0]


def test_semantic_drift_hand():
    then = {0: t(1, 0), 1: t(0, 1), 2: t(1, 1), 7: t(1, 0)}
    now = {0: t(0, 1), 1: t(0, 2), 2: t(1, 0), 9: t(1, 0)}
    # Common classes 0, 1, 2 (7 and 9 are ignored):
    #   c0: cos([1,0],[0,1]) = 0      -> 1
    #   c1: cos([0,1],[0,2]) = 1      -> 0
    #   c2: cos([1,1],[1,0]) = 1/sqrt2 -> 1 - 1/sqrt2
    expected = (1 + 0 + (1 - 1 / math.sqrt(2))) / 3
    assert semantic_drift(then, now) == pytest.approx(expected)
    assert math.isnan(semantic_drift({0: t(1, 0)}, {1: t(1, 0)}))


def test_principal_basis_axes_and_sign():
    g = torch.Generator().manual_seed(0)
    # Variance 100 along axis 2, 4 along axis 0, 0.01 along axis 1.
    z = torch.randn(200, 3, generator=g, dtype=torch.float64) * t(2, 0.1, 10) + 5.0
    u = principal_basis(z, r=2)
    assert u.shape == (3, 2) and u.dtype == torch.float64
    torch.testing.assert_close(u.T @ u, torch.eye(2, dtype=torch.float64))
    # Top direction ~ +e2, second ~ +e0 (largest-magnitude entry made positive).
    assert u[2, 0] > 0.99 and u[0, 1] > 0.99
    # Sign convention is deterministic: flipping the data flips no column.
    torch.testing.assert_close(principal_basis(-z, r=2), u)
    with pytest.raises(ValueError):
        principal_basis(z, r=4)


def test_principal_basis_center_flag():
    # All points at (10, 0) plus spread along axis 1: uncentered, the mean dominates.
    z = torch.zeros(50, 2, dtype=torch.float64)
    z[:, 0] = 10.0
    z[:, 1] = torch.linspace(-1, 1, 50, dtype=torch.float64)
    assert principal_basis(z, 1, center=True)[:, 0].abs().tolist() == pytest.approx([0, 1])
    assert principal_basis(z, 1, center=False)[:, 0].abs().tolist()[0] > 0.99


def test_basis_drift_cases():
    e = torch.eye(4, dtype=torch.float64)
    u = e[:, :2]
    assert basis_drift(u, u) == pytest.approx(0.0, abs=1e-12)
    # Orthogonal 2-dim subspaces: ||P - Q||_F^2 = 2r -> drift 1.
    assert basis_drift(u, e[:, 2:]) == pytest.approx(1.0)
    # Rotation by 30 degrees inside the same subspace: same projector -> 0.
    a = math.pi / 6
    rot = torch.tensor(
        [[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64
    )
    assert basis_drift(u, u @ rot) == pytest.approx(0.0, abs=1e-12)
    # r = 1, 45 degrees apart: ||P - Q||_F^2 = 2 - 2 cos^2(45) = 1 -> 1 / sqrt(2).
    v = ((e[:, 0] + e[:, 1]) / math.sqrt(2)).unsqueeze(1)
    assert basis_drift(e[:, :1], v) == pytest.approx(1 / math.sqrt(2))
    with pytest.raises(ValueError):
        basis_drift(u, e[:, :3])


def test_prototype_dispersion_hand():
    local = {
        0: [t(1, 0), t(0, 1)],  # distances to [1,0]: 0 and 1 -> class mean 0.5
        1: [t(1, 1)],  # distance to [2,2]: 0
        2: [],  # no observing client: left out
        3: [t(1, 0)],  # no global prototype: left out
    }
    global_ = {0: t(1, 0), 1: t(2, 2), 2: t(0, 1)}
    # Per-class mean, then mean over classes: (0.5 + 0) / 2 = 0.25
    # (pooling all prototypes would give (0 + 1 + 0) / 3 instead).
    assert prototype_dispersion(local, global_) == pytest.approx(0.25)
    assert math.isnan(prototype_dispersion({}, global_))


def test_prototype_discrepancies_client_by_class_hand():
    local = {0: {3: t(1, 0), 7: t(0, 1)}, 1: {3: t(1, 1)}, 2: {}, 4: {3: t(1, 0)}}
    global_ = {0: t(1, 0), 1: t(2, 2), 2: t(0, 1)}
    terms = prototype_discrepancies(local, global_)
    # class 2 has no client, class 4 no global prototype: both left out
    assert terms == {0: {3: pytest.approx(0.0), 7: pytest.approx(1.0)}, 1: {3: pytest.approx(0.0)}}
    assert dispersion_of(terms) == pytest.approx(0.25)  # (mean(0, 1) + 0) / 2
    assert math.isnan(dispersion_of({}))
    spread = discrepancy_spread(terms, "x")
    # all terms 0, 1, 0: mean 1/3, population std sqrt(((1/3)^2 * 2 + (2/3)^2) / 3) = sqrt(2)/3
    assert spread["x_std"] == pytest.approx(math.sqrt(2) / 3)
    assert spread["x_class_std"] == pytest.approx(0.25)  # class means 0.5 and 0
    assert spread["x_client_std"] == pytest.approx(0.5)  # client 3: mean(0, 0); client 7: 1
    assert all(math.isnan(v) for v in discrepancy_spread({}).values())
    assert set(discrepancy_spread({})) == {"d_fed_std", "d_fed_class_std", "d_fed_client_std"}
