"""Open-set scores, thresholds, FPR95 and AUROC, against hand values and independent refs."""

from __future__ import annotations

import math

import pytest
import torch
from sklearn.metrics import roc_auc_score

from fedlightning.metrics import (
    auroc_known_vs_unknown,
    energy_score,
    fpr_at_threshold,
    fpr_at_tpr,
    msp_score,
    open_accuracy,
    threshold_at_tpr,
)

LN3 = math.log(3.0)


def test_msp_excludes_unknown_logits():
    # Known classes 0, 1 with logits 0 and ln 3: softmax = [1/4, 3/4], so rho = 0.75.
    # The huge logit of unknown class 2 must not enter the softmax.
    logits = torch.tensor([[0.0, LN3, 100.0], [LN3, 0.0, -5.0]], dtype=torch.float64)
    known = torch.tensor([True, True, False])
    assert msp_score(logits, known).tolist() == pytest.approx([0.75, 0.75])


def test_energy_score():
    logits = torch.tensor([[0.0, LN3, 100.0]], dtype=torch.float64)
    known = torch.tensor([True, True, False])
    # T = 1: log(e^0 + e^ln3) = ln 4
    assert energy_score(logits, known).item() == pytest.approx(math.log(4.0))
    # T = 2: 2 * log(e^0 + e^(ln3 / 2)) = 2 * log(1 + sqrt 3)
    assert energy_score(logits, known, temperature=2.0).item() == pytest.approx(
        2 * math.log(1 + math.sqrt(3))
    )


def test_threshold_at_tpr_hand():
    s = torch.arange(1, 21, dtype=torch.float64)  # 1..20
    # ceil(0.95 * 20) = 19 scores must pass: the 19th largest is 2 (accepts 19/20).
    assert threshold_at_tpr(s, 0.95) == 2.0
    assert threshold_at_tpr(s, 1.0) == 1.0
    # ceil(0.5 * 20) = 10 -> 10th largest = 11
    assert threshold_at_tpr(s, 0.5) == 11.0
    # Ties: [5, 5, 5, 1], tpr 0.5 needs 2 -> 5 (accepts 3/4); tpr 0.8 needs ceil(3.2) = 4 -> 1.
    t = torch.tensor([5.0, 1.0, 5.0, 5.0])
    assert threshold_at_tpr(t, 0.5) == 5.0
    assert threshold_at_tpr(t, 0.8) == 1.0
    # 0.55 * 100 is 55.00000000000001 in floats; the definition needs 55 accepted, not 56:
    # the 55th largest of 1..100 is 46.
    assert threshold_at_tpr(torch.arange(1, 101), 0.55) == 46.0
    with pytest.raises(ValueError):
        threshold_at_tpr(torch.tensor([]), 0.95)
    with pytest.raises(ValueError):
        threshold_at_tpr(s, 0.0)


def test_fpr_hand():
    known = torch.arange(1, 21, dtype=torch.float64)  # threshold at 95% TPR = 2
    unknown = torch.tensor([0.0, 1.0, 2.0, 3.0])  # 2 and 3 accepted (>= 2) -> 2/4
    assert fpr_at_threshold(unknown, 2.0) == 0.5
    assert fpr_at_tpr(known, unknown) == 0.5
    assert math.isnan(fpr_at_threshold(torch.tensor([]), 0.0))
    assert math.isnan(fpr_at_tpr(known, torch.tensor([])))
    assert math.isnan(fpr_at_tpr(torch.tensor([]), unknown))


def _brute_fpr(known: list[float], unknown: list[float], tpr: float) -> float:
    """The definition read literally: the largest candidate threshold accepting >= tpr."""
    n = len(known)
    ok = [d for d in set(known) if sum(s >= d for s in known) >= tpr * n - 1e-9]
    delta = max(ok)
    return sum(u >= delta for u in unknown) / len(unknown)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("tpr", [0.95, 0.9, 0.5, 1.0])
def test_fpr_matches_brute_force_with_ties(seed, tpr):
    g = torch.Generator().manual_seed(seed)
    n, m = (
        int(torch.randint(1, 60, (1,), generator=g)),
        int(torch.randint(1, 60, (1,), generator=g)),
    )
    # Integer-rounded scores make many ties, on both sides and across them.
    known = (torch.randn(n, generator=g) * 3 + 2).round()
    unknown = (torch.randn(m, generator=g) * 3).round()
    ref = _brute_fpr(known.tolist(), unknown.tolist(), tpr)
    assert fpr_at_tpr(known, unknown, tpr) == pytest.approx(ref)


@pytest.mark.parametrize("seed", range(8))
def test_auroc_matches_sklearn_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    known = (torch.randn(37, generator=g) * 2 + 1).round()
    unknown = (torch.randn(23, generator=g) * 2).round()
    y = [1] * 37 + [0] * 23
    ref = roc_auc_score(y, known.tolist() + unknown.tolist())
    assert auroc_known_vs_unknown(known, unknown) == pytest.approx(ref, abs=1e-6)


def test_auroc_large_scores_not_saturated():
    # Energy-like scores far outside [0, 1]: a sigmoid in float32 would map them all to 1.0
    # and report 0.5. Perfect separation must give 1.0.
    known = torch.tensor([40.0, 50.0, 60.0])
    unknown = torch.tensor([20.0, 30.0])
    assert auroc_known_vs_unknown(known, unknown) == pytest.approx(1.0)
    assert auroc_known_vs_unknown(-known, -unknown) == pytest.approx(0.0)
    assert math.isnan(auroc_known_vs_unknown(known, torch.tensor([])))


def test_open_accuracy():
    # node 0 known y=2 (right), node 1 known y=2 (wrong), node 2 unknown y=1 (rejected:
    # right), node 3 known rejected (wrong), node 4 unknown accepted as 0 (wrong) -> 2/5.
    pred = torch.tensor([2, 0, -1, -1, 0])
    y = torch.tensor([2, 2, 1, 0, 1])
    is_known = torch.tensor([True, True, False, True, False])
    assert open_accuracy(pred, y, is_known) == pytest.approx(2 / 5)
    assert math.isnan(open_accuracy(pred[:0], y[:0], is_known[:0]))
