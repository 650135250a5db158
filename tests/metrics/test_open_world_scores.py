"""TopoOOD's, GRASP's and CLIPN's equations against hand computations, and the sign
calibration of a score whose direction a method does not fix."""

from __future__ import annotations

import math

import pytest
import torch

from fedlightning.methods.clipn.clipn_score import (
    atd_known_score,
    itbo_losses,
    no_probability,
    retrieval_atd,
    tso_loss,
    yes_probability,
)
from fedlightning.methods.grasp.grasp_score import grasp_propagate, grasp_selection
from fedlightning.methods.topoood.topoood_score import dirichlet_energy, mean_propagation
from fedlightning.metrics.open_set import score_sign


def undirected(*pairs):
    src = [a for a, b in pairs] + [b for a, b in pairs]
    dst = [b for a, b in pairs] + [a for a, b in pairs]
    return torch.tensor([src, dst])


# path 0 - 1 - 2, node 3 isolated
PATH = undirected((0, 1), (1, 2))


def test_dirichlet_energy_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [5.0, 5.0]], dtype=torch.float64)
    e = dirichlet_energy(z, PATH)
    # degrees 1, 2, 1, 0: z_i / sqrt(1 + d_i)
    n0, n1, n2 = z[0] / math.sqrt(2), z[1] / math.sqrt(3), z[2] / math.sqrt(2)
    sq = lambda a, b: float(((a - b) ** 2).sum())  # noqa: E731
    assert e[0].item() == pytest.approx(sq(n0, n1))
    assert e[1].item() == pytest.approx((sq(n1, n0) + sq(n1, n2)) / 2)
    assert e[2].item() == pytest.approx(sq(n2, n1))
    assert e[3].item() == 0.0  # isolated


def test_mean_propagation_by_hand():
    s = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    one = mean_propagation(s, PATH, steps=1, alpha=0.5)
    assert one.tolist() == pytest.approx(
        [0.5 * 1 + 0.5 * 2, 0.5 * 2 + 0.5 * 2.5, 0.5 * 4 + 0.5 * 2, 4.0]
    )
    two = mean_propagation(s, PATH, steps=2, alpha=0.5)
    assert two.tolist() == pytest.approx(mean_propagation(one, PATH, 1, 0.5).tolist())
    assert torch.equal(mean_propagation(s, PATH, steps=0, alpha=0.5), s)


def test_grasp_selection_by_hand():
    # train nodes 0, 1, 2; candidates 3..8; 3, 4 high scores, 7, 8 low
    # 0 ~ {3, 4}, 1 ~ {3, 7}, 2 ~ {8}
    edges = undirected((0, 3), (0, 4), (1, 3), (1, 7), (2, 8))
    scores = torch.tensor([0.5, 0.5, 0.5, 0.99, 0.98, 0.6, 0.5, 0.02, 0.01])
    train = torch.zeros(9, dtype=torch.bool)
    train[:3] = True
    cand = ~train
    # tau1 = 1/3 of 6 candidates -> 2 ID {3, 4}, 2 OOD {7, 8}; ratios 0: 2/1, 1: 1/2, 2: 0/2
    g = grasp_selection(scores, edges, cand, train, tau1=1 / 3, tau2=0.5)
    assert g.tolist() == [0, 1]  # ceil(0.5 * 3) = 2 training nodes, highest ratios
    g1 = grasp_selection(scores, edges, cand, train, tau1=1 / 3, tau2=0.2)
    assert g1.tolist() == [0]


def test_grasp_propagation_by_hand():
    # path 0 - 1 - 2 - 3, G = {0, 3}: d = [1 + 2, 2, 2, 1 + 2]
    edges = undirected((0, 1), (1, 2), (2, 3))
    s = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    g = torch.tensor([0, 3])
    delta = 1.5
    out = grasp_propagate(s, edges, g, steps=1, delta=delta)
    gsum = 1.0 + 4.0
    assert out.tolist() == pytest.approx(
        [(2 + delta * gsum) / 3, (1 + 3) / 2, (2 + 4) / 2, (3 + delta * gsum) / 3]
    )
    two = grasp_propagate(s, edges, g, steps=2, delta=delta)
    assert two.tolist() == pytest.approx(grasp_propagate(out, edges, g, 1, delta).tolist())


def test_grasp_raises_the_scores_of_the_selected_nodes_neighbours():
    """The documented direction: with positive scores, fully connecting G raises the
    scores of G's neighbours (from the second step on) against the same propagation
    without G; a node far from G in the same number of steps is unchanged."""
    edges = undirected((0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6))
    s = torch.tensor([0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.6], dtype=torch.float64)
    g = torch.tensor([0])
    steps = 2
    with_g = grasp_propagate(s, edges, g, steps=steps, delta=1.02)
    without = grasp_propagate(s, edges, torch.zeros(0, dtype=torch.long), steps=steps)
    assert with_g[1] > without[1]  # G's neighbour
    assert with_g[0] > without[0]  # G itself
    assert with_g[5] == without[5]  # three hops away: not reached in two steps


def test_clipn_yes_probability_by_hand():
    f = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    t = torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    t_no = torch.tensor([[-1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    s = 3.0
    p = yes_probability(f, t, t_no, s)
    # cos(f, t0) = 1/sqrt2, cos(f, t0_no) = -1; cos(f, t1) = 0, cos(f, t1_no) = 1
    e = math.exp
    p0 = e(s / math.sqrt(2)) / (e(s / math.sqrt(2)) + e(-s))
    p1 = e(0) / (e(0) + e(s))
    assert p[0].tolist() == pytest.approx([p0, p1])
    assert no_probability(f, t, t_no, s)[0].tolist() == pytest.approx([1 - p0, 1 - p1])
    y = torch.tensor([0])
    l_yes, l_no = itbo_losses(f, t, t_no, y, s)
    assert l_yes.item() == pytest.approx(-math.log(p0))
    assert l_no.item() == pytest.approx(-math.log(1 - p1))


def test_clipn_tso_and_atd_by_hand():
    t = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    t_no = torch.tensor([[-1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    # distances of the unit vectors: 2 and sqrt(2)
    assert tso_loss(t, t_no).item() == pytest.approx(((2 - 2) + (2 - math.sqrt(2))) / 2)
    p_yes = torch.tensor([[0.9, 0.2]], dtype=torch.float64)
    logits = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    pc = math.e / (math.e + 1)
    assert atd_known_score(p_yes, logits).item() == pytest.approx(0.9 * pc + 0.2 * (1 - pc))


def test_score_sign_flips_a_score_that_ranks_unknowns_higher():
    known, unknown = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.8, 0.9])
    assert score_sign(known, unknown) == -1.0
    assert score_sign(-known, -unknown) == 1.0
    assert score_sign(known, unknown[:0]) == 1.0  # no unknowns: left as it is


def test_retrieval_atd_by_hand():
    """q = e1, items e1 and e2, their "no" embeddings e2 and e1 (s = T = 1): cos to the
    items [1, 0], to the "no" ones [0, 1], so p_yes = [sig(1), sig(-1)]; the softmax of
    [1, 0] is also [sig(1), sig(-1)], and ATD = sig(1)^2 + sig(-1)^2."""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    q = torch.tensor([[2.0, 0.0]], dtype=torch.float64)  # not unit: cosines normalise
    items = torch.eye(2, dtype=torch.float64)
    s = retrieval_atd(q, items, items.flip(0), scale=1.0, temperature=1.0)
    assert s.item() == pytest.approx(sig(1) ** 2 + sig(-1) ** 2)
    # temperature 0.5: the softmax of [2, 0]
    s = retrieval_atd(q, items, items.flip(0), scale=1.0, temperature=0.5)
    assert s.item() == pytest.approx(sig(1) * sig(2) + sig(-1) * sig(-2))


def test_split_scores_compares_each_node_with_its_own_splits_items():
    """Nodes 0, 1 train, 2 val, 3, 4 test, 5 in no split; the items (known, paired) are 0,
    2 and 3: nodes 0, 1 meet item 0 only, node 2 item 2, nodes 3, 4 item 3; node 5 scores 0."""
    from fedlightning.federation.retrieval_stages import split_scores

    def mask(*ids):
        m = torch.zeros(6, dtype=torch.bool)
        m[list(ids)] = True
        return m

    data = {"train_mask": mask(0, 1), "val_mask": mask(2), "test_mask": mask(3, 4)}
    q = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]])
    k = torch.tensor([[10.0], [20.0], [30.0], [40.0], [50.0], [60.0]])
    dot = lambda a, b: (a @ b.T).amax(dim=1)  # noqa: E731
    s = split_scores(dot, q, k, mask(0, 2, 3), data)
    assert s.tolist() == [10.0, 20.0, 90.0, 160.0, 200.0, 0.0]
