import math
from functools import partial

import pytest
import torch

from fedlightning.clients.continual_client import ContinualNodeClassifier
from fedlightning.clients.losses import distillation_kl, retention_objective
from fedlightning.clients.replay import class_balanced_sample, stage_batch
from fedlightning.data.graphs import make_synthetic
from fedlightning.models import MultimodalGNN


def test_distillation_kl_hand_value():
    # teacher p = softmax([0, ln 3]) = [1/4, 3/4]; student q = [1/2, 1/2]; tau = 1
    t = torch.tensor([[0.0, math.log(3.0)]])
    s = torch.tensor([[0.0, 0.0]])
    kl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert distillation_kl(s, t, tau=1.0).item() == pytest.approx(kl, rel=1e-6)
    # tau scales logits by 1/tau and the term by tau^2: with tau = 2 and doubled logits,
    # the distributions are the same, so the value is 4 x kl
    assert distillation_kl(2 * s, 2 * t, tau=2.0).item() == pytest.approx(4 * kl, rel=1e-6)
    assert distillation_kl(t, t, tau=1.0).item() == pytest.approx(0.0, abs=1e-7)


def test_retention_objective_weights():
    out = retention_objective(torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0), 0.5, 2.0)
    assert out.item() == 1.0 + 0.5 * 2.0 + 2.0 * 3.0


def test_class_balanced_sample_respects_budget():
    nodes = torch.arange(20)
    labels = torch.tensor([0] * 10 + [1] * 3 + [2] * 7)
    out = class_balanced_sample(nodes, labels, 4, torch.Generator().manual_seed(0))
    counts = torch.bincount(labels[out], minlength=3).tolist()
    assert counts == [4, 3, 4]
    assert class_balanced_sample(nodes, labels, 0, torch.Generator()).numel() == 0


def _data():
    g = make_synthetic(num_nodes=90, num_classes=3, seed=0)
    d = g.to_data()
    d.train_mask = torch.arange(90) % 3 != 0
    return d


def test_stage_batch_hides_unknown_classes():
    d = _data()
    known = torch.tensor([0, 1])
    replay_nodes = ((d.y == 0) & d.train_mask).nonzero().squeeze(1)[:3]
    b = stage_batch(d, known, torch.tensor([1]), replay_nodes)
    assert set(b.y.tolist()) <= {0, 1}
    assert b.num_nodes == int(torch.isin(d.y, known).sum())
    assert int(b.edge_index.max()) < b.num_nodes
    assert set(b.y[b.sup_mask].tolist()) == {1}
    assert int(b.replay_mask.sum()) == 3 and set(b.y[b.replay_mask].tolist()) == {0}


def _module(**kw):
    torch.manual_seed(0)
    d = _data()
    net = MultimodalGNN({m: d[f"x_{m}"].size(1) for m in ("text", "image")}, 3, hidden=8)
    return ContinualNodeClassifier(net, partial(torch.optim.SGD, lr=0.1), **kw), d


def test_known_class_head_and_lwf_without_replay():
    mod, d = _module(lambda_dis=1.0, distill_on="current")
    b = stage_batch(d, torch.tensor([0, 1, 2]), torch.tensor([2]), torch.zeros(0, dtype=torch.long))
    mod.set_stage(torch.tensor([0, 1, 2]), None, None)
    mod.eval()
    base = mod.training_step(b).item()
    # with a teacher that differs from the student, the KL on current nodes adds to the loss
    teacher = {k: v + 0.3 * torch.randn_like(v) for k, v in mod.net.state_dict().items()}
    mod.set_stage(torch.tensor([0, 1, 2]), teacher, torch.tensor([0, 1]))
    with_kl = mod.training_step(b).item()
    assert with_kl > base
    # the teacher is no parameter of the module: FedAvg never averages it
    assert not any(k.startswith("_teacher") for k in mod.state_dict())


def test_ce_uses_only_known_logits():
    mod, d = _module()
    b = stage_batch(d, torch.tensor([1, 2]), torch.tensor([1, 2]), torch.zeros(0, dtype=torch.long))
    mod.set_stage(torch.tensor([1, 2]), None, None)
    mod.eval()
    loss = mod.training_step(b)
    logits = mod.net(b)[:, [1, 2]]
    target = b.y[b.sup_mask] - 1  # class 1 -> 0, class 2 -> 1 in the known head
    ref = torch.nn.functional.cross_entropy(logits[b.sup_mask], target)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_a_stage_batch_is_built_once_per_stage_and_again_when_its_inputs_change():
    """``batch_at`` gives every round of a stage the batch it built (so the work kept per
    graph tensor carries over), and a new one for another stage, replay memory or graph."""
    from types import SimpleNamespace

    from fedlightning.federation.algorithm import FederatedClient
    from fedlightning.methods.continual.continual import ContinualFedAvg

    algo = ContinualFedAvg(replay_budget=2)
    algo.stream = SimpleNamespace(
        known=lambda t: [0, 1] if t == 0 else [0, 1, 2], observed=[[[0, 1], [2]]]
    )
    client = FederatedClient(0, _data())
    first = algo.batch_at(client, 0)
    assert algo.batch_at(client, 0) is first
    again = stage_batch(client.data, torch.tensor([0, 1]), torch.tensor([0, 1]), first.y[:0])
    for key in ("y", "edge_index", "sup_mask", "replay_mask"):
        assert torch.equal(first[key], again[key])
    old = ((client.data.y == 0) & client.data.train_mask).nonzero().squeeze(1)
    client.state["replay"] = {0: old[:2]}
    later = algo.batch_at(client, 1)
    assert later is not first and int(later.replay_mask.sum()) == 2
    assert algo.batch_at(client, 1) is later
    client.state["replay"] = {0: old[1:3]}  # another memory
    assert algo.batch_at(client, 1) is not later
    kept = algo.batch_at(client, 1)
    client.data.y[5] = 2  # the graph written in place
    assert algo.batch_at(client, 1) is not kept
