"""FedIIH's server: JS similarity of posteriors, exp-normalized weights and per-factor mixing
against hand computations; the weights follow the posteriors' similarity."""

from __future__ import annotations

import math

import torch
from torch.distributions import Normal, kl_divergence

from fedlightning.messages import ClientUpdate
from fedlightning.methods.fediih.fediih_server import (
    FactorMixing,
    gaussian_js,
    gaussian_kl,
    mix_factor_blocks,
    mixing_weights,
    posterior_similarity,
)


def test_gaussian_kl_matches_torch_distributions():
    mu_a, lv_a = torch.tensor([0.3, -1.0]), torch.tensor([0.2, -0.5])
    mu_b, lv_b = torch.tensor([1.0, 0.5]), torch.tensor([-0.3, 0.4])
    ref = kl_divergence(Normal(mu_a, (0.5 * lv_a).exp()), Normal(mu_b, (0.5 * lv_b).exp()))
    assert torch.allclose(gaussian_kl(mu_a, lv_a, mu_b, lv_b), ref.sum())


def test_gaussian_js_by_hand():
    # unit variances, means 0 and 2: M = N(1, 1); each KL = (1)^2 / 2 = 0.5; JS = 0.5
    zero = torch.zeros(1)
    js = gaussian_js(zero, zero, torch.tensor([2.0]), zero)
    assert torch.allclose(js, torch.tensor(0.5))
    S = posterior_similarity(torch.tensor([[0.0], [2.0]]), torch.zeros(2, 1))
    want = torch.tensor([[1.0, 1 - 0.5 / math.log(2)], [1 - 0.5 / math.log(2), 1.0]])
    assert torch.allclose(S, want.double())


def test_mixing_weights_by_hand():
    S = torch.tensor([[1.0, 0.5], [0.0, 1.0]])
    W = mixing_weights(S, scale=10.0)
    e = math.exp
    assert torch.allclose(
        W[0], torch.tensor([e(10) / (e(10) + e(5)), e(5) / (e(10) + e(5))]).double()
    )
    assert torch.allclose(W[1], torch.tensor([1 / (1 + e(10)), e(10) / (1 + e(10))]).double())


def test_mix_factor_blocks_by_hand():
    states = [{"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, {"w": torch.zeros(2, 2)}]
    W0 = torch.tensor([[0.5, 0.5], [0.0, 1.0]], dtype=torch.float64)  # factor 0: row 0
    W1 = torch.tensor([[1.0, 0.0], [0.25, 0.75]], dtype=torch.float64)  # factor 1: row 1
    out = mix_factor_blocks(states, [W0, W1], {"w": 0})
    assert torch.equal(out[0]["w"], torch.tensor([[0.5, 1.0], [3.0, 4.0]]))
    assert torch.equal(out[1]["w"], torch.tensor([[0.0, 0.0], [0.75, 1.0]]))
    out = mix_factor_blocks(states, [W0, W1], {"w": 1})  # columns: factor 0 is column 0
    assert torch.equal(out[0]["w"], torch.tensor([[0.5, 2.0], [1.5, 4.0]]))


def update(cid: int, mu: list[list[float]], w: float) -> ClientUpdate:
    tensors = {
        "model.w": torch.full((2, 3), w),
        "posterior.mu": torch.tensor(mu),
        "posterior.logvar": torch.zeros(2, 1),
    }
    return ClientUpdate(1, tensors, {"num_examples": 1.0}, client_id=cid)


def test_aggregation_weights_follow_the_posteriors_similarity():
    """Factor 0: clients 0 and 1 alike, client 2 far; factor 1: clients 0 and 2 alike. Each
    factor's row of client 0 weights its look-alike, and its blocks mix accordingly."""
    ups = [update(0, [[0.0], [0.0]], 1.0), update(1, [[0.1], [3.0]], 2.0)]
    ups.append(update(2, [[3.0], [0.1]], 10.0))
    mod = FactorMixing({"w": 0}, factors=2, scale=10.0)
    mod.aggregate(1, ups)
    W0, W1 = mod.weights
    assert W0[0, 1] > 0.4 and W0[0, 2] < 1e-3  # factor 0: client 1 is client 0's neighbour
    assert W1[0, 2] > 0.4 and W1[0, 1] < 1e-3  # factor 1: client 2 is
    mine = mod.broadcast_fields()["personal.0.w"]
    w = torch.tensor([1.0, 2.0, 10.0], dtype=torch.float64)
    assert torch.allclose(mine[0].double(), (W0[0] @ w).expand(3), atol=1e-6)
    assert torch.allclose(mine[1].double(), (W1[0] @ w).expand(3), atol=1e-6)
    # uniform weights (the mechanism off) would give 13/3 to both factors
    assert abs(float(mine[0, 0]) - 13 / 3) > 1 and abs(float(mine[1, 0]) - 13 / 3) > 1
    assert set(mod.broadcast_fields()) == {"personal.0.w", "personal.1.w", "personal.2.w"}
    again = FactorMixing({"w": 0}, factors=2)
    again.load_state_dict(mod.state_dict())
    assert torch.equal(
        again.broadcast_fields()["personal.2.w"], mod.broadcast_fields()["personal.2.w"]
    )
