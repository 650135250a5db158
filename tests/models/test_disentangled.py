"""FedIIH's disentangled GNN: neighbourhood routing and factor moments by hand."""

from __future__ import annotations

import math

import torch
from torch_geometric.data import Data

from fedlightning.models.disentangled import (
    DisentangledGNN,
    factor_moments,
    neighbourhood_routing,
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
