"""Accuracy matrix, AM, FM, fm_diag and the seen-task curve against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fedlightning.metrics import (
    AccuracyMatrix,
    average_accuracy,
    forgetting,
    forgetting_diag,
    seen_accuracy_curve,
)

NAN = math.nan

# Three stages; row t = after stage t. Task 0 peaks after stage 1 (0.9), not on the
# diagonal (0.6), so FM and fm_diag differ:
#   AM      = (0.5 + 0.7 + 0.6) / 3                         = 0.6
#   FM      = ((max(0.6, 0.9) - 0.5) + (0.8 - 0.7)) / 2      = (0.4 + 0.1) / 2 = 0.25
#   fm_diag = ((0.6 - 0.5) + (0.8 - 0.7)) / 2               = 0.1
#   seen    = [0.6, (0.9 + 0.8) / 2, 0.6]                   = [0.6, 0.85, 0.6]
M3 = torch.tensor(
    [
        [0.6, NAN, NAN],
        [0.9, 0.8, NAN],
        [0.5, 0.7, 0.6],
    ],
    dtype=torch.float64,
)


def test_hand_matrix():
    assert average_accuracy(M3) == pytest.approx(0.6)
    assert forgetting(M3) == pytest.approx(0.25)
    assert forgetting_diag(M3) == pytest.approx(0.1)
    assert seen_accuracy_curve(M3) == pytest.approx([0.6, 0.85, 0.6])


def test_single_stage_and_lists():
    M = [[0.7]]
    assert forgetting(M) == 0.0
    assert forgetting_diag(M) == 0.0
    assert average_accuracy(M) == pytest.approx(0.7)
    assert seen_accuracy_curve(M) == pytest.approx([0.7])


def test_forgetting_is_signed():
    # Task 0 ends above its best earlier value: backward transfer gives a negative term.
    # FM = 0.5 - 0.8 = -0.3
    M = torch.tensor([[0.5, NAN], [0.8, 0.9]])
    assert forgetting(M) == pytest.approx(-0.3)


def test_nan_entries_skipped():
    # Task 1 was never measured after stage 1 (no test node): it leaves every mean.
    # AM = (0.4 + 0.6) / 2 = 0.5 over tasks 0 and 2; FM over task 0 only = 0.9 - 0.4.
    M = torch.tensor([[0.9, NAN, NAN], [0.8, NAN, NAN], [0.4, NAN, 0.6]])
    assert average_accuracy(M) == pytest.approx(0.5)
    assert forgetting(M) == pytest.approx(0.5)
    assert forgetting_diag(M) == pytest.approx(0.5)
    # seen: row 0 -> 0.9, row 1 -> 0.8 (task 1 skipped), row 2 -> (0.4 + 0.6) / 2
    assert seen_accuracy_curve(M) == pytest.approx([0.9, 0.8, 0.5])
    assert math.isnan(seen_accuracy_curve([[NAN, NAN], [0.5, NAN]])[0])


def test_rejects_non_square():
    with pytest.raises(ValueError):
        average_accuracy(torch.zeros(2, 3))


def test_accuracy_matrix_pooled_over_clients():
    m = AccuracyMatrix(num_stages=3)
    # After stage 0: client A has 3 task-0 nodes (2 right) and one stage-1 node, which is
    # not seen yet and is ignored. Cell (0, 0) = 2/3.
    m.update(0, torch.tensor([0, 0, 0, 1]), torch.tensor([True, True, False, True]))
    # After stage 1, client A: task 0 -> 1/2, task 1 -> 2/3; its stage-2 node is ignored.
    m.update(
        1,
        torch.tensor([0, 0, 1, 1, 1, 2]),
        torch.tensor([True, False, True, True, False, True]),
    )
    # After stage 1, client B: task 0 -> 1/1, task 1 -> 0/1.
    m.update(1, torch.tensor([0, 1]), torch.tensor([True, False]))
    # Pooled (node-weighted): cell (1, 0) = (1 + 1) / (2 + 1) = 2/3,
    #                         cell (1, 1) = (2 + 0) / (3 + 1) = 1/2.
    # A plain mean of client accuracies would give 3/4 and 1/3 instead.
    out = m.compute()
    assert out.dtype == torch.float64 and out.shape == (3, 3)
    assert out[0, 0].item() == pytest.approx(2 / 3)
    assert out[1, 0].item() == pytest.approx(2 / 3)
    assert out[1, 1].item() == pytest.approx(1 / 2)
    # Unmeasured cells (j > t, and the whole row 2) are NaN.
    nan = torch.isnan(out)
    assert nan[0, 1] and nan[0, 2] and nan[1, 2] and nan[2].all()
    assert m.total.tolist() == [[3, 0, 0], [3, 4, 0], [0, 0, 0]]


def test_accuracy_matrix_states_sum_like_ddp():
    # Two processes each see one client; summing their states (what DDP's sum reduction
    # does) must equal one process seeing both.
    a, b, both = AccuracyMatrix(2), AccuracyMatrix(2), AccuracyMatrix(2)
    xa = (torch.tensor([0, 1, 1]), torch.tensor([True, True, False]))
    xb = (torch.tensor([0, 0]), torch.tensor([False, True]))
    a.update(1, *xa)
    b.update(1, *xb)
    both.update(1, *xa)
    both.update(1, *xb)
    a.merge_state(b)
    torch.testing.assert_close(a.compute(), both.compute(), equal_nan=True)
    # cell (1, 0) = (1 + 1) / (1 + 2) = 2/3; cell (1, 1) = 1/2
    assert both.compute()[1].tolist()[:2] == pytest.approx([2 / 3, 1 / 2])


def test_accuracy_matrix_end_to_end_forgetting():
    # Feed M3 as counts of 10 nodes per task, then read FM back.
    m = AccuracyMatrix(3)
    for t in range(3):
        for j in range(t + 1):
            k = round(M3[t, j].item() * 10)
            m.update(t, torch.full((10,), j), torch.arange(10) < k)
    torch.testing.assert_close(m.compute(), M3, equal_nan=True)
    assert forgetting(m.compute()) == pytest.approx(0.25)


def test_accuracy_matrix_validates():
    m = AccuracyMatrix(2)
    with pytest.raises(ValueError):
        m.update(2, torch.tensor([0]), torch.tensor([True]))
    with pytest.raises(ValueError):
        m.update(0, torch.tensor([-1]), torch.tensor([True]))
    with pytest.raises(ValueError):
        m.update(0, torch.tensor([0, 0]), torch.tensor([True]))
    with pytest.raises(ValueError):
        AccuracyMatrix(0)
