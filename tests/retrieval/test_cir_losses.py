"""Symmetric InfoNCE and similarity distillation against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fedlightning.clients.continual_retrieval import similarity_distillation_kl
from fedlightning.objectives import symmetric_info_nce

EYE = torch.eye(2)


def test_info_nce_identity_pairs_by_hand():
    # S = I: each row's CE is -log(e / (e + 1)) = log(1 + e^-1), in both directions.
    assert symmetric_info_nce(EYE, EYE, 1.0).item() == pytest.approx(math.log(1 + math.exp(-1)))
    # T = 0.5 doubles the logits: log(1 + e^-2) = 0.126928...
    assert symmetric_info_nce(EYE, EYE, 0.5).item() == pytest.approx(0.1269280110429725)


def test_info_nce_is_the_mean_of_both_directions_by_hand():
    # q = I, k = [[1,0],[1,0]]: S = q k^T = [[1,1],[0,0]].
    #   q -> k rows: target 0 of [1,1] -> log 2; target 1 of [0,0] -> log 2.
    #   k -> q rows (S^T = [[1,0],[1,0]]): target 0 -> log(1+e^-1); target 1 -> log(1+e).
    k = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    q_to_k = math.log(2)
    k_to_q = 0.5 * (math.log(1 + math.exp(-1)) + math.log(1 + math.e))
    expected = 0.5 * (q_to_k + k_to_q)
    assert expected == pytest.approx(0.7532045)
    assert symmetric_info_nce(EYE, k, 1.0).item() == pytest.approx(expected)


def test_info_nce_edge_cases_keep_the_graph():
    q = torch.randn(1, 4, requires_grad=True)
    assert symmetric_info_nce(q, q.detach(), 0.1).item() == 0.0  # one pair: nothing to contrast
    empty = torch.zeros(0, 4, requires_grad=True)
    loss = symmetric_info_nce(empty, empty, 0.1)
    loss.backward()
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="pair row by row"):
        symmetric_info_nce(torch.zeros(2, 3), torch.zeros(3, 3))


def test_similarity_kl_zero_when_teacher_equals_student():
    s = torch.randn(5, 5)
    assert similarity_distillation_kl(s, s.clone(), 2.0).item() == pytest.approx(0.0, abs=1e-7)
    # a constant shift per row does not change the row softmax
    assert similarity_distillation_kl(s + 3.0, s, 2.0).item() == pytest.approx(0.0, abs=1e-6)


def test_similarity_kl_by_hand():
    teacher = torch.tensor([[1.0, 0.0]])
    student = torch.zeros(1, 2)
    # tau = 1: p = softmax([1, 0]) = [e, 1] / (1 + e), q = [1/2, 1/2]
    p = [math.e / (1 + math.e), 1 / (1 + math.e)]
    kl1 = sum(pi * math.log(pi / 0.5) for pi in p)
    assert kl1 == pytest.approx(0.1109441, abs=1e-6)
    assert similarity_distillation_kl(student, teacher, 1.0).item() == pytest.approx(kl1)
    # tau = 2: p = softmax([0.5, 0]), times tau^2 = 4
    e = math.exp(0.5)
    p2 = [e / (1 + e), 1 / (1 + e)]
    kl2 = 4 * sum(pi * math.log(pi / 0.5) for pi in p2)
    assert kl2 == pytest.approx(0.1211994, abs=1e-6)
    assert similarity_distillation_kl(student, teacher, 2.0).item() == pytest.approx(kl2)
    assert similarity_distillation_kl(torch.randn(3, 4), torch.randn(3, 4), 2.0).item() > 0
