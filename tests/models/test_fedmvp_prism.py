"""FedMVP's and PRISM's equations against hand computations, and their defining mechanisms:
the prompt reads the server's class text prototypes, the consistency term pulls the prompted
feature to the frozen view, a node missing a modality gets it from the paired prototypes
under its gate, the server writes the count-weighted class means into the global model."""

from __future__ import annotations

import math

import pytest
import torch
from torch_geometric.data import Data

from fedlightning.messages import ClientUpdate
from fedlightning.methods.class_bank.class_bank_server import ClassBank, class_mean, class_means
from fedlightning.methods.fedmvp.fedmvp_client import FedMVPClassifier, consistency_loss
from fedlightning.methods.fedmvp.fedmvp_model import (
    FedMVPNet,
    cosine_logits,
    geglu,
    shared_key_attention,
)
from fedlightning.methods.prism.prism import deficient_clients, drop_modality
from fedlightning.methods.prism.prism_model import (
    PrismNet,
    gate_features,
    gated_fusion,
    impute,
    neighbour_agreement,
    retrieval_similarity,
    retrieval_weights,
)
from fedlightning.models.multimodal import masked_fusion


def gelu(x: float) -> float:
    return x * 0.5 * (1 + math.erf(x / math.sqrt(2)))


# ---------------------------------------------------------------- FedMVP's equations
def test_geglu_is_first_half_times_gelu_of_second():
    out = geglu(torch.tensor([[1.0, 2.0, 3.0, -1.0]]))
    assert out.tolist()[0] == pytest.approx([1 * gelu(3.0), 2 * gelu(-1.0)], rel=1e-6)


def test_cosine_logits_by_hand():
    f = torch.tensor([[3.0, 4.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, -4.0]])
    assert cosine_logits(f, w, 10.0).tolist()[0] == pytest.approx([6.0, 8.0, -10.0], rel=1e-6)


def test_shared_key_attention_one_head_by_hand():
    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    v = torch.tensor([[2.0, 0.0], [0.0, 4.0]])
    w1 = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1)
    out = shared_key_attention(q, k, v, heads=1)
    assert out.flatten().tolist() == pytest.approx([2 * w1, 4 * (1 - w1)], rel=1e-6)


def test_shared_key_attention_heads_are_independent_slices():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(3, 2, 4, generator=g),
        torch.randn(5, 4, generator=g),
        torch.randn(5, 4, generator=g),
    )
    out = shared_key_attention(q, k, v, heads=2)
    for h in range(2):
        sl = slice(2 * h, 2 * h + 2)
        ref = torch.softmax(q[..., sl] @ k[:, sl].t() / math.sqrt(2), -1) @ v[:, sl]
        assert torch.allclose(out[..., sl], ref, atol=1e-6)


def test_consistency_loss_by_hand():
    prompted = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    frozen = torch.tensor([[3.0, 0.0], [1.0, 0.0]])
    assert float(consistency_loss(prompted, frozen)) == pytest.approx((0.0 + 1.0) / 2)


# ---------------------------------------------------------------- the server's class bank
def test_class_mean_weights_by_support():
    p = class_mean([torch.tensor([1.0, 1.0]), torch.tensor([3.0, 5.0])], [1, 3])
    assert p.tolist() == pytest.approx([2.5, 4.0])


def test_class_means_by_hand():
    x = torch.tensor([[1.0], [3.0], [10.0], [7.0]])
    y = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([True, True, True, False])
    out = class_means(x, y, mask)
    assert set(out) == {0, 1}
    assert out[0][0].tolist() == [2.0] and out[0][1] == 2
    assert out[1][0].tolist() == [10.0] and out[1][1] == 1


def _bank_update(cid: int, protos: dict[int, tuple[list[float], int]]) -> ClientUpdate:
    tensors = {f"p.{c}": torch.tensor(v) for c, (v, _) in protos.items()}
    scalars = {f"n.{c}": float(n) for c, (_, n) in protos.items()}
    return ClientUpdate(1, tensors, {"num_examples": 10.0, **scalars}, client_id=cid)


def test_class_bank_writes_count_weighted_means_and_keeps_unsent_classes():
    bank = ClassBank(torch.zeros(3, 2), "buf", "seen", "p.", "n.")
    bank.aggregate(
        1,
        [
            _bank_update(0, {0: ([1.0, 0.0], 1)}),
            _bank_update(1, {0: ([4.0, 3.0], 2), 2: ([1.0, 1.0], 5)}),
        ],
    )
    state = bank.update_global(1, {"w": torch.ones(1)})
    assert state["buf"].tolist() == [[3.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
    assert state["seen"].tolist() == [1.0, 0.0, 1.0] and state["w"].tolist() == [1.0]
    bank.aggregate(2, [_bank_update(0, {2: ([5.0, 5.0], 1)})])  # class 0 not sent: kept
    state = bank.update_global(2, {})
    assert state["buf"].tolist() == [[3.0, 2.0], [0.0, 0.0], [5.0, 5.0]]
    again = ClassBank(torch.zeros(3, 2), "buf", "seen", "p.", "n.")
    again.load_state_dict(bank.state_dict())
    assert torch.equal(again.update_global(2, {})["buf"], state["buf"])


# ---------------------------------------------------------------- FedMVP's mechanism
def tiny_graph(n: int = 6, seed: int = 0, missing: list[int] | None = None) -> Data:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, 2, dtype=torch.bool)
    for i in missing or []:
        mask[i, 1] = False
    data = Data(
        x_text=torch.randn(n, 5, generator=g),
        x_bow=torch.randn(n, 7, generator=g) * mask[:, 1:].float(),
        edge_index=torch.tensor([[0, 1, 1, 2, 3, 4], [1, 0, 2, 1, 4, 3]]),
        y=torch.tensor([0, 1, 2, 0, 1, 2])[:n],
        num_nodes=n,
    )
    data.modality_mask = mask
    return data


def test_fedmvp_prompt_reads_only_the_seen_class_prototypes():
    torch.manual_seed(0)
    net = FedMVPNet({"text": 5, "bow": 7}, 3, hidden=8, tokens=4, heads=2).eval()
    data = tiny_graph()
    reps = net.representations(data)
    assert torch.equal(reps["z"], reps["f"])  # no prototype yet: no prompt
    net.class_text.copy_(torch.randn(3, 8))
    net.class_seen.copy_(torch.tensor([1.0, 1.0, 0.0]))
    prompted = net.representations(data)
    assert not torch.allclose(prompted["z"], prompted["f"])  # the prompt is on
    assert torch.equal(net.head(prompted["z"]), net(data))  # logits = cosine head of z
    net.class_text[2] += 5.0  # an unseen class's row is masked out of the keys
    assert torch.equal(net.representations(data)["z"], prompted["z"])
    net.class_text[0] += 5.0  # a seen one is read
    assert not torch.allclose(net.representations(data)["z"], prompted["z"])


def test_fedmvp_consistency_term_is_alpha_times_the_cosine_gap_to_the_frozen_view():
    torch.manual_seed(0)
    net = FedMVPNet({"text": 5, "bow": 7}, 3, hidden=8, tokens=4, heads=2, dropout=0.0)
    net.class_text.copy_(torch.randn(3, 8))
    net.class_seen.fill_(1.0)
    data = tiny_graph()
    data.sup_mask = torch.tensor([True, True, True, False, False, False])
    data.replay_mask = torch.tensor([False, False, False, True, False, False])
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():  # move the trained net away from the frozen view
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    losses = {}
    for alpha in (0.0, 10.0):
        module = FedMVPClassifier(net, torch.optim.Adam, alpha=alpha)
        frozen = {k: v.clone() for k, v in state.items()}
        moved = {k: v.clone() for k, v in net.state_dict().items()}
        module.receive(moved)
        module.set_frozen(frozen)  # the frozen view: the task-start global model
        module.set_stage(torch.tensor([0, 1, 2]), None, None)
        losses[alpha] = float(module.training_step(data).detach())
    ref = FedMVPNet({"text": 5, "bow": 7}, 3, hidden=8, tokens=4, heads=2, dropout=0.0)
    ref.load_state_dict(state)
    ref.eval()
    m = data.sup_mask | data.replay_mask
    with torch.no_grad():
        gap = consistency_loss(net.representations(data)["z"][m], ref.representations(data)["f"][m])
    assert float(gap) > 1e-3
    assert losses[10.0] - losses[0.0] == pytest.approx(10.0 * float(gap), rel=1e-4)


# ---------------------------------------------------------------- PRISM's equations
def test_retrieval_similarity_averages_over_available_modalities():
    h = [torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [0.0, 0.0]])]
    mask = torch.tensor([[True, True], [True, False]])
    paired = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[1.0, 1.0], [0.0, 1.0]]])  # [C, M, d]
    sim = retrieval_similarity(h, mask, paired)
    r = 1 / math.sqrt(2)
    assert sim[0].tolist() == pytest.approx([(1.0 + 0.0) / 2, (r + 1.0) / 2])
    assert sim[1].tolist() == pytest.approx([0.0, r])  # node 1: modality 0 only


def test_retrieval_weights_softmax_over_the_top_k_seen_classes():
    sim = torch.tensor([[0.9, 0.5, 0.1, 0.95]])
    seen = torch.tensor([True, True, True, False])
    w = retrieval_weights(sim, seen, k=2, tau=0.1)
    w0 = 1 / (1 + math.exp(-4.0))
    assert w[0].tolist() == pytest.approx([w0, 1 - w0, 0.0, 0.0], rel=1e-6)
    assert torch.equal(
        retrieval_weights(sim, torch.zeros(4, dtype=torch.bool), 2, 0.1), torch.zeros(1, 4)
    )


def test_impute_is_the_weighted_sum_of_the_modality_prototypes():
    paired = torch.tensor([[[0.0, 0.0], [2.0, 0.0]], [[0.0, 0.0], [0.0, 4.0]]])
    assert impute(torch.tensor([[0.25, 0.75]]), paired, 1).tolist() == [[0.5, 3.0]]


def test_neighbour_agreement_and_gate_features_by_hand():
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, 0.5]])
    ei = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])  # path 0-1-2, node 3 alone
    rho = neighbour_agreement(w, ei)
    # node 0's neighbour mean is [0, 1] (cos 0); node 1's is [1, 0.5]; node 2's [0, 1]
    assert rho.tolist() == pytest.approx(
        [0.0, 0.5 / math.sqrt(1.25), 1 / math.sqrt(2), 0.0], abs=1e-6
    )
    phi = gate_features(w, ei)
    assert phi[:, 0].tolist() == pytest.approx([math.log(2), math.log(3), math.log(2), 0.0])
    assert phi[:, 2].tolist() == [1.0, 1.0, 1.0, 0.5]


def test_gated_fusion_counts_an_imputed_modality_with_the_gate():
    h = [torch.tensor([[2.0, 0.0], [2.0, 0.0]]), torch.tensor([[0.0, 4.0], [9.0, 9.0]])]
    imputed = [torch.zeros(2, 2), torch.tensor([[8.0, 8.0], [3.0, 3.0]])]
    mask = torch.tensor([[True, True], [True, False]])
    s = gated_fusion(h, imputed, mask, torch.tensor([0.3, 0.5]))
    assert s[0].tolist() == pytest.approx([1.0, 2.0])  # both present: the plain mean
    assert s[1].tolist() == pytest.approx([(2.0 + 1.5) / 1.5, 1.5 / 1.5])  # (h0 + g h1^) / (1 + g)
    assert torch.allclose(gated_fusion(h, imputed, mask, torch.zeros(2)), masked_fusion(h, mask))


def test_prism_imputes_only_the_missing_nodes_from_the_paired_prototypes():
    torch.manual_seed(0)
    net = PrismNet({"text": 5, "bow": 7}, 3, hidden=8).eval()
    data = tiny_graph(missing=[1, 4])
    before = net.gnn_inputs(data)["gnn"]
    h = net.modality_embeddings(data)
    assert torch.allclose(before, masked_fusion(h, data.modality_mask))  # nothing to retrieve
    net.paired.copy_(torch.rand(3, 2, 8))
    net.paired_seen.copy_(torch.tensor([1.0, 1.0, 1.0]))
    after = net.gnn_inputs(data)["gnn"]
    full = data.modality_mask.all(1)
    assert torch.allclose(after[full], before[full])  # nodes with both modalities: unchanged
    assert not torch.allclose(after[~full], before[~full])  # the deficient ones: imputed
    w = retrieval_weights(
        retrieval_similarity(h, data.modality_mask, net.paired), net.paired_seen > 0, 3, 0.1
    )
    gate = torch.sigmoid(net.gate(gate_features(w, data.edge_index))).squeeze(-1)
    hand = (h[0] + gate[:, None] * (w @ net.paired[:, 1])) / (1 + gate[:, None])
    assert torch.allclose(after[~full], hand[~full], atol=1e-6)


def test_deficient_clients_one_per_modality_seeded():
    got = deficient_clients(5, ["text", "bow"], 0.4, seed=3)
    assert len(got) == 2 and sorted(got.values()) == ["bow", "text"]
    assert got == deficient_clients(5, ["text", "bow"], 0.4, seed=3)
    draws = {
        tuple(sorted(deficient_clients(5, ["text", "bow"], 0.4, seed=s).items())) for s in range(8)
    }
    assert len(draws) > 1  # the seed moves the draw
    assert deficient_clients(5, ["text", "bow"], 0.0, seed=3) == {}


def test_drop_modality_zeroes_the_rows_and_the_mask():
    data = tiny_graph()
    drop_modality(data, ["text", "bow"], "bow")
    assert not bool(data.modality_mask[:, 1].any()) and bool(data.modality_mask[:, 0].all())
    assert torch.equal(data.x_bow, torch.zeros(6, 7))
    assert data.x_text.abs().sum() > 0
