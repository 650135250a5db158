"""The retrieval reading of Eqs. (12)-(14): class descriptors, client similarity targets,
the alignment loss and the server module that refines the projection heads."""

import math

import pytest
import torch
from torch import nn

from fedlightning.messages import ClientUpdate, read_prototypes
from fedlightning.methods.fedogl.alignment import (
    alignment_loss,
    class_descriptors,
    refine_heads,
    similarity_consensus,
)
from fedlightning.methods.fedogl.fedogl_server import AlignmentMemory
from fedlightning.objectives import symmetric_info_nce

E = math.e
EYE = torch.eye(2)
SWAP = torch.tensor([[0.0, 1.0], [1.0, 0.0]])


def _head(w):
    return {"weight": w, "bias": torch.zeros(2)}


def test_class_descriptors_are_class_means_in_the_order_asked():
    P = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0]])
    labels = torch.tensor([5, 5, 2])
    out = class_descriptors(P, labels, [2, 5])
    assert torch.equal(out, torch.tensor([[0.0, 4.0], [2.0, 1.0]]))
    with pytest.raises(ValueError, match="class 7"):
        class_descriptors(P, labels, [7])


def test_similarity_consensus_by_hand():
    # identity heads: S = I, rows softmax([1, 0]) at T = 1; swapped query head: S = SWAP
    p = E / (1 + E)
    same = torch.tensor([[p, 1 - p], [1 - p, p]])
    rows, cols = similarity_consensus([(_head(EYE), _head(EYE))], [2.0], EYE, EYE, 1.0)
    assert torch.allclose(rows, same) and torch.allclose(cols, same)
    rows, cols = similarity_consensus(
        [(_head(EYE), _head(EYE)), (_head(SWAP), _head(EYE))], [1.0, 3.0], EYE, EYE, 1.0
    )
    assert torch.allclose(rows, 0.25 * same + 0.75 * same.flip(1))
    assert torch.allclose(cols, 0.25 * same + 0.75 * same.flip(1))
    # the temperature sharpens: T = 0.5 gives softmax([2, 0])
    rows, _ = similarity_consensus([(_head(EYE), _head(EYE))], [1.0], EYE, EYE, 0.5)
    assert rows[0, 0].item() == pytest.approx(E**2 / (1 + E**2))
    with pytest.raises(ValueError, match="not all zero"):
        similarity_consensus([(_head(EYE), _head(EYE))], [0.0], EYE, EYE, 1.0)


def test_alignment_loss_by_hand():
    nce = math.log(1 + math.exp(-1))  # S = I at T = 1
    assert alignment_loss(EYE, EYE, None, 1.0).item() == pytest.approx(nce)
    assert alignment_loss(EYE, EYE, None, 1.0, lambda_lab=3.0).item() == pytest.approx(3 * nce)
    # uniform targets: KL(u || softmax([1, 0])) per row, the same for columns
    p = E / (1 + E)
    kl = 0.5 * math.log(0.5 / p) + 0.5 * math.log(0.5 / (1 - p))
    u = torch.full((2, 2), 0.5)
    loss = alignment_loss(EYE, EYE, (u, u), 1.0, lambda_lab=1.0, lambda_tr=2.0)
    assert loss.item() == pytest.approx(nce + 2.0 * kl)
    assert alignment_loss(EYE, EYE, None, 1.0).item() == pytest.approx(
        symmetric_info_nce(EYE, EYE, 1.0).item()
    )


def _heads(seed):
    torch.manual_seed(seed)
    return nn.Linear(3, 3), nn.Linear(3, 3)


def test_refine_heads_lowers_the_loss_and_gamma_zero_changes_nothing():
    A, B = torch.randn(3, 3), torch.randn(3, 3)
    hq, hv = _heads(0)
    before = [p.detach().clone() for p in (*hq.parameters(), *hv.parameters())]
    out = refine_heads(hq, hv, A, B, None, 0.5, gamma=0.0)
    assert out["loss_after"] == out["loss_before"]
    after = [*hq.parameters(), *hv.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    out = refine_heads(hq, hv, A, B, None, 0.5, gamma=1.0, steps=10, lr=0.5)
    assert out["loss_after"] < out["loss_before"]
    assert not torch.equal(before[0], hq.weight) and not torch.equal(before[2], hv.weight)


# --- the server module --------------------------------------------------------------------
def _update(cid, heads, protos):
    """A client message: projection heads and per-modality prototypes {(side, c): vec}."""
    tensors = {f"model.heads.{m}.{k}": v for m, h in heads.items() for k, v in h.items()}
    tensors["model.gnns.text.convs.0.bias"] = torch.zeros(3)
    scalars = {"num_examples": 10.0}
    for (side, c), p in protos.items():
        tensors[f"proto.{side}.{c}.0"] = p
        scalars[f"proto_count.{side}.{c}.0"] = 4.0
    return ClientUpdate(1, tensors, scalars, client_id=cid)


def test_read_prototypes_by_side():
    u = _update(0, {}, {("text", 1): torch.ones(3), ("bow", 2): torch.zeros(3)})
    ((c, p, n),) = read_prototypes(u, "text")
    assert (c, n) == (1, 4) and torch.equal(p, torch.ones(3))
    assert [x[0] for x in read_prototypes(u, "bow")] == [2]
    assert read_prototypes(u) == []  # the classification bank reads no modality field


def test_alignment_memory_refines_only_the_heads_once_an_old_class_exists():
    torch.manual_seed(0)
    hq, hv = nn.Linear(3, 3), nn.Linear(3, 3)
    heads = {"text": hq.state_dict(), "bow": hv.state_dict()}
    state = {f"heads.{m}.{k}": v.clone() for m, h in heads.items() for k, v in h.items()}
    state["gnns.text.convs.0.bias"] = torch.ones(3)
    mem = AlignmentMemory(("text", "bow"), temperature=0.5, kappa=1, gamma=1.0, steps=3, lr=0.5)
    protos = {(m, c): torch.randn(3) for m in ("text", "bow") for c in (0, 1)}
    mem.schedule = lambda r: ([0, 1], False)  # first stage: gamma_t = 0
    mem.aggregate(1, [_update(0, heads, protos)])
    assert mem.update_global(1, state) is state
    assert len(mem.banks["text"]) == 2 and len(mem.banks["bow"]) == 2
    mem.schedule = lambda r: ([0, 1, 2], True)
    new = {(m, 2): torch.randn(3) for m in ("text", "bow")}
    mem.aggregate(2, [_update(1, heads, new)])
    out = mem.update_global(2, state)
    assert mem.last_refine["loss_after"] < mem.last_refine["loss_before"]
    changed = {k for k in state if not torch.equal(out[k], state[k])}
    assert changed == {"heads.text.weight", "heads.text.bias", "heads.bow.weight", "heads.bow.bias"}
    # a state round trip keeps both banks and the head window
    other = AlignmentMemory(("text", "bow"), temperature=0.5, kappa=1, gamma=1.0, steps=3, lr=0.5)
    other.load_state_dict(mem.state_dict())
    other.schedule = mem.schedule
    again = other.update_global(2, state)
    assert all(torch.equal(again[k], out[k]) for k in out)


def test_the_prototype_graph_reaches_the_head_gradient():
    """kappa changes the propagated descriptors, hence the heads' update."""
    torch.manual_seed(1)
    hq, hv = nn.Linear(3, 3), nn.Linear(3, 3)
    heads = {"text": hq.state_dict(), "bow": hv.state_dict()}
    state = {f"heads.{m}.{k}": v.clone() for m, h in heads.items() for k, v in h.items()}
    protos = {(m, c): torch.randn(3) for m in ("text", "bow") for c in range(4)}
    outs = []
    for kappa in (0, 2):
        mem = AlignmentMemory(("text", "bow"), kappa=kappa, gamma=1.0, steps=1, lr=0.5)
        mem.schedule = lambda r: ([0, 1, 2, 3], True)
        mem.aggregate(1, [_update(0, heads, protos)])
        outs.append(mem.update_global(1, state)["heads.text.weight"])
    assert not torch.allclose(outs[0], outs[1])
