"""AUROC on raw scores of any magnitude: the scores are mapped monotonically into [0, 1]
(dense ranks) before torchmetrics, whose sigmoid would otherwise squash them into ties."""

from __future__ import annotations

import math

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from fedlightning.metrics.open_set import auroc_known_vs_unknown, unit_scores
from fedlightning.metrics.temporal import auroc, link_auroc


def pairwise_auroc(scores: list[float], target: list[int]) -> float:
    """By hand: P(s+ > s-) + P(s+ = s-) / 2 over every (positive, negative) pair."""
    pos = [s for s, y in zip(scores, target, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, target, strict=True) if y == 0]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_issue_example_large_scores_give_one_not_a_half():
    scores, target = torch.tensor([20.0, 21.0, 19.0, 22.0]), torch.tensor([0, 1, 0, 1])
    # the mechanism this guards against: torchmetrics' sigmoid on float32 scores > ~17
    assert float(binary_auroc(scores.float(), target)) == 0.5
    assert auroc(scores, target) == 1.0
    assert auroc(-scores, target) == 0.0


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e3, 1e6])
@pytest.mark.parametrize("seed", [0, 1])
def test_auroc_matches_a_reference_at_any_magnitude(scale, seed):
    g = torch.Generator().manual_seed(seed)
    target = (torch.rand(300, generator=g) < 0.4).long()
    # overlapping classes, with ties (rounded), shifted far from [0, 1]
    raw = (torch.randn(300, generator=g, dtype=torch.float64) + 0.8 * target).mul(4).round() / 4
    scores = raw * scale + 50.0 * scale
    ref = pairwise_auroc(scores.tolist(), target.tolist())
    try:  # a second, independent reference where installed
        from sklearn.metrics import roc_auc_score

        assert float(roc_auc_score(target.numpy(), scores.numpy())) == pytest.approx(ref)
    except ImportError:  # pragma: no cover
        pass
    assert 0.55 < ref < 0.95  # a non-trivial case: neither chance nor perfect
    # torchmetrics accumulates the curve in float32: agreement to float32 precision
    assert auroc(scores, target) == pytest.approx(ref, abs=1e-6)
    known, unknown = scores[target == 1], scores[target == 0]
    assert auroc_known_vs_unknown(known, unknown) == pytest.approx(ref, abs=1e-6)


def test_unit_scores_keep_order_and_ties_inside_the_unit_interval():
    x = torch.tensor([1e9, -3.0, 1e9, 7.0, -1e9])
    u = unit_scores(x)
    assert u.tolist() == [1.0, 1 / 3, 1.0, 2 / 3, 0.0]
    assert unit_scores(torch.tensor([5.0, 5.0])).tolist() == [0.0, 0.0]


def test_cosine_scores_give_the_former_auc_unless_the_sigmoid_merged_them():
    """Scores in [-1, 1] (today's cosines): where torchmetrics' float32 sigmoid kept every
    score distinct the value is bitwise the former one; where it merged two distinct
    scores into a tie the former value was off by that tie, and the new one is exact."""
    g = torch.Generator().manual_seed(3)
    h_pos, h_i, h_neg, h_j = (torch.randn(200, 16, generator=g) for _ in range(4))
    h_i = h_i + 0.5 * h_pos
    got = link_auroc(h_pos, h_i, h_neg, h_j)
    pos = torch.nn.functional.cosine_similarity(h_pos, h_i, dim=-1)
    neg = torch.nn.functional.cosine_similarity(h_neg, h_j, dim=-1)
    scores, target = torch.cat([pos, neg]), torch.cat([torch.ones(200), torch.zeros(200)]).long()
    assert len(scores.unique()) == len(scores.sigmoid().unique())  # no tie made by the sigmoid
    assert got == float(binary_auroc(scores, target))  # bitwise the former value
    assert got == pytest.approx(pairwise_auroc(scores.tolist(), target.tolist()), abs=1e-6)
    assert math.isnan(auroc(scores[:3], torch.ones(3)))

    # two distinct cosines 1e-8 apart: one sigmoid value in float32, so formerly a tie
    close = torch.tensor([1e-8, 0.0, -0.5, 0.5])
    labels = torch.tensor([1, 0, 0, 1])
    assert close.sigmoid()[0] == close.sigmoid()[1]
    assert float(binary_auroc(close, labels)) == 0.875  # (3 + 0.5) / 4 pairs: the tie
    assert auroc(close, labels) == 1.0  # every positive above every negative


def test_nan_scores_give_nan_not_a_perfect_auc():
    """NaN compares unequal to itself: ranked as distinct values, NaN scores in the
    positives' order would read as a perfect separation."""
    scores = torch.tensor([math.nan, math.nan, math.nan, math.nan])
    assert math.isnan(auroc(scores, torch.tensor([1, 1, 0, 0])))
    assert math.isnan(auroc(torch.tensor([0.3, math.nan, 0.1, 0.2]), torch.tensor([1, 1, 0, 0])))
