"""Mini-batch clients (fedlightning/clients/minibatch.py): the sampler by hand, a full-fanout
single batch against the full-batch step, batched inference against the whole graph, the
gradient projection per mini-batch step, determinism, and real Cora runs forced onto it."""

import logging
import math
from functools import partial

import pytest
import torch
from torch_geometric.data import Data
from torch_geometric.utils import remove_self_loops, to_undirected

from fedlightning.clients.minibatch import (
    MiniBatch,
    MiniBatches,
    minibatches_for,
    node_outputs,
    sample_subgraph,
)
from fedlightning.clients.node_classifier import NodeClassifier
from fedlightning.config import check_minibatch
from fedlightning.errors import ConfigError
from fedlightning.federation.executors import LeanExecutor
from fedlightning.methods.fedogl.projection import GradientProjection
from fedlightning.models import MultimodalGNN

SGD = partial(torch.optim.SGD, lr=0.1)


def graph(n: int = 40, edges: int = 100, seed: int = 0) -> Data:
    """A random undirected graph with one 6-d modality, 3 classes, half the nodes training."""
    g = torch.Generator().manual_seed(seed)
    ei, _ = remove_self_loops(to_undirected(torch.randint(0, n, (2, edges), generator=g)))
    return Data(
        x_a=torch.randn(n, 6, generator=g),
        modality_mask=torch.ones(n, 1, dtype=torch.bool),
        edge_index=ei,
        y=torch.randint(0, 3, (n,), generator=g),
        train_mask=torch.rand(n, generator=g) < 0.5,
        num_nodes=n,
    )


def net(conv: str = "gcn", dropout: float = 0.0) -> MultimodalGNN:
    torch.manual_seed(0)
    return MultimodalGNN({"a": 6}, 3, hidden=8, gnn_layers=2, conv=conv, dropout=dropout)


def fit(module: NodeClassifier, data: Data, seed: int = 0, epochs: int = 1, callbacks=()) -> dict:
    torch.manual_seed(seed)
    LeanExecutor().fit(module, data, epochs, list(callbacks))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Steps(GradientProjection):
    """Counts the optimizer steps of a fit (a callback's ``on_train_batch_end``)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.steps = 0

    def on_train_batch_end(self, *args, **kw):
        super().on_train_batch_end(*args, **kw)
        self.steps += 1


def test_sample_subgraph_by_hand():
    # path 0-1-2-3-4 (both directions); seed 2, every in-neighbour for one hop:
    # nodes 2 (the seed, first), then 1 and 3; edges 1->2 and 3->2 only
    ei = torch.tensor([[0, 1, 1, 2, 2, 3, 3, 4], [1, 0, 2, 1, 3, 2, 4, 3]])
    data = Data(edge_index=ei, y=torch.arange(5) * 10, num_nodes=5)
    sub = sample_subgraph(data, torch.tensor([2]), [-1])
    assert sub.n_id.tolist() == [2, 1, 3] and sub.batch_size == 1
    assert sub.y.tolist() == [20, 10, 30]
    assert sorted(map(tuple, sub.edge_index.T.tolist())) == [(1, 0), (2, 0)]
    # two hops: 0 and 4 join; the edges into 1 and 3 (1->2's reverse among them)
    sub = sample_subgraph(data, torch.tensor([2]), [-1, -1])
    assert sub.n_id.tolist() == [2, 1, 3, 0, 4]
    edges = {(int(sub.n_id[s]), int(sub.n_id[t])) for s, t in sub.edge_index.T.tolist()}
    assert edges == {(1, 2), (3, 2), (0, 1), (2, 1), (2, 3), (4, 3)}


def test_fanout_bounds_in_degree_and_keeps_real_edges():
    data = graph(200, 2000)
    sub = sample_subgraph(data, torch.arange(10), [3, 2], torch.Generator().manual_seed(1))
    real = set(map(tuple, data.edge_index.T.tolist()))
    sampled = [(int(sub.n_id[s]), int(sub.n_id[t])) for s, t in sub.edge_index.T.tolist()]
    assert set(sampled) <= real and len(set(sampled)) == len(sampled)
    indeg = torch.bincount(sub.edge_index[1], minlength=int(sub.num_nodes))
    assert int(indeg[:10].max()) <= 3 and int(indeg.max()) <= 3
    assert int(indeg[:10].min()) == 3  # every seed of this dense graph has >= 3 neighbours


@pytest.mark.parametrize("conv,fanout", [("gcn", (-1, -1, -1)), ("sage", (-1, -1))])
def test_one_full_fanout_batch_is_the_full_batch_step(conv, fanout):
    """Every neighbour (GCN: one hop more, for its degrees) and one batch holding every
    training node: the mini-batch step is the full-batch step, up to summation order."""
    data = graph()
    full = NodeClassifier(net(conv), SGD)
    mini = NodeClassifier(net(conv), SGD)
    mini.minibatch = MiniBatch(budget_nodes=1, batch_size=1000, fanout=fanout)
    batches = minibatches_for(mini, data)
    assert isinstance(batches, MiniBatches) and len(batches) == 1
    (b,) = list(batches)
    assert int(b.train_mask.sum()) == int(data.train_mask.sum()) == b.batch_size
    a, m = fit(full, data), fit(mini, data)
    assert mini.last_loss == pytest.approx(full.last_loss, rel=1e-6)
    for k in a:
        torch.testing.assert_close(m[k], a[k], rtol=1e-5, atol=1e-6)
    start = NodeClassifier(net(conv), SGD).state_dict()
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the step moved the weights


def test_within_the_budget_the_fit_is_bitwise_the_full_batch():
    data = graph()
    plain, set_ = NodeClassifier(net(dropout=0.5), SGD), NodeClassifier(net(dropout=0.5), SGD)
    set_.minibatch = MiniBatch(budget_nodes=data.num_nodes, batch_size=4, fanout=(2, 2))
    assert minibatches_for(set_, data) is data
    a, b = fit(plain, data, epochs=2), fit(set_, data, epochs=2)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("conv", ["gcn", "sage"])
def test_batched_inference_is_the_whole_graph(conv):
    """Full-neighbourhood inference over ``len(fanout) + 1`` hops in batches of 7 nodes: the
    logits (and a tuple of representations with a mask) of the whole graph."""
    data, model = graph(60, 200), net(conv).eval()
    setting = MiniBatch(budget_nodes=1, batch_size=4, fanout=(2, 2), inference_batch_size=7)
    with torch.no_grad():
        whole = model(data)
        torch.testing.assert_close(node_outputs(model, data, setting), whole, atol=1e-5, rtol=1e-5)

        def fn(d):
            return {"": (model.representations(d)["z"], d.train_mask)}

        z, mask = node_outputs(fn, data, setting, data.train_mask)[""]
    assert torch.equal(mask, data.train_mask)
    torch.testing.assert_close(z[mask], model.representations(data)["z"][mask], atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    assert torch.equal(z[~mask], torch.zeros_like(z[~mask]))


def test_projection_holds_at_every_mini_batch_step():
    """FedOGL Eq. (9) per step: after a fit of several mini-batch steps with Adam, the
    protected weight moved only outside the span of its basis ``U``."""
    data = graph(120, 600)
    module = NodeClassifier(net(dropout=0.5), partial(torch.optim.Adam, lr=0.05))
    module.minibatch = MiniBatch(budget_nodes=10, batch_size=8, fanout=(3, 3))
    name = "net.gnn.convs.1.lin.weight"
    u, _ = torch.linalg.qr(torch.randn(8, 3, generator=torch.Generator().manual_seed(2)))
    steps = Steps(bases={name: u})
    w0 = module.state_dict()[name].clone()
    w1 = fit(module, data, epochs=2, callbacks=[steps])[name]
    seeds = int(data.train_mask.sum())
    assert steps.steps == 2 * math.ceil(seeds / 8)
    assert (w1 - w0).abs().max() > 1e-3
    torch.testing.assert_close((w1 - w0) @ u, torch.zeros(8, 3), atol=1e-5, rtol=0)


def test_same_seed_same_weights_bitwise():
    data = graph(120, 600)

    def run(seed):
        module = NodeClassifier(net(dropout=0.5), partial(torch.optim.Adam, lr=0.01))
        module.minibatch = MiniBatch(budget_nodes=10, batch_size=16, fanout=(4, 3))
        return fit(module, data, seed, epochs=2)

    a, b, c = run(3), run(3), run(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_config_errors_name_the_key():
    assert check_minibatch(None) is None
    assert check_minibatch({"budget_nodes": 5})["fanout"] == [10, 10]
    bad = [
        ({"fanout": [10, 0]}, "federation.minibatch.fanout"),
        ({"batch_size": 0}, "federation.minibatch.batch_size"),
        ({"budget": 3}, "federation.minibatch"),
        ("yes", "federation.minibatch"),
    ]
    for value, key in bad:
        with pytest.raises(ConfigError) as e:
            check_minibatch(value)
        assert e.value.key == key


def test_validate_checks_the_composed_option(compose):
    from fedlightning.config import validate

    base = ["experiment=fl_cora", "algorithm=fedavg"]
    validate(compose([*base, "+federation.minibatch={budget_nodes: 5, fanout: [-1, 3]}"]))
    with pytest.raises(ConfigError) as e:
        validate(compose([*base, "+federation.minibatch={fanout: [10, 0]}"]))
    assert e.value.key == "federation.minibatch.fanout"


def chance_margin(classes: int, n_test: int, z: float = 4.0) -> float:
    """Chance accuracy plus ``z`` binomial standard errors over ``n_test`` test nodes."""
    p = 1.0 / classes
    return p + z * math.sqrt(p * (1 - p) / n_test)


MINI = "+federation.minibatch={budget_nodes:100,batch_size:128,fanout:[5,5]}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,classes",
    [
        (["experiment=fl_cora", "algorithm=fedavg", "federation.rounds=3"], 7),
        # the last stage knows 6 of Cora's 7 classes
        (["experiment=cil_cora", "algorithm=fedogl", "federation.rounds=2"], 6),
    ],
)
def test_cora_forced_onto_mini_batches_learns(
    tmp_env, shared_data, monkeypatch, compose, caplog, overrides, classes
):
    from fedlightning.train import train

    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    with caplog.at_level(logging.INFO, logger="fedlightning"):
        s = train(compose([*overrides, MINI, "logger=none"]), tmp_env / "run")
    assert "5 clients train by mini-batches" in caplog.text
    # Cora's 2,708 nodes, 20% test: at least 500 test nodes (fewer of a stage's classes)
    n_test = 2708 * 0.2 * classes / 7
    assert s["metrics"]["test_acc"] > chance_margin(classes, int(n_test))
    if "fedogl" in overrides[1]:  # prototypes every round, bases at every stage end
        fields = s["comm"]["fields"]
        assert any(k.startswith("proto.") for k in fields)
        assert any(k.startswith("basis.") for k in fields)
    else:  # the same seed again: the same metrics, bit for bit
        again = train(compose([*overrides, MINI, "logger=none"]), tmp_env / "again")
        assert again["metrics"] == s["metrics"]


@pytest.mark.slow
def test_trainer_executor_fits_the_same_mini_batches():
    """A ``lightning.Trainer`` (runner.executor=trainer) steps over the same mini-batches
    with the same dropout: the lean executor's weights, bit for bit."""
    from fedlightning.federation.executors import TrainerExecutor

    data = graph(120, 600)
    out = []
    for executor in (LeanExecutor(), TrainerExecutor()):
        module = NodeClassifier(net(dropout=0.5), partial(torch.optim.Adam, lr=0.01))
        module.minibatch = MiniBatch(budget_nodes=10, batch_size=16, fanout=(4, 3))
        steps = Steps()
        torch.manual_seed(7)
        executor.fit(module, data, 2, [steps])
        out.append((steps.steps, {k: v.detach().clone() for k, v in module.state_dict().items()}))
    (n_lean, lean), (n_trainer, trainer) = out
    assert n_lean == n_trainer == 2 * math.ceil(int(data.train_mask.sum()) / 16)
    assert all(torch.equal(lean[k], trainer[k]) for k in lean)
