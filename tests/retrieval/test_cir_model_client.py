"""CrossModalGNN, the retrieval client's Eq. (5) with InfoNCE, and the algorithm's wiring."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch_geometric.data import Data

from fedlightning.clients.continual_retrieval import (
    ContinualRetrievalClient,
    similarity_distillation_kl,
)
from fedlightning.errors import ConfigError
from fedlightning.federation.executors import LeanExecutor
from fedlightning.methods.continual.retrieval_baselines import ContinualRetrieval
from fedlightning.models import MultimodalGNN
from fedlightning.models.cross_modal import CrossModalGNN
from fedlightning.objectives import symmetric_info_nce

N, D_TEXT, D_BOW = 16, 8, 6
DIMS = {"text": D_TEXT, "bow": D_BOW}


def tiny_graph(seed: int = 0) -> Data:
    """A ring of 16 nodes whose bow features are a noisy linear map of their text features;
    node 3 lacks bow, node 5 lacks text. Nodes 0-9 current stage, 10-13 replayed."""
    g = torch.Generator().manual_seed(seed)
    x_text = torch.randn(N, D_TEXT, generator=g)
    x_bow = x_text @ torch.randn(D_TEXT, D_BOW, generator=g) + 0.1 * torch.randn(
        N, D_BOW, generator=g
    )
    src = torch.arange(N)
    ring = torch.stack([src, (src + 1) % N])
    mask = torch.ones(N, 2, dtype=torch.bool)
    mask[3, 1] = False
    mask[5, 0] = False
    data = Data(x_text=x_text, x_bow=x_bow, edge_index=torch.cat([ring, ring.flip(0)], 1))
    data.modality_mask, data.num_nodes = mask, N
    data.y = torch.zeros(N, dtype=torch.long)
    data.sup_mask = src < 10
    data.replay_mask = (src >= 10) & (src < 14)
    return data


def make_net(seed: int = 0, dropout: float = 0.0) -> CrossModalGNN:
    torch.manual_seed(seed)
    return CrossModalGNN(DIMS, num_classes=3, hidden=16, dropout=dropout)


def sgd(lr: float = 0.5):
    return partial(torch.optim.SGD, lr=lr)


# ---------------------------------------------------------------- model
def test_model_outputs_unit_norm_pairs_and_masks_missing_modalities():
    data, net = tiny_graph(), make_net().eval()
    q, k = net(data)
    assert q.shape == k.shape == (N, 16)
    assert torch.allclose(q.norm(dim=1), torch.ones(N)) and torch.allclose(
        k.norm(dim=1), torch.ones(N)
    )
    assert net.pair_mask(data).tolist() == [i not in (3, 5) for i in range(N)]
    # node 5 has no text: whatever its text features say reaches no query embedding
    changed = data.clone()
    changed.x_text = data.x_text.clone()
    changed.x_text[5] = 100.0
    assert torch.equal(net(changed)[0], q)
    assert net.modalities == ["text", "bow"] and net.conv == "gcn"


def test_model_rejects_unknown_or_equal_modalities():
    with pytest.raises(ConfigError, match="model.net.item"):
        CrossModalGNN({"text": 4, "image": 3}, 2)  # item defaults to bow
    with pytest.raises(ConfigError, match="model.net.item"):
        CrossModalGNN(DIMS, 2, query="text", item="text")


# ---------------------------------------------------------------- client
def test_training_step_is_eq5_with_info_nce_on_paired_nodes():
    data, net = tiny_graph(), make_net()
    client = ContinualRetrievalClient(net, sgd(), lambda_rep=0.5, temperature=0.2)
    client.set_stage(torch.tensor([0]), None, None)
    loss = client.training_step(data, 0)
    q, k = net(data)
    cur = torch.tensor([i for i in range(10) if i not in (3, 5)])  # nodes 3 and 5 are not pairs
    rep = torch.arange(10, 14)
    expected = symmetric_info_nce(q[cur], k[cur], 0.2) + 0.5 * symmetric_info_nce(
        q[rep], k[rep], 0.2
    )
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert client.last_loss == pytest.approx(loss.item())


def test_a_few_sgd_steps_reduce_the_loss():
    data = tiny_graph()
    client = ContinualRetrievalClient(make_net(), sgd(0.02), temperature=0.2)
    client.set_stage(torch.tensor([0]), None, None)
    opt = client.configure_optimizers()
    losses = []
    for _ in range(20):
        loss = client.training_step(data, 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses[:-1], losses[1:], strict=True))  # monotone here
    assert losses[-1] < 0.6 * losses[0]
    # the lean executor drives the same module through Lightning's hooks
    LeanExecutor().fit(client, data, 3)
    assert client.last_loss < losses[0]


def test_distillation_on_teacher_similarity_logits():
    data, net = tiny_graph(), make_net()
    client = ContinualRetrievalClient(
        net, sgd(), lambda_rep=0.0, lambda_dis=2.0, tau=2.0, distill_on="replay", temperature=0.2
    )
    known = torch.tensor([0])
    q, k = net(data)
    cur = torch.tensor([i for i in range(10) if i not in (3, 5)])
    nce = symmetric_info_nce(q[cur], k[cur], 0.2).item()
    # teacher == student: the KL term vanishes
    client.set_stage(known, {n: v.clone() for n, v in net.state_dict().items()}, known)
    assert client.training_step(data, 0).item() == pytest.approx(nce, rel=1e-6)
    # another teacher: lambda_dis * symmetric KL of the similarity logits on the replay nodes
    other = make_net(seed=1)
    client.set_stage(known, other.state_dict(), known)
    loss = client.training_step(data, 0)
    rep = torch.arange(10, 14)
    tq, tk = other(data)
    s, t = q[rep] @ k[rep].T / 0.2, tq[rep] @ tk[rep].T / 0.2
    kl = 0.5 * (similarity_distillation_kl(s, t, 2.0) + similarity_distillation_kl(s.T, t.T, 2.0))
    assert kl.item() > 0
    assert loss.item() == pytest.approx(nce + 2.0 * kl.item(), rel=1e-5)
    loss.backward()
    teacher = client._teacher[0]
    assert not teacher.training and all(p.grad is None for p in teacher.parameters())
    assert not any(n.startswith("_teacher") for n in client.state_dict())
    # lambda_dis = 0 ignores a teacher
    plain = ContinualRetrievalClient(make_net(), sgd(), lambda_dis=0.0)
    plain.set_stage(known, other.state_dict(), known)
    assert plain._teacher == []


def test_fedprox_anchor():
    data, net = tiny_graph(), make_net()
    client = ContinualRetrievalClient(net, sgd(), prox_mu=1.0, lambda_rep=0.0)
    client.receive({n: v.clone() for n, v in net.state_dict().items()})
    client.set_stage(torch.tensor([0]), None, None)
    q, k = net(data)
    cur = torch.tensor([i for i in range(10) if i not in (3, 5)])
    nce0 = symmetric_info_nce(q[cur], k[cur], 0.1).item()
    # w == anchor: no proximal part
    assert client.training_step(data, 0).item() == pytest.approx(nce0, rel=1e-6)
    with torch.no_grad():
        net.heads["bow"].bias.add_(0.1)
    q, k = net(data)
    nce = symmetric_info_nce(q[cur], k[cur], 0.1).item()
    prox = 0.5 * 1.0 * 16 * 0.01  # 16 bias entries moved by 0.1
    assert client.training_step(data, 0).item() == pytest.approx(nce + prox, rel=1e-5)


# ---------------------------------------------------------------- algorithm
def test_algorithm_wiring_and_validation():
    algo = ContinualRetrieval(replay_budget=5, lambda_dis=1.0, temperature=0.2, prox_mu=0.1)
    assert algo.score == "similarity" and algo.evaluation == "retrieval"
    assert algo.distill_on == "replay"
    client = algo.client_module(make_net(), sgd())
    assert isinstance(client, ContinualRetrievalClient)
    assert (client.temperature, client.lambda_dis, client.prox_mu) == (0.2, 1.0, 0.1)
    with pytest.raises(ConfigError, match="algorithm.score"):
        ContinualRetrieval(score="msp")
    with pytest.raises(ConfigError, match="algorithm.temperature"):
        ContinualRetrieval(temperature=0.0)
    with pytest.raises(ConfigError, match="algorithm.replay_budget"):
        ContinualRetrieval(replay_budget=-1)
    with pytest.raises(ConfigError, match="retrieval model"):
        algo.client_module(MultimodalGNN(DIMS, 3), sgd())


@pytest.mark.parametrize(
    "method, expect",
    [
        ("fedavg", dict(name="fedavg", replay_budget=0, lambda_dis=0.0, prox_mu=0.0)),
        ("fedavg_replay", dict(name="fedavg", replay_budget=20, distill_on="replay")),
        ("fedprox_replay", dict(name="fedprox", replay_budget=20, prox_mu=0.01)),
        ("fedlwf", dict(name="fedlwf", replay_budget=0, lambda_dis=1.0, distill_on="current")),
    ],
)
def test_experiment_configs_compose(compose, method, expect):
    from fedlightning.config import build

    cfg = compose(["experiment=cir_citeseer_mm", f"algorithm=cir_{method}"])
    assert cfg.task == "cir" and cfg.name == f"cir_{method}_citeseer_mm"
    assert cfg.model.net._target_ == "fedlightning.models.cross_modal.CrossModalGNN"
    assert cfg.model.net.conv == "gcn"
    algo = build(cfg.algorithm, "algorithm")
    assert isinstance(algo, ContinualRetrieval) and algo.temperature == 0.1
    for key, value in expect.items():
        assert getattr(algo, key) == value, key
