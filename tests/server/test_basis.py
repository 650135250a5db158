"""Structure-basis memory shielding, Eqs. (7)-(9): hand-computed cases and PyG identities."""

import pytest
import torch
from torch_geometric.nn import GCNConv, SAGEConv

from fedlightning.methods.fedogl.basis import (
    aggregate_bases,
    class_balanced_weights,
    project_out,
    residual_basis,
)
from fedlightning.methods.fedogl.structure import protected_input

E = torch.eye(3)
EX, EY, EZ = E[:, 0:1], E[:, 1:2], E[:, 2:3]


def _close(a, b, atol=1e-6):
    return a.shape == b.shape and torch.allclose(a, b, atol=atol)


def test_class_balanced_weights_hand_value():
    # counts: class 0 -> 3, class 1 -> 1; raw 1/3, 1/3, 1/3, 1 sum to 2; scaled by n/2 = 2
    w = class_balanced_weights(torch.tensor([0, 0, 0, 1]))
    assert _close(w, torch.tensor([2 / 3, 2 / 3, 2 / 3, 2.0]))
    assert w.sum().item() == pytest.approx(4.0)
    # class ids need not be contiguous: classes 1 and 5, two nodes each -> all ones
    assert _close(class_balanced_weights(torch.tensor([5, 1, 5, 1])), torch.ones(4))


def test_residual_basis_points_along_x():
    # points (1,0,0) and (3,0,0): mean (2,0,0), centred +-(1,0,0) -> C = diag(2, 0, 0)
    z = torch.tensor([[1.0, 0, 0], [3.0, 0, 0]])
    assert _close(residual_basis(z, None, rank=1, include_mean=False), EX)
    # rank 3 still gives one vector: the zero eigenvalues are below the tolerance
    assert _close(residual_basis(z, None, rank=3, include_mean=False), EX)
    # the mean (2,0,0) lies on e_x: its residual is zero, so nothing is appended
    assert _close(residual_basis(z, None, rank=3, include_mean=True), EX)
    # sign: points spread along -x give +e_x (largest-magnitude entry positive)
    assert _close(residual_basis(-z, None, rank=1, include_mean=False), EX)


def test_residual_basis_removes_previous_directions():
    # centred points (2,1,0), (-2,-1,0), with U_prev = e_x: residual +-(0,1,0) -> e_y,
    # although e_x carries most of the variance
    z = torch.tensor([[2.0, 1, 0], [-2.0, -1, 0]])
    assert _close(residual_basis(z, EX, rank=2, include_mean=False), EY)
    # data entirely inside span(U_prev) leaves no residual basis
    z = torch.tensor([[2.0, 0, 0], [-2.0, 0, 0]])
    assert residual_basis(z, EX, rank=2, include_mean=False).shape == (3, 0)


def test_residual_basis_appends_residual_mean():
    # points (1,1,1), (1,-1,1): mean (1,0,1), centred +-(0,1,0) -> eigenvector e_y;
    # the mean, residualised against e_y, is (1,0,1) -> unit (1,0,1)/sqrt(2)
    z = torch.tensor([[1.0, 1, 1], [1.0, -1, 1]])
    mean_dir = torch.tensor([[1.0], [0.0], [1.0]]) / 2**0.5
    assert _close(residual_basis(z, None, rank=2), torch.cat([EY, mean_dir], 1))
    # with U_prev = e_x the mean's residual is (1,0,1) - (1,0,0) = (0,0,1) -> e_z
    assert _close(residual_basis(z, EX, rank=2), torch.cat([EY, EZ], 1))
    # rank bounds all columns: with rank 1 the mean takes the only slot
    assert _close(residual_basis(z, None, rank=1), mean_dir)
    # identical points: no variance, only the mean direction
    same = torch.tensor([[0.0, 3.0, 4.0]] * 3)
    assert _close(residual_basis(same, None, rank=2), torch.tensor([[0.0], [0.6], [0.8]]))
    assert residual_basis(same, None, rank=2, include_mean=False).shape == (3, 0)


def test_residual_basis_class_balanced_weights_change_the_top_direction():
    # class 0: (+-2, 0) twice (4 nodes); class 1: (0, +-2.5) (2 nodes); weighted mean 0.
    # unweighted: sum x^2 = 16 > sum y^2 = 12.5 -> e_x.
    # balanced weights 3/4 (class 0) and 3/2 (class 1): 12 < 18.75 -> e_y.
    z = torch.tensor([[2.0, 0], [-2.0, 0], [2.0, 0], [-2.0, 0], [0, 2.5], [0, -2.5]])
    y = torch.tensor([0, 0, 0, 0, 1, 1])
    w = class_balanced_weights(y)
    assert _close(w, torch.tensor([0.75] * 4 + [1.5] * 2))
    ex, ey = torch.eye(2)[:, :1], torch.eye(2)[:, 1:]
    assert _close(residual_basis(z, None, rank=1, include_mean=False), ex)
    assert _close(residual_basis(z, None, rank=1, weights=w, include_mean=False), ey)


def test_residual_basis_is_orthonormal_and_orthogonal_to_prev():
    g = torch.Generator().manual_seed(0)
    prev = torch.linalg.qr(torch.randn(8, 3, generator=g))[0]
    z = torch.randn(20, 8, generator=g) + 2.0
    u = residual_basis(z, prev, rank=4)
    assert u.shape == (8, 4)
    assert _close(u.T @ u, torch.eye(4), atol=1e-5)
    assert (prev.T @ u).abs().max() < 1e-5
    assert bool((u.gather(0, u.abs().argmax(0, keepdim=True)) > 0).all())
    # prev plus the new basis span the data: 3 + 4 of 8 dims covered, rest is residual
    full = residual_basis(z, prev, rank=5)
    assert full.shape == (8, 5)
    span = torch.cat([prev, full], 1)
    assert torch.allclose(z - (z @ span) @ span.T, torch.zeros_like(z), atol=1e-4)


def test_aggregate_bases_hand_eigendecomposition():
    # P = 0.5 e_x e_x^T + (1/4) e_y e_y^T + (3/4) e_z e_z^T = diag(0.5, 0.25, 0.75):
    # the top-2 eigenvectors are e_z (0.75) then e_x (0.5); e_y (0.25) is cut by rank
    u = aggregate_bases(EX, [EY, EZ], [1.0, 3.0], rho=0.5, rank=2)
    assert _close(u, torch.cat([EZ, EX], 1))
    # rho = 0.1 makes the old direction the weakest: diag(0.1, 0.25, 0.75) -> e_z, e_y
    u = aggregate_bases(EX, [EY, EZ], [1.0, 3.0], rho=0.1, rank=2)
    assert _close(u, torch.cat([EZ, EY], 1))
    # no previous basis; two clients sharing e_x (one with a flipped sign): P = e_x e_x^T
    # has a single non-zero eigenvalue, so rank 3 still returns one vector
    assert _close(aggregate_bases(None, [EX, -EX], [2.0, 5.0], rho=0.9, rank=3), EX)
    # projectors, not vectors: a client's rotated basis of the x-y plane changes nothing
    c, s = 0.6, 0.8
    rot = torch.tensor([[c, -s], [s, c], [0.0, 0.0]])
    u = aggregate_bases(None, [rot], [1.0], rho=0.0, rank=2)
    assert _close(u @ u.T, torch.diag(torch.tensor([1.0, 1.0, 0.0])), atol=1e-6)
    # only the previous basis (no client reported one this round)
    assert _close(aggregate_bases(EY, [], [], rho=0.7, rank=2), EY)
    with pytest.raises(ValueError):
        aggregate_bases(None, [], [], rho=0.5, rank=2)


def test_project_out_hand_value():
    # G = [[1, 2, 3]], U = e_y: G(I - e_y e_y^T) = [[1, 0, 3]]
    g = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert _close(project_out(g, EY), torch.tensor([[1.0, 0.0, 3.0], [4.0, 0.0, 6.0]]))
    # U = (1,1,0)/sqrt(2): G U U^T = [[1.5, 1.5, 0], [4.5, 4.5, 0]]
    u = torch.tensor([[1.0], [1.0], [0.0]]) / 2**0.5
    assert _close(project_out(g, u), torch.tensor([[-0.5, 0.5, 3.0], [-0.5, 0.5, 6.0]]))
    # the projected change leaves X W^T fixed on rows in span(U)
    assert _close(u.T @ project_out(g, u).T, torch.zeros(1, 2))
    assert _close(project_out(g, torch.zeros(3, 0)), g)


def _graph():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g)
    ei = torch.tensor([[0, 1, 1, 2, 3, 4, 5, 6, 2], [1, 0, 2, 1, 4, 3, 6, 5, 5]])
    return x, ei


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"improved": True}, {"add_self_loops": False}, {"normalize": False}],
)
def test_protected_input_gcn_identity(kwargs):
    x, ei = _graph()
    torch.manual_seed(0)
    conv = GCNConv(5, 4, **kwargs)
    torch.nn.init.normal_(conv.bias)
    a_hat_x = protected_input(conv, x, ei)
    assert a_hat_x.shape == (7, 5)
    assert torch.allclose(conv(x, ei), a_hat_x @ conv.lin.weight.T + conv.bias, atol=1e-6)
    ew = torch.rand(ei.size(1), generator=torch.Generator().manual_seed(1))
    out = protected_input(conv, x, ei, ew) @ conv.lin.weight.T + conv.bias
    assert torch.allclose(conv(x, ei, ew), out, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{}, {"aggr": "max"}, {"project": True}])
def test_protected_input_sage_identity(kwargs):
    x, ei = _graph()
    torch.manual_seed(0)
    conv = SAGEConv(5, 4, **kwargs)
    parts = protected_input(conv, x, ei)
    assert set(parts) == {"lin_l", "lin_r"}
    out = (
        parts["lin_l"] @ conv.lin_l.weight.T
        + conv.lin_l.bias
        + parts["lin_r"] @ conv.lin_r.weight.T
    )
    assert torch.allclose(conv(x, ei), out, atol=1e-6)
    # default mean aggregation by hand: node 5 receives the edges 6 -> 5 and 2 -> 5
    if not kwargs:
        assert torch.allclose(parts["lin_l"][5], (x[6] + x[2]) / 2, atol=1e-6)
        assert torch.equal(parts["lin_r"], x)


def test_protected_input_rejects_other_layers():
    x, ei = _graph()
    with pytest.raises(TypeError):
        protected_input(torch.nn.Linear(5, 4), x, ei)
