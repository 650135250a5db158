"""FedTIP's server equations against hand computations (paper 001, Eqs. 6, 7, 22-24, 27-31)."""

import pytest
import torch

from fedlightning.server.privacy import release_sensitivity
from fedlightning.server.reliability import (
    ClientSummary,
    aggregate,
    anchor_update,
    client_statistics,
    clip_embeddings,
    label_coverage,
    median_norm,
    pairwise_masks,
    private_prototype,
    prompt_update,
    reliability,
)


def test_label_coverage_eq27():
    assert label_coverage({0: 3, 1: 3}, [0, 1]) == 1.0  # balanced
    assert label_coverage({0: 3, 1: 1}, [0, 1]) == pytest.approx(0.75)  # p = (.75, .25)
    assert label_coverage({0: 2}, [0, 1]) == pytest.approx(0.5)  # one label of two
    assert label_coverage({0: 2}, [0, 1, 2]) == pytest.approx(1 / 3)  # 1 - (2/3 + 1/3 + 1/3)/2
    with pytest.raises(ValueError):
        label_coverage({}, [0, 1])


def test_median_norm_and_reliability_eqs28_29():
    deltas = [torch.tensor([1.0, 0.0]), torch.tensor([3.0, 4.0]), torch.tensor([0.0, 2.0])]
    assert median_norm(deltas) == pytest.approx(2.0)  # norms 1, 5, 2
    assert median_norm([*deltas, torch.tensor([0.0, 3.0])]) == pytest.approx(2.5)  # 1, 2, 3, 5
    assert reliability(0.5, norm=4.0, gamma=2.0) == pytest.approx(0.25)  # clipped: 2 / 4
    assert reliability(0.5, norm=1.0, gamma=2.0) == pytest.approx(0.5)  # below the median


def test_zero_updates_keep_their_coverage_weight_eq29():
    """lr=0: every update is zero, gamma = 0; Eq. (29) read literally gives r_k = 0 for all
    and Eq. (30) 0/0 (NaN adapter and anchors). A zero update is not outsized: r_k = b_k."""
    assert reliability(0.75, norm=0.0, gamma=0.0) == 0.75
    zero = [msg([0.0, 0.0], {0: [1.0, 0.0], 1: [0.0, 2.0]}, {0: 3, 1: 1}, 0.75) for _ in range(3)]
    omega = torch.tensor([1.0, -2.0])
    new, anchors, r = aggregate(omega, {}, zero, eta_s=1.0, beta=0.1)
    assert r == [0.75, 0.75, 0.75]
    assert torch.equal(new, omega)  # no update: the adapter stays
    assert torch.allclose(anchors[0], torch.tensor([1.0, 0.0]))  # norm of the mean prototype
    assert torch.allclose(anchors[1], torch.tensor([0.0, 1.0]))
    # gamma = 0 with one non-zero client: the zero clients carry the round, no NaN
    mixed = [*zero[:2], msg([3.0, 4.0], {0: [1.0, 0.0]}, {0: 4}, 0.5)]
    new, _, r = aggregate(omega, {}, mixed)
    assert r == [0.75, 0.75, 0.0] and torch.equal(new, omega)


def msg(delta, protos, counts, coverage):
    d = torch.tensor(delta)
    return ClientSummary(
        d, {c: torch.tensor(q) for c, q in protos.items()}, counts, coverage, float(d.norm())
    )


def test_round_update_and_anchors_by_hand_eqs23_24_31():
    a = msg([2.0, 0.0], {0: [1.0, 0.0], 1: [0.0, 1.0]}, {0: 2, 1: 2}, 1.0)  # n 4, norm 2
    b = msg([0.0, 6.0], {0: [0.0, 1.0]}, {0: 2}, 0.5)  # n 2, norm 6, one label
    omega = torch.tensor([1.0, 1.0])
    anchors = {0: torch.tensor([1.0, 0.0])}
    new, new_anchors, r = aggregate(omega, anchors, [a, b], eta_s=0.5, beta=0.1)
    # gamma = median(2, 6) = 4; r_a = 1 * min(1, 4/2) = 1; r_b = 0.5 * 4/6 = 1/3
    assert r == pytest.approx([1.0, 1 / 3])
    w = torch.tensor([4 * 1.0, 2 / 3]) / (4 + 2 / 3)
    expected = omega + 0.5 * (w[0] * a.delta + w[1] * b.delta)
    assert torch.allclose(new, expected)
    # class 0: q_hat = (2*1*[1,0] + 2*(1/3)*[0,1]) / (2 + 2/3); anchor 0.9*[1,0] + 0.1*q_hat
    q_hat = (2 * torch.tensor([1.0, 0.0]) + 2 / 3 * torch.tensor([0.0, 1.0])) / (8 / 3)
    mixed = 0.9 * torch.tensor([1.0, 0.0]) + 0.1 * q_hat
    assert torch.allclose(new_anchors[0], mixed / mixed.norm(), atol=1e-6)
    # class 1 had no anchor: the first aggregate initialises it, normalised
    assert torch.allclose(new_anchors[1], torch.tensor([0.0, 1.0]), atol=1e-6)
    # support-weighted FedAvg (the ablation): w = n / sum n
    fed, _, r1 = aggregate(omega, anchors, [a, b], eta_s=1.0, reliability_weights=False)
    assert r1 == [1.0, 1.0]
    assert torch.allclose(fed, omega + (4 * a.delta + 2 * b.delta) / 6)


def test_masked_shares_sum_to_the_same_update_eq6():
    torch.manual_seed(0)
    msgs = [
        msg(torch.randn(5).tolist(), {0: torch.randn(3).tolist()}, {0: k + 1, 1: 1}, 0.8)
        for k in range(4)
    ]
    r = [0.9, 0.5, 1.0, 0.3]
    shares = [client_statistics(m, rk) for m, rk in zip(msgs, r, strict=True)]
    plain = shares[0]
    for s in shares[1:]:
        plain = plain + s
    masks = pairwise_masks(4, (5,), seed=7)
    masked = [s.s_omega + mk for s, mk in zip(shares, masks, strict=True)]
    assert not torch.allclose(masked[0], shares[0].s_omega)  # a share alone reveals nothing
    assert torch.allclose(sum(masked), plain.s_omega, atol=1e-12)
    omega = torch.zeros(5)
    by_sum = prompt_update(omega, plain, 1.0)
    nr = torch.tensor([m.size * rk for m, rk in zip(msgs, r, strict=True)], dtype=torch.float64)
    w = nr / nr.sum()  # Eq. (30)
    direct = sum(wk * m.delta.double() for wk, m in zip(w, msgs, strict=True))
    assert torch.allclose(by_sum.double(), direct, atol=1e-6)


def test_clipped_gaussian_prototype_eqs4_7():
    h = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    assert torch.allclose(clip_embeddings(h, 1.0), torch.tensor([[0.6, 0.8], [0.3, 0.4]]))
    q = private_prototype(h, 1.0, sigma=0.0)
    assert torch.allclose(q, torch.tensor([0.45, 0.6]))
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([private_prototype(h, 1.0, 2.0, g) for _ in range(4000)])
    # Delta_2 = 2 C / n = 1, so the noise std is sigma = 2 per coordinate
    assert draws.std(0).tolist() == pytest.approx([2.0, 2.0], rel=0.05)


def test_anchor_update_leaves_silent_classes():
    anchors = {3: torch.tensor([0.0, 1.0])}
    stats = client_statistics(msg([0.0, 0.0], {0: [2.0, 0.0]}, {0: 1}, 1.0), 1.0)
    out = anchor_update(anchors, stats, beta=0.5)
    assert torch.equal(out[3], anchors[3]) and torch.allclose(out[0], torch.tensor([1.0, 0.0]))


def test_a_single_class_client_keeps_a_weight_and_a_balanced_one_gets_more_sec44():
    """Sec. 4.4: with equal support and equal update norms, a single-class client keeps a
    non-zero weight (b = 1/2, Eq. 27) and the balanced client gets twice its influence on
    the prompt update (weights n r / sum n r = 1/3 and 2/3, Eqs. 29-30)."""
    single = msg([3.0, 0.0], {0: [1.0, 0.0]}, {0: 4}, label_coverage({0: 4}, (0, 1)))
    balanced = msg([0.0, 3.0], {0: [1.0, 0.0], 1: [0.0, 1.0]}, {0: 2, 1: 2}, 1.0)
    assert single.coverage == 0.5 and balanced.coverage == 1.0
    omega = torch.zeros(2)
    new, _, r = aggregate(omega, {}, [single, balanced], eta_s=1.0)
    assert r == pytest.approx([0.5, 1.0])  # gamma = 3 = each norm: no clipping
    assert torch.allclose(new, torch.tensor([1.0, 2.0]))  # 1/3 of (3, 0) + 2/3 of (0, 3)


@pytest.mark.parametrize("n", [1, 2, 5, 30])
def test_replace_one_moves_a_clipped_prototype_by_at_most_two_c_over_n_eq5(n):
    """Eq. (5): replacing one of n clipped representations moves their mean by at most
    2 C_emb / n; the worst case (the replaced row's antipode) attains it."""
    g = torch.Generator().manual_seed(n)
    c_emb = 1.5
    h = torch.randn(n, 8, generator=g) * 3.0
    q = clip_embeddings(h, c_emb).mean(0)
    bound = release_sensitivity(c_emb, n)
    assert bound == pytest.approx(2 * c_emb / n)
    worst = 0.0
    for i in range(n):
        for other in (-h[i], torch.randn(8, generator=g) * 10.0, torch.zeros(8)):
            h2 = h.clone()
            h2[i] = other
            moved = float((clip_embeddings(h2, c_emb).mean(0) - q).norm())
            assert moved <= bound + 1e-6
            worst = max(worst, moved)
    assert worst == pytest.approx(bound, rel=1e-5)  # the antipode of a row beyond C_emb
