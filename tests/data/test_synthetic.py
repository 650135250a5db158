"""The synthetic stochastic-block-model graph."""

from __future__ import annotations

import math

import pytest
import torch

from fedlightning.data.graphs import make_synthetic


def intra_class_fraction(g) -> float:
    src, dst = g.edge_index
    return (g.y[src] == g.y[dst]).float().mean().item()


def nearest_centroid_accuracy(x: torch.Tensor, y: torch.Tensor, c: int) -> float:
    centroids = torch.stack([x[y == k].mean(0) for k in range(c)])
    return (torch.cdist(x, centroids).argmin(1) == y).float().mean().item()


def test_shapes_and_defaults():
    g = make_synthetic()
    assert g.name == "synthetic"
    assert g.num_nodes == 600 and g.num_classes == 5
    assert g.modalities == ["text", "image"]
    assert tuple(g.features["text"].shape) == (600, 32)
    assert tuple(g.features["image"].shape) == (600, 16)
    assert all(x.dtype == torch.float32 for x in g.features.values())
    assert g.mask.all()
    assert torch.bincount(g.y).tolist() == [120] * 5  # balanced
    src, dst = g.edge_index
    assert not (src == dst).any()
    pairs = set(map(tuple, g.edge_index.t().tolist()))
    assert pairs == {(b, a) for a, b in pairs}


def test_same_seed_same_graph_different_seed_different():
    a, b, c = make_synthetic(seed=7), make_synthetic(seed=7), make_synthetic(seed=8)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.y, b.y)
    assert all(torch.equal(a.features[m], b.features[m]) for m in a.modalities)
    assert torch.equal(a.mask, b.mask)
    assert not torch.equal(a.y, c.y)
    assert a.edge_index.shape != c.edge_index.shape or not torch.equal(a.edge_index, c.edge_index)
    assert not torch.equal(a.features["text"], c.features["text"])


def test_global_rng_untouched_and_irrelevant():
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a = make_synthetic(seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(123)
    assert torch.equal(make_synthetic(seed=1).edge_index, a.edge_index)


def test_adding_a_modality_keeps_graph_and_other_features():
    a = make_synthetic(modalities={"text": 8}, seed=2)
    b = make_synthetic(modalities={"image": 4, "text": 8}, seed=2)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.y, b.y)
    assert torch.equal(a.features["text"], b.features["text"])


def test_edge_count_matches_sbm_expectation():
    n, c, p_in, p_out = 1000, 4, 0.04, 0.004
    g = make_synthetic(num_nodes=n, num_classes=c, p_in=p_in, p_out=p_out, seed=0)
    within = c * math.comb(n // c, 2)
    expected = within * p_in + (math.comb(n, 2) - within) * p_out
    assert abs(g.num_edges - expected) < 5 * math.sqrt(expected)


def test_homophily_follows_p_in_and_p_out():
    strong = make_synthetic(p_in=0.1, p_out=0.001, seed=0)
    # Expected: 5*C(120,2)*0.1 = 3570 intra vs (C(600,2)-35700)*0.001 = 144 inter -> 0.96.
    assert intra_class_fraction(strong) > 0.9
    flat = make_synthetic(p_in=0.02, p_out=0.02, seed=0)
    # Equal probabilities: the intra fraction is the share of intra pairs, 35700/179700 ~ 0.2.
    assert abs(intra_class_fraction(flat) - 35700 / 179700) < 0.05


def test_features_carry_the_class_signal():
    g = make_synthetic(signal=2.0, noise=1.0, seed=0)
    assert nearest_centroid_accuracy(g.features["text"], g.y, 5) > 0.95
    g0 = make_synthetic(signal=0.0, noise=1.0, seed=0)
    assert nearest_centroid_accuracy(g0.features["text"], g0.y, 5) < 0.45


def test_missing_rate():
    n, r = 4000, 0.3
    g = make_synthetic(num_nodes=n, missing_rate=r, seed=0)
    hidden = (~g.mask).float().mean(0)
    # apply_missing restores one modality where both were hidden (prob r^2, each modality
    # half the time), so each modality ends up hidden for r - r^2/2 of the nodes.
    assert torch.allclose(hidden, torch.full((2,), r - r * r / 2), atol=0.03)
    assert g.mask.any(1).all()
    for j, m in enumerate(g.modalities):
        x = g.features[m]
        assert x[~g.mask[:, j]].abs().sum() == 0
        assert (x[g.mask[:, j]].abs().sum(1) > 0).all()
    g3 = make_synthetic(num_nodes=n, modalities={"a": 4, "b": 4, "c": 4}, missing_rate=r, seed=0)
    hidden3 = (~g3.mask).float().mean(0)
    assert torch.allclose(hidden3, torch.full((3,), r - r**3 / 3), atol=0.03)  # ~0.29
    assert g3.mask.any(1).all()


def test_large_graph_is_fast_enough():
    g = make_synthetic(num_nodes=5000, num_classes=10, p_in=0.01, p_out=0.0005, seed=0)
    assert g.num_nodes == 5000 and g.num_edges > 0


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"num_nodes": 0}, "num_nodes"),
        ({"num_nodes": 2.5}, "num_nodes"),
        ({"num_nodes": True}, "num_nodes"),
        ({"num_classes": 0}, "num_classes"),
        ({"num_nodes": 3, "num_classes": 4}, "num_classes"),
        ({"modalities": {}}, "modalities"),
        ({"modalities": {"text": 0}}, "modalities"),
        ({"modalities": {"": 3}}, "modalities"),
        ({"p_in": 1.5}, "p_in"),
        ({"p_out": -0.1}, "p_out"),
        ({"p_in": float("nan")}, "p_in"),
        ({"signal": -1.0}, "signal"),
        ({"noise": -1.0}, "noise"),
        ({"missing_rate": 1.0}, "missing_rate"),
        ({"missing_rate": -0.1}, "missing_rate"),
        ({"missing_rate": 0.2, "modalities": {"text": 4}}, "missing_rate"),
        ({"seed": -1}, "seed"),
        ({"seed": "0"}, "seed"),
    ],
)
def test_invalid_arguments(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        make_synthetic(**kwargs)
