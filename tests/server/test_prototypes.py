import math

import pytest
import torch
from torch import nn

from fedlightning.methods.fedogl.prototypes import (
    PrototypeBank,
    client_consensus,
    local_prototypes,
    propagate,
    prototype_graph,
    refine_head,
    refinement_loss,
)

# --- Eq. (11): local prototypes ---------------------------------------------------------


def test_local_prototypes_means_and_counts_by_hand():
    z = torch.tensor([[0.0, 0.0], [2.0, 0.0], [4.0, 4.0], [1.0, 1.0]])
    y = torch.tensor([0, 0, 1, 5])
    out = local_prototypes(z, y, classes=[0, 1, 2])
    # class 0: mean of (0,0),(2,0) = (1,0), n=2; class 1: (4,4), n=1; class 2 has no node;
    # class 5 is not asked for.
    assert set(out) == {0, 1}
    (p0, n0), (p1, n1) = out[0][0], out[1][0]
    assert len(out[0]) == len(out[1]) == 1
    assert torch.equal(p0, torch.tensor([1.0, 0.0])) and n0 == 2
    assert torch.equal(p1, torch.tensor([4.0, 4.0])) and n1 == 1


def _as_set(protos):
    return {(tuple(round(v, 6) for v in p.tolist()), n) for p, n in protos}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_local_prototypes_two_modes_on_two_obvious_clusters(seed):
    z = torch.tensor([[0.0, 0.0], [0.0, 1.0], [10.0, 10.0], [10.0, 11.0], [11.0, 10.0]])
    y = torch.zeros(5, dtype=torch.long)
    out = local_prototypes(z, y, classes=[0], modes=2, seed=seed)
    # cluster A: (0, 0.5) with 2 nodes; cluster B: (31/3, 31/3) with 3 nodes
    assert _as_set(out[0]) == {((0.0, 0.5), 2), ((round(31 / 3, 6), round(31 / 3, 6)), 3)}
    # same inputs, same result
    again = local_prototypes(z, y, classes=[0], modes=2, seed=seed)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(out[0], again[0], strict=True))


def test_local_prototypes_modes_capped_by_class_size():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    out = local_prototypes(z, torch.tensor([3, 3]), classes=[3], modes=4)
    # k = min(4, 2) = 2: each node is its own mode
    assert _as_set(out[3]) == {((1.0, 0.0), 1), ((0.0, 1.0), 1)}


# --- Eq. (12): prototype bank -------------------------------------------------------------


def _slots(bank, c):
    P, labels, counts = bank.prototypes()
    keep = labels == c
    return P[keep], counts[keep]


def test_bank_merge_is_support_weighted():
    bank = PrototypeBank(slots=2, eta=0.8)
    assert bank.update(0, torch.tensor([1.0, 0.0]), 2) == "filled"
    # cos((3,1), (1,0)) = 3/sqrt(10) = 0.949 > 0.8 -> merge: (2*(1,0) + 1*(3,1)) / 3
    assert bank.update(0, torch.tensor([3.0, 1.0]), 1) == "merged"
    P, counts = _slots(bank, 0)
    assert torch.allclose(P, torch.tensor([[5 / 3, 1 / 3]]))
    assert counts.tolist() == [3]


def test_bank_merges_into_the_most_similar_slot_and_uses_raw_vectors():
    bank = PrototypeBank(slots=3, eta=0.8)
    bank.update(0, torch.tensor([2.0, 0.0]), 1)
    bank.update(0, torch.tensor([0.0, 1.0]), 1)  # cos 0 -> second slot
    # (4, 1): cos to (2,0) = 0.970, to (0,1) = 0.243 -> merge into slot 0, raw mean
    assert bank.update(0, torch.tensor([4.0, 1.0]), 3) == "merged"
    P, counts = _slots(bank, 0)
    # (1*(2,0) + 3*(4,1)) / 4 = (3.5, 0.75)
    assert torch.allclose(P, torch.tensor([[3.5, 0.75], [0.0, 1.0]]))
    assert counts.tolist() == [4, 1]


def test_bank_fills_an_empty_slot_below_eta():
    bank = PrototypeBank(slots=2, eta=0.8)
    bank.update(0, torch.tensor([1.0, 0.0]), 2)
    # cos((1,1), (1,0)) = 0.707 <= 0.8 and a slot is free
    assert bank.update(0, torch.tensor([1.0, 1.0]), 1) == "filled"
    P, counts = _slots(bank, 0)
    assert torch.equal(P, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert counts.tolist() == [2, 1]


def test_bank_threshold_is_strict():
    bank = PrototypeBank(slots=2, eta=1.0)
    bank.update(0, torch.tensor([1.0, 0.0]), 1)
    # cos = 1, not > 1
    assert bank.update(0, torch.tensor([1.0, 0.0]), 1) == "filled"


def test_bank_replaces_the_weakest_slot_when_full():
    bank = PrototypeBank(slots=2, eta=0.8)
    bank.update(0, torch.tensor([1.0, 0.0]), 3)
    bank.update(0, torch.tensor([0.0, 1.0]), 1)
    # (-1, 0): cos -1 and 0, no merge, no free slot -> replace slot 1 (support 1 < 3)
    assert bank.update(0, torch.tensor([-1.0, 0.0]), 5) == "replaced"
    P, counts = _slots(bank, 0)
    assert torch.equal(P, torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
    assert counts.tolist() == [3, 5]
    # (0, -1): cos 0 and 0 -> replace the weakest, now slot 0 (3 < 5)
    assert bank.update(0, torch.tensor([0.0, -1.0]), 1) == "replaced"
    P, counts = _slots(bank, 0)
    assert torch.equal(P, torch.tensor([[0.0, -1.0], [-1.0, 0.0]]))
    assert counts.tolist() == [1, 5]


def test_bank_classes_are_separate_and_state_round_trips():
    bank = PrototypeBank(slots=1, eta=0.5)
    bank.update(2, torch.tensor([1.0, 0.0]), 4)
    assert bank.update(0, torch.tensor([1.0, 0.0]), 1) == "filled"  # other class: no merge
    P, labels, counts = bank.prototypes()
    assert labels.tolist() == [0, 2] and counts.tolist() == [1, 4]
    assert P.shape == (2, 2)

    other = PrototypeBank()
    other.load_state_dict(bank.state_dict())
    assert (other.slots, other.eta) == (1, 0.5)
    for a, b in zip(other.prototypes(), bank.prototypes(), strict=True):
        assert torch.equal(a, b)
    # the restored bank continues the same way
    assert other.update(2, torch.tensor([0.0, 1.0]), 1) == bank.update(
        2, torch.tensor([0.0, 1.0]), 1
    )


def test_bank_rejects_bad_input():
    bank = PrototypeBank()
    with pytest.raises(ValueError, match="positive"):
        bank.update(0, torch.ones(2), 0)
    bank.update(0, torch.ones(2), 1)
    with pytest.raises(ValueError, match="dimension"):
        bank.update(0, torch.ones(3), 1)


# --- Eq. (13): prototype graph ------------------------------------------------------------


def _four_prototypes():
    # unit vectors at 0, 20, 90 and 100 degrees. Cosines:
    # 0-1 cos20=.94, 0-2 0, 0-3 cos100=-.17, 1-2 cos70=.34, 1-3 cos80=.17, 2-3 cos10=.98
    a = torch.deg2rad(torch.tensor([0.0, 20.0, 90.0, 100.0], dtype=torch.float64))
    return torch.stack([a.cos(), a.sin()], dim=1)


def test_prototype_graph_kappa_1():
    P = _four_prototypes()
    A = prototype_graph(P, torch.tensor([0, 1, 2, 3]), kappa=1)
    # nearest: 0->1, 1->0, 2->3, 3->2
    expected = [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]]
    assert A.tolist() == expected


def test_prototype_graph_kappa_2_is_symmetrised():
    P = _four_prototypes()
    A = prototype_graph(P, torch.tensor([0, 1, 2, 3]), kappa=2)
    # 0->{1,2}, 1->{0,2}, 2->{3,1}, 3->{2,1}; 0-2 exists because 0 chose 2 (2 did not
    # choose 0); 0-3 is the only missing pair
    expected = [[0, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 1], [0, 1, 1, 0]]
    assert A.tolist() == expected
    assert torch.equal(A, A.T)


def test_prototype_graph_same_class_edges():
    P = _four_prototypes()
    labels = torch.tensor([0, 1, 1, 0])
    # kappa=0: same-class edges only, 0-3 and 1-2
    assert prototype_graph(P, labels, kappa=0).tolist() == [
        [0, 0, 0, 1],
        [0, 0, 1, 0],
        [0, 1, 0, 0],
        [1, 0, 0, 0],
    ]
    # kappa=1: {0-1, 2-3} U {0-3, 1-2}
    assert prototype_graph(P, labels, kappa=1).tolist() == [
        [0, 1, 0, 1],
        [1, 0, 1, 0],
        [0, 1, 0, 1],
        [1, 0, 1, 0],
    ]
    # kappa larger than m - 1: everything, no self loops
    A = prototype_graph(P, labels, kappa=10)
    assert A.tolist() == (1 - torch.eye(4, dtype=A.dtype)).tolist()


# --- propagation ----------------------------------------------------------------------


def test_propagate_two_nodes_by_hand():
    P = torch.tensor([[2.0, 0.0], [0.0, 4.0]])
    A = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    # A + I = ones, D = diag(2, 2): each row becomes 1/2 * (p0 + p1) = (1, 2)
    assert torch.allclose(propagate(P, A), torch.tensor([[1.0, 2.0], [1.0, 2.0]]))


def test_propagate_isolated_node_keeps_itself():
    P = torch.tensor([[2.0, 0.0], [0.0, 4.0], [3.0, 3.0]])
    A = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = propagate(P, A)
    assert torch.allclose(out[2], P[2])
    assert torch.allclose(out[:2], torch.tensor([[1.0, 2.0], [1.0, 2.0]]))


# --- Eq. (14): refinement -------------------------------------------------------------


def _head(weight, bias):
    head = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    return head


def test_refinement_loss_by_hand():
    # 3 classes, class 1 unknown with a huge logit that must be ignored
    head = _head(
        torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]), torch.tensor([0.0, 100.0, 0.0])
    )
    P_tilde = torch.tensor([[math.log(3.0), 0.0]])
    # logits over known [0, 2]: (ln 3, 0) -> q_theta = (3/4, 1/4)
    # CE(label 0) = ln(4/3); KL((1/2,1/2) || (3/4,1/4)) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3)
    loss = refinement_loss(
        head,
        P_tilde,
        labels=torch.tensor([0]),
        q_cli=torch.tensor([[0.5, 0.5]]),
        known=torch.tensor([0, 2]),
        lambda_lab=1.0,
        lambda_tr=2.0,
    )
    assert loss.item() == pytest.approx(2 * math.log(4 / 3), rel=1e-6)
    # label 2 is position 1 of known: CE = ln 4
    ce_only = refinement_loss(head, P_tilde, torch.tensor([2]), None, [0, 2], 1.0, 1.0)
    assert ce_only.item() == pytest.approx(math.log(4.0), rel=1e-6)
    with pytest.raises(ValueError, match="not among the known"):
        refinement_loss(head, P_tilde, torch.tensor([1]), None, [0, 2])


def test_client_consensus_is_weighted_mean_softmax():
    P_tilde = torch.tensor([[math.log(3.0), 0.0]])
    a = {"weight": torch.tensor([[1.0, 0.0], [5.0, 5.0], [0.0, 1.0]]), "bias": torch.zeros(3)}
    b = {"weight": torch.zeros(3, 2), "bias": torch.tensor([0.0, 9.0, 0.0])}
    q = client_consensus([a, b], [1.0, 3.0], P_tilde, known=[0, 2])
    # a: (3/4, 1/4), b: (1/2, 1/2) over known -> (1*(.75,.25) + 3*(.5,.5)) / 4
    assert torch.allclose(q, torch.tensor([[0.5625, 0.4375]]))


def _random_memory():
    g = torch.Generator().manual_seed(0)
    P = torch.randn(8, 4, generator=g)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    q_cli = torch.randn(8, 3, generator=g).softmax(1)
    return P, labels, q_cli


def test_kappa_changes_the_gradient():
    """The graph is really used: kappa=1 and kappa=2 give different head gradients."""
    P, labels, q_cli = _random_memory()
    torch.manual_seed(0)
    head = nn.Linear(4, 3)
    grads = []
    for kappa in (1, 2):
        A = prototype_graph(P, labels, kappa)
        loss = refinement_loss(head, propagate(P, A), labels, q_cli, [0, 1, 2], 1.0, 1.0)
        (g,) = torch.autograd.grad(loss, head.weight)
        grads.append((A, g))
    (A1, g1), (A2, g2) = grads
    assert not torch.equal(A1, A2)
    assert not torch.allclose(g1, g2, atol=1e-4)


def test_refine_head_gamma_zero_leaves_head_unchanged():
    P, labels, q_cli = _random_memory()
    torch.manual_seed(0)
    head = nn.Linear(4, 3)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    out = refine_head(head, P, labels, q_cli, [0, 1, 2], kappa=2, gamma=0.0)
    for k, v in head.state_dict().items():
        assert torch.equal(v, before[k])
    assert out["loss_before"] == out["loss_after"]


def test_refine_head_lowers_the_loss_in_place():
    P, labels, q_cli = _random_memory()
    torch.manual_seed(0)
    head = nn.Linear(4, 3)
    w0 = head.weight.detach().clone()
    out = refine_head(head, P, labels, q_cli, [0, 1, 2], kappa=2, gamma=1.0, steps=5, lr=0.1)
    assert out["loss_after"] < out["loss_before"]
    assert not torch.equal(head.weight, w0)
    assert head.weight.grad is None  # no gradient left behind
    # loss_after is the refinement loss of the updated head on the same P_tilde
    P_tilde = propagate(P, prototype_graph(P, labels, 2))
    with torch.no_grad():
        again = refinement_loss(head, P_tilde, labels, q_cli, [0, 1, 2], 1.0, 1.0)
    assert again.item() == pytest.approx(out["loss_after"], rel=1e-6)


def test_refine_head_empty_memory_is_a_no_op():
    head = nn.Linear(4, 3)
    out = refine_head(head, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), None, [0], 1, 1.0)
    assert math.isnan(out["loss_before"]) and math.isnan(out["loss_after"])
