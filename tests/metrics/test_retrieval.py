"""Recall@k with pessimistic ties, and the max-similarity rejection score."""

from __future__ import annotations

import math

import pytest
import torch

from fedlightning.metrics import max_similarity, recall_at_k

# Pairs (q_i, v_i). Cosine similarities (rows = queries, cols = items):
#   q0=[1,0]: v0=[1,1] 0.707, v1=[0,3] 0,     v2=[2,2] 0.707 -> v0 ties with v2: rank 1
#   q1=[0,1]: v0 0.707,       v1 1,           v2 0.707       -> rank 0
#   q2=[1,1]: v0 1,           v1 0.707,       v2 1           -> v2 ties with v0: rank 1
# [1,1]/sqrt(2) and [2,2]/sqrt(8) normalise to bit-identical vectors, so the ties are exact.
Q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
V = torch.tensor([[1.0, 1.0], [0.0, 3.0], [2.0, 2.0]], dtype=torch.float64)


def test_recall_hand_case_with_tie():
    assert recall_at_k(Q, V, k=1).tolist() == [False, True, False]
    assert recall_at_k(Q, V, k=2).tolist() == [True, True, True]
    assert recall_at_k(Q.float(), V.float(), k=1).tolist() == [False, True, False]


def test_constant_embeddings_score_zero():
    # Every item ties with the paired one: pessimistic ranking gives rank n-1.
    q = torch.ones(4, 3)
    assert recall_at_k(q, q, k=1).sum().item() == 0
    assert recall_at_k(q, q, k=4).all()


def test_identity_pairs_perfect():
    x = torch.eye(5)
    assert recall_at_k(x, 3 * x, k=1).all()


def test_max_similarity():
    s = max_similarity(Q, V)
    assert s.tolist() == pytest.approx([1 / math.sqrt(2), 1.0, 1.0])
    # Fewer items than queries is allowed for the rejection score.
    assert max_similarity(Q, V[1:2]).tolist() == pytest.approx([0.0, 1.0, 1 / math.sqrt(2)])


def test_validation():
    with pytest.raises(ValueError):
        recall_at_k(Q, V, k=0)
    with pytest.raises(ValueError):
        recall_at_k(Q, V[:2])
    with pytest.raises(ValueError):
        max_similarity(Q, V[:0])
