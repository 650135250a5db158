"""FedIIH's disentangled GNN: neighbourhood routing and factor moments by hand."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch_geometric.data import Data

from fedlightning.methods.fediih import disentangled
from fedlightning.methods.fediih.disentangled import (
    DisentangledGNN,
    factor_moments,
    neighbourhood_routing,
    unit_channels,
)


def test_one_routing_iteration_by_hand():
    # node 1 sends to node 0; K = 2 factors of width 2
    x = torch.tensor([[[3.0, 4.0], [1.0, 0.0]], [[0.0, 2.0], [0.0, -1.0]]])
    c = neighbourhood_routing(x, torch.tensor([[1], [0]]), iterations=1, tau=1.0)
    z0 = [[0.6, 0.8], [1.0, 0.0]]
    z1 = [[0.0, 1.0], [0.0, -1.0]]
    # p over factors of <z_1k, c_0k> with c = z: factor 0: 0.8, factor 1: 0
    p = [math.exp(0.8) / (math.exp(0.8) + 1), 1 / (math.exp(0.8) + 1)]
    out0 = []
    for k in range(2):
        v = [z0[k][j] + p[k] * z1[k][j] for j in range(2)]
        norm = math.sqrt(sum(t * t for t in v))
        out0.append([t / norm for t in v])
    assert torch.allclose(c[0], torch.tensor(out0), atol=1e-6)
    assert torch.allclose(c[1], torch.tensor(z1), atol=1e-6)  # node 1 receives nothing


def test_unit_channels_is_normalize_with_no_gradient_through_a_zero_channel():
    x = torch.tensor([[[3.0, 4.0], [0.0, 0.0]], [[0.0, 0.0], [1.0, -2.0]]], requires_grad=True)
    w = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])
    (unit_channels(x) * w).sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    out = F.normalize(ref, dim=-1)
    assert torch.equal(unit_channels(x).detach(), out.detach())  # the same values, zeros too
    (out * w).sum().backward()
    nonzero = torch.tensor([[True, False], [False, True]])
    assert torch.allclose(x.grad[nonzero], ref.grad[nonzero])
    assert torch.equal(x.grad[~nonzero], torch.zeros(2, 2))  # F.normalize: w / 1e-12
    assert ref.grad[~nonzero].abs().max() > 1e11


def test_routing_gradient_stays_finite_when_dropout_empties_a_factor_channel(monkeypatch):
    # The failing FedIIH fit, in small: factor 0 of both nodes is non-zero in one entry only
    # (ReLU), which dropout drops before routing layers 2 and 3 while keeping the zeros. With
    # F.normalize each emptied channel multiplied its gradient by 1/eps = 1e12, twice per layer
    # (the node's z and the neighbour's c); across two layers that overflowed to inf, and inf
    # times dropout's zeros gave NaN in the input layer's weights.
    x0 = torch.tensor([[[1.0, 0, 0], [1, 2, 0]], [[2, 0, 0], [0, 1, 1]]], requires_grad=True)
    edges = torch.tensor([[0, 1], [1, 0]])
    keep = torch.ones(2, 2, 3)
    keep[:, 0, 0] = 0.0

    def routed(x: torch.Tensor, constant_zero: bool) -> torch.Tensor:
        h = neighbourhood_routing(x, edges)
        for _ in range(2):
            h = h * keep
            if constant_zero:  # the reference: the emptied channel as a constant
                h = torch.cat([torch.zeros(2, 1, 3), h[:, 1:]], dim=1)
            h = neighbourhood_routing(h, edges)
        return h

    routed(x0, constant_zero=False).sum().backward()
    assert torch.isfinite(x0.grad).all()
    assert torch.equal(x0.grad[:, 0], torch.zeros(2, 3))  # factor 0 reaches nothing
    ref = x0.detach().clone().requires_grad_(True)
    monkeypatch.setattr(disentangled, "unit_channels", lambda x: F.normalize(x, dim=-1))
    routed(ref, constant_zero=True).sum().backward()
    assert torch.allclose(x0.grad, ref.grad, atol=1e-6)
    assert ref.grad[:, 1].abs().min() > 1e-3  # factor 1 does learn


def test_factor_moments_by_hand():
    h = torch.tensor([[[1.0], [2.0]], [[3.0], [6.0]], [[100.0], [100.0]]])
    mu, logvar = factor_moments(h, torch.tensor([True, True, False]), eps=0.0)
    assert torch.allclose(mu, torch.tensor([[2.0], [4.0]]))
    assert torch.allclose(logvar, torch.log(torch.tensor([[1.0], [4.0]])))


def test_factor_axes_split_the_input_rows_and_head_columns():
    net = DisentangledGNN({"a": 5, "b": 3}, 4, factors=2, hidden=8)
    axes = net.factor_axes()
    state = net.state_dict()
    assert axes["inputs.a.weight"] == 0 and state["inputs.a.weight"].shape == (8, 5)
    assert axes["head.weight"] == 1 and state["head.weight"].shape == (4, 8)
    assert "head.bias" not in axes
    data = Data(
        x_a=torch.randn(6, 5),
        x_b=torch.randn(6, 3),
        modality_mask=torch.ones(6, 2, dtype=torch.bool),
        edge_index=torch.tensor([[0, 1, 2], [1, 2, 3]]),
        num_nodes=6,
    )
    assert net.eval()(data).shape == (6, 4)
    mu, logvar = net.posterior(data, torch.ones(6, dtype=torch.bool))
    assert mu.shape == logvar.shape == (2, 4)


def test_routing_gradient_is_the_same_on_every_run_on_two_threads(grads_on_two_threads):
    """Advanced indexing ``z[src]`` accumulated its backward in any order on several CPU
    threads, so FedIIH's runs with ``threads: auto`` changed from run to run; gathered with
    ``index_select``, the gradient is the same on every run (and bitwise the old one on one
    thread)."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.relu(torch.randn(2000, 2, 16, generator=g))
    edges = torch.randint(0, 2000, (2, 8000), generator=g)
    upstream = torch.randn(2000, 2, 16, generator=g)
    grads = grads_on_two_threads(
        x0, lambda x: (neighbourhood_routing(x, edges, iterations=2) * upstream).sum()
    )
    assert all(torch.equal(grads[0], other) for other in grads[1:])


def per_iteration_routing(x: torch.Tensor, edge_index: torch.Tensor, iterations: int = 6):
    """The routing layer as written before (DisenGCN, Alg. 1): ``z[src]`` gathered afresh
    twice per iteration; the reference for the one gather per layer."""
    z = unit_channels(x)
    src, dst = edge_index
    keep = src != dst
    src, dst = src[keep], dst[keep]
    c = z
    for _ in range(iterations):
        p = torch.softmax((z.index_select(0, src) * c.index_select(0, dst)).sum(-1), dim=1)
        c = unit_channels(z.index_add(0, dst, p.unsqueeze(-1) * z.index_select(0, src)))
    return c


def test_one_gather_per_layer_is_bitwise_the_per_iteration_gathers_on_cora(shared_data):
    """Cora's graph, FedIIH's three routing layers of six iterations with dropout between
    them: the values and the input's gradient are bitwise those of the per-iteration
    gathers (each use of the shared gather keeps its own ``index_select`` backward)."""
    from fedlightning.data.graphs.planetoid import load_planetoid

    edges = load_planetoid("cora", root=shared_data).edge_index
    g = torch.Generator().manual_seed(0)
    x0 = torch.relu(torch.randn(2708, 2, 16, generator=g))
    keep = [(torch.rand(2708, 2, 16, generator=g) > 0.35) / 0.65 for _ in range(2)]
    upstream = torch.randn(2708, 2, 16, generator=g)
    out, grads = [], []
    for routing in (neighbourhood_routing, per_iteration_routing):
        x = x0.clone().requires_grad_(True)
        h = routing(x, edges, 6)
        for mask in keep:
            h = routing(h * mask, edges, 6)
        (h * upstream).sum().backward()
        out.append(h.detach())
        grads.append(x.grad)
    assert torch.equal(out[0], out[1])
    assert torch.equal(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_a_sparse_input_is_coalesced_once_with_the_same_logits():
    g = torch.Generator().manual_seed(1)
    dense = (torch.rand(6, 5, generator=g) < 0.4).float()
    idx = dense.nonzero().t()
    sparse = torch.sparse_coo_tensor(idx, dense[idx[0], idx[1]], (6, 5))  # not flagged
    assert not sparse.is_coalesced()
    kept = disentangled.sparse_coalesced(sparse)
    assert kept.is_coalesced() and disentangled.sparse_coalesced(sparse) is kept
    assert disentangled.sparse_coalesced(dense) is dense
    torch.manual_seed(0)
    net = DisentangledGNN({"w": 5}, 3, factors=2, hidden=4).eval()

    def logits(x: torch.Tensor) -> torch.Tensor:
        data = Data(
            x_w=x,
            modality_mask=torch.ones(6, 1, dtype=torch.bool),
            edge_index=torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]]),
            num_nodes=6,
        )
        return net(data)

    assert torch.allclose(logits(sparse), logits(dense), atol=1e-6)
    assert torch.equal(logits(sparse), logits(sparse.coalesce()))
