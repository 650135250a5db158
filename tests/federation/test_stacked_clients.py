"""Stacked graph clients (``runner.stack_clients``): one fit of a round's clients over the
disjoint union of their graphs equals their fits one at a time, within the tolerance of
docs/scaling.md, and each client's slice depends on that client alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import Data

from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import Algorithm, FederatedClient
from fedlightning.federation.executors import LeanExecutor
from fedlightning.federation.ledger import unpacked
from fedlightning.federation.loop import local_fit, local_fit_share
from fedlightning.federation.stacking import (
    StackedClients,
    UnionEvaluate,
    fit_stacked,
    why_not_stacked,
)
from fedlightning.messages import ServerBroadcast
from fedlightning.methods.fedavg.fedavg import FedAvg
from fedlightning.methods.fedogl.basis import project_out
from fedlightning.methods.fedogl.projection import GradientProjection
from fedlightning.methods.fedprox.fedprox import FedProx
from fedlightning.models import MultimodalGNN, nonzero_dropout
from fedlightning.models.stacked import disjoint_union, load_copies, stack_net
from fedlightning.server.aggregate import as_model_fields
from fedlightning.train import train

# The tolerance of docs/scaling.md ("Stacked graph clients"): float32 weights after a few
# rounds agree to this (on CPU they have come out bitwise equal; a device or another
# blocking of the products may change the last bits).
RTOL, ATOL = 1e-5, 1e-6
IN_DIMS = {"text": 12, "image": 5}


def graph(n: int, seed: int, classes: int = 3) -> Data:
    """A random client subgraph with both modalities, masks and labels."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(0, n, (2, 3 * n), generator=g)
    data = Data(
        x_text=(torch.rand(n, 12, generator=g) < 0.3).float(),
        x_image=torch.randn(n, 5, generator=g),
        modality_mask=torch.rand(n, 2, generator=g) < 0.9,
        edge_index=torch.cat([e, e.flip(0)], 1),
        y=torch.randint(0, classes, (n,), generator=g),
        num_nodes=n,
    )
    data.train_mask = torch.rand(n, generator=g) < 0.6
    data.val_mask = ~data.train_mask & (torch.rand(n, generator=g) < 0.5)
    data.test_mask = ~data.train_mask & ~data.val_mask
    return data


def clients_of(sizes: list[int], sparse: bool = False) -> list[FederatedClient]:
    clients = [FederatedClient(k, graph(n, 10 + k)) for k, n in enumerate(sizes)]
    for c in clients if sparse else []:  # a sparse COO modality, as dataset.sparse_modalities
        c.data.x_text = c.data.x_text.to_sparse_coo().coalesce()
    return clients


def setup(algorithm, conv: str = "gcn", dropout: float = 0.5):
    torch.manual_seed(0)
    net = MultimodalGNN(IN_DIMS, 3, hidden=8, conv=conv, dropout=dropout)
    module = algorithm.client_module(net, partial(torch.optim.Adam, lr=0.05, weight_decay=5e-4))
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    broadcast = ServerBroadcast(round=3, tensors=as_model_fields(state))
    return net, module, broadcast


@pytest.mark.parametrize(
    ("algorithm", "conv", "sparse"),
    [(FedAvg(), "gcn", False), (FedAvg(), "sage", True), (FedProx(mu=0.5), "gcn", True)],
    ids=["fedavg-gcn", "fedavg-sage-sparse", "fedprox-gcn-sparse"],
)
def test_a_share_equals_its_clients_one_at_a_time(algorithm, conv, sparse):
    """Clients of different sizes, dropout on: the stacked updates (weights and loss) are
    each client's own fit, and torch's generator ends where the last client's fit leaves it."""
    clients = clients_of([40, 17, 63], sparse)
    algorithm.report_train_loss = True  # the loss too (federation.report_train_loss)
    _, module, broadcast = setup(algorithm, conv)
    ex = LeanExecutor()
    one = [local_fit(algorithm, module, broadcast, ex, 3, 7, c) for c in clients]
    after_one = torch.rand(4)
    stacked = local_fit_share(algorithm, module, broadcast, ex, 3, 7, clients, range(3))
    after_stacked = torch.rand(4)
    torch.testing.assert_close(after_stacked, after_one, rtol=0, atol=0)
    for a, b in zip(one, stacked, strict=True):
        assert a.client_id == b.client_id and a.scalars.keys() == b.scalars.keys()
        assert b.scalars["train_loss"] == pytest.approx(a.scalars["train_loss"], rel=RTOL)
        for name, value in a.tensors.items():
            torch.testing.assert_close(b.tensors[name], value, rtol=RTOL, atol=ATOL)
    # the clients moved apart: a stack that trained one copy for all would fail above
    assert not torch.equal(one[0].tensors["model.head.weight"], one[1].tensors["model.head.weight"])


def test_shares_of_a_round_equal_the_whole_round_stacked():
    """Ranks stack their contiguous shares (``stacked`` in round.py): any split of the round
    gives every client bitwise the update the whole round's stack gives it."""
    clients = clients_of([30, 22, 41, 18, 35])
    algorithm = FedAvg()
    _, module, broadcast = setup(algorithm)
    ex = LeanExecutor()
    whole = local_fit_share(algorithm, module, broadcast, ex, 2, 1, clients, range(5))
    parts = [
        local_fit_share(algorithm, module, broadcast, ex, 2, 1, clients, r)
        for r in (range(0, 2), range(2, 5))
    ]
    for a, b in zip(whole, [u for p in parts for u in p], strict=True):
        assert a.client_id == b.client_id
        for name, value in a.tensors.items():
            assert torch.equal(b.tensors[name], value), name


def test_a_client_slice_depends_on_that_client_alone():
    """The gradient of copy 0 is client 0's gradient on its own graph: it does not move when
    client 1's features, labels or weights change, and the loss is the sum of the clients'
    mean losses (a mean over the union would scale it by the client's share of nodes)."""
    algorithm = FedAvg()
    net, module, _ = setup(algorithm, dropout=0.0)
    graphs = [graph(30, 1), graph(50, 2)]

    def grads(gs, w1_shift: float = 0.0):
        stack, seg = stack_net(net, 2)
        state = dict(net.state_dict())
        other = {k: v + w1_shift for k, v in state.items()}
        load_copies(stack, [state, other])
        union, seg.ptr = disjoint_union(gs)
        loss = StackedClients(module, stack, seg).training_step(union)
        loss.backward()
        return {n: p.grad[0].clone() for n, p in stack.named_parameters()}, loss

    base, loss = grads(graphs)
    changed = graph(50, 99)
    moved, _ = grads([graphs[0], changed], w1_shift=0.3)
    for name, g in base.items():
        assert torch.equal(moved[name], g), name
    net.zero_grad()
    own = module.objective(net(graphs[0]), graphs[0])
    own.backward()
    for name, p in net.named_parameters():
        torch.testing.assert_close(base[name], p.grad, rtol=RTOL, atol=ATOL)
    second = module.objective(net(graphs[1]), graphs[1])
    assert float(loss.detach()) == pytest.approx(
        float(own.detach()) + float(second.detach()), rel=RTOL
    )


def test_projection_acts_on_every_client_slice():
    """Eq. (9) on a stacked weight ``[K, out, in]`` is Eq. (9) on each copy."""
    u, _ = torch.linalg.qr(torch.randn(6, 2))
    proj = GradientProjection({"w": u})
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.randn(3, 4, 6))
    module.w.grad = torch.randn(3, 4, 6)
    expected = torch.stack([project_out(g, u) for g in module.w.grad])
    proj.on_fit_start(None, module)
    proj.on_after_backward(None, module)
    torch.testing.assert_close(module.w.grad, expected)
    assert (module.w.grad @ u).abs().max() < 1e-5


@pytest.mark.parametrize("density", [0.05, 0.9])
def test_input_dropout_into_a_buffer_draws_the_same(density):
    """``nonzero_dropout(out=...)`` (a stack writes each client's rows into one buffer) gives
    the values and the random draws of the plain call, on either of its dense paths."""
    x = (torch.rand(30, 40) < density).float() * torch.randn(30, 40)
    torch.manual_seed(3)
    plain = nonzero_dropout(x, 0.5)
    after = torch.rand(3)
    torch.manual_seed(3)
    buffer = torch.full((60, 40), 7.0)
    written = nonzero_dropout(x, 0.5, out=buffer[10:40])
    assert torch.equal(written, plain) and torch.equal(buffer[10:40], plain)
    assert torch.equal(torch.rand(3), after)
    assert bool((buffer[:10] == 7).all() and (buffer[40:] == 7).all())


def test_planned_input_dropout_draws_what_each_client_draws_alone():
    """The stack's input dropout keeps each client's non-zero positions and a buffer between
    steps and rounds (:meth:`Segments.input_plan`): every step still gives each client's
    rows the values and draws of ``nonzero_dropout`` in that client's own fit, for sparse
    and dense clients; a client tensor changed in place is planned anew, and an unchanged
    round of graphs reuses its union."""
    from fedlightning.models import InputDropout
    from fedlightning.models.stacked import SegmentDropout, Segments, seeded_streams

    def words(n: int, density: float, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return (torch.rand(n, 50, generator=g) < density).float() * torch.rand(n, 50, generator=g)

    graphs = [
        Data(x_w=words(n, d, i), num_nodes=n)
        for i, (n, d) in enumerate([(30, 0.05), (20, 0.9), (25, 0.1)])
    ]
    seeds = [11, 12, 13]
    segments = Segments(3)
    drop = SegmentDropout(InputDropout(0.5), segments)
    expected_streams = [None] * 3
    for round_ in range(2):
        if round_ == 1:
            graphs[2].x_w.mul_(3.0)  # in place: the plan and the union must follow
        union = segments.bind(graphs)
        assert segments.bind(graphs) is union  # unchanged: the same union
        segments.streams = seeded_streams(seeds)
        for k, s in enumerate(seeds):
            torch.manual_seed(s)
            expected_streams[k] = [nonzero_dropout(graphs[k].x_w, 0.5) for _ in range(3)]
        got = [drop(union.x_w).clone() for _ in range(3)]
        for step in range(3):
            for k, (_, a, b) in enumerate(segments.ranges()):
                assert torch.equal(got[step][a:b], expected_streams[k][step]), (round_, step, k)
    assert segments.input_plan(union.x_w, drop.max_density) is not None
    assert segments.input_plan(union.x_w.clone(), drop.max_density) is None  # not the union's
    graphs[0].x_w = graphs[0].x_w.clone()  # a replaced tensor: a new union
    assert segments.bind(graphs) is not union


@pytest.mark.parametrize("bias", [True, False])
def test_segment_layers_make_each_clients_own_products_bitwise(bias):
    """A stacked linear layer, a GCN bias and a hidden dropout write each client's rows into
    one output (no concatenation): outputs, gradients (weights, biases, input) and dropout
    draws are bitwise those of each client's own ``nn.Linear``/``nn.Dropout`` on its rows.
    Rows of 16 float32 values keep every block 64-byte aligned, as a client's own tensor is
    (a block at another alignment may take another kernel path: docs/scaling.md)."""
    from fedlightning.models.stacked import (
        SegmentDropout,
        SegmentLinear,
        Segments,
        seeded_streams,
        segment_add,
    )

    sizes, seeds = [7, 0, 12, 5], [21, 22, 23, 24]
    segments = Segments(len(sizes))
    segments.ptr = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    torch.manual_seed(0)
    linears = [torch.nn.Linear(16, 16, bias=bias) for _ in sizes]
    adds = [torch.randn(16, requires_grad=True) for _ in sizes]
    stack = SegmentLinear(linears[0], segments)
    with torch.no_grad():
        stack.weight.copy_(torch.stack([m.weight for m in linears]))
        if bias:
            stack.bias.copy_(torch.stack([m.bias for m in linears]))
    add = torch.stack([a.detach() for a in adds]).requires_grad_()
    drop = SegmentDropout(torch.nn.Dropout(0.4), segments)
    x = torch.randn(sum(sizes), 16, requires_grad=True)
    upstream = torch.randn(sum(sizes), 16)

    segments.streams = seeded_streams(seeds)
    out = drop(segment_add(stack(x), add, segments))
    (out * upstream).sum().backward()

    xs = [x.detach()[a:b].clone().requires_grad_() for _, a, b in segments.ranges()]
    for k, (_, a, b) in enumerate(segments.ranges()):
        torch.manual_seed(seeds[k])
        own = torch.nn.functional.dropout(linears[k](xs[k]) + adds[k], 0.4)
        (own * upstream[a:b]).sum().backward()
        assert torch.equal(out[a:b], own), k
        assert torch.equal(x.grad[a:b], xs[k].grad), k
        assert torch.equal(stack.weight.grad[k], linears[k].weight.grad), k
        assert torch.equal(add.grad[k], adds[k].grad), k
        if bias:
            assert torch.equal(stack.bias.grad[k], linears[k].bias.grad), k
        assert torch.equal(segments.streams[k]["cpu"], torch.get_rng_state()), k


def test_union_evaluation_equals_per_client_evaluation():
    clients = clients_of([40, 17, 63])
    net, module, _ = setup(FedAvg())
    state = dict(net.state_dict())
    union = UnionEvaluate(module, state, clients)
    for c in clients:
        module.receive(state)
        assert union(c) == module.evaluate(c.data)


@pytest.mark.parametrize("conv", ["gcn", "sage"])
def test_outputs_after_a_stacked_fit_are_each_clients_own(conv):
    """``StackedFit.outputs``: one eval-mode pass of the fitted stack gives each client what
    its own fitted net gives on its own batch (FedOGL's descriptors of Eq. (11))."""
    clients = clients_of([40, 17, 63])
    _, module, _ = setup(FedAvg(), conv)
    batches = [c.data for c in clients]
    fitted = fit_stacked(module, batches, LeanExecutor(), 2, [], [5, 6, 7])
    assert fitted.net.training
    outs = fitted.outputs(lambda net, b: (net.representations(b)["z"], net(b)))
    assert fitted.net.training  # its mode is given back
    for k, batch in enumerate(batches):
        fitted.load(module, k).net.eval()
        with torch.no_grad():
            z, logits = module.net.representations(batch)["z"], module.net(batch)
        assert outs[k][0].shape == z.shape and outs[k][1].shape == logits.shape
        torch.testing.assert_close(outs[k][0], z, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(outs[k][1], logits, rtol=RTOL, atol=ATOL)
    head = dict(fitted.net.named_parameters())["head.weight"]
    assert not torch.equal(head[0], head[1])  # three fitted models, not one


def test_an_optimizer_that_is_not_elementwise_is_refused():
    net, module, _ = setup(FedAvg())
    module.optimizer_factory = partial(torch.optim.LBFGS, lr=0.1)
    with pytest.raises(ConfigError, match="runner.stack_clients"):
        fit_stacked(module, [graph(10, 0), graph(12, 1)], LeanExecutor(), 1, [], [0, 1])


def test_what_cannot_stack_fits_one_at_a_time():
    """The loop stacks only what stacks exactly; anything else says why and fits one by one."""
    from fedlightning.clients.continual_retrieval import ContinualRetrievalClient
    from fedlightning.methods.continual.retrieval_baselines import ContinualRetrieval

    algorithm = FedAvg()
    net, module, _ = setup(algorithm)
    assert why_not_stacked(algorithm, module) == ""
    assert ContinualRetrievalClient.stackable is False  # its own training_step
    assert "no local_fit_share" in why_not_stacked(Algorithm(), module)
    lbfgs = algorithm.client_module(net, partial(torch.optim.LBFGS, lr=0.1))
    assert "LBFGS is not an elementwise" in why_not_stacked(algorithm, lbfgs)
    bn = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    assert "buffers" in why_not_stacked(algorithm, algorithm.client_module(bn, torch.optim.SGD))
    assert ContinualRetrieval.local_fit_share is not None  # inherited, but its client says no


def test_overriding_local_fit_alone_never_runs_the_inherited_share():
    """A method that changes one client's fit but not its stacked form fits one at a time
    (the inherited share would silently run FedAvg's fit); one that changes the message
    only (``make_update``, which the share calls too) still stacks."""

    class OwnFit(FedAvg):
        def local_fit(self, module, client, broadcast, executor, epochs):
            return super().local_fit(module, client, broadcast, executor, epochs)

    class OwnMessage(FedAvg):
        def make_update(self, module, client, round):
            return super().make_update(module, client, round)

    class OwnBoth(OwnFit):
        def local_fit_share(self, *args):
            return super().local_fit_share(*args)

    _, module, _ = setup(FedAvg())
    assert why_not_stacked(OwnFit(), module) == "OwnFit overrides local_fit but not local_fit_share"
    assert why_not_stacked(OwnMessage(), module) == ""
    assert why_not_stacked(OwnBoth(), module) == ""


@pytest.fixture
def stacked_steps(monkeypatch) -> list[int]:
    """Counts the clients of every stacked training step (so a run that quietly fell back to
    one at a time cannot pass for a stacked one)."""
    seen: list[int] = []
    step = StackedClients.training_step

    def counted(self, batch, batch_idx=0):
        seen.append(self.segments.copies)
        return step(self, batch, batch_idx)

    monkeypatch.setattr(StackedClients, "training_step", counted)
    return seen


def run(compose, tmp_path, name: str, overrides: list[str]) -> tuple[dict, dict]:
    cfg = compose(
        [
            "logger=none",
            "threads=1",
            "runner.progress=false",
            "federation.report_train_loss=true",
            *overrides,
        ]
    )
    summary = train(cfg, tmp_path / name)
    checkpoint = torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)
    history = json.loads((tmp_path / name / "history.json").read_text())
    return summary | {"history": history}, checkpoint["server"]


def assert_same_run(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (sa, server_a), (sb, server_b) = a, b
    for k, v in sa["metrics"].items():
        if isinstance(v, float):
            assert sb["metrics"][k] == pytest.approx(v, rel=RTOL, abs=ATOL, nan_ok=True), k
    for ha, hb in zip(sa["history"], sb["history"], strict=True):
        assert hb["train_loss"] == pytest.approx(ha["train_loss"], rel=RTOL)
        assert hb["test_acc"] == pytest.approx(ha["test_acc"], abs=ATOL)
    assert sa["comm"] == sb["comm"]
    assert server_a["global_state"].keys() == server_b["global_state"].keys()
    # the global model and every server module's memory (FedOGL's bases and prototypes)
    torch.testing.assert_close(server_b, server_a, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "overrides",
    [
        ["experiment=fl_synthetic", "algorithm=fedavg", "federation.rounds=2"],
        [
            "experiment=fl_synthetic",
            "algorithm=fedavg",
            "algorithm=fedprox",
            "federation.rounds=2",
            "federation.participation=0.6",
        ],
        ["experiment=demo", "federation.rounds=1", "federation.local_epochs=3"],
        ["experiment=demo", "federation.rounds=2", "federation.participation=0.6"],
        [
            "experiment=demo",
            "algorithm=cil_fediih",
            "model=disentangled_gnn",
            "federation.rounds=1",
        ],
    ],
    ids=["fedavg", "fedprox_partial", "fedogl_cil", "fedogl_cil_partial", "fediih_personal"],
)
def test_stacked_run_equals_one_at_a_time(tmp_env, compose, overrides, stacked_steps):
    """Whole runs: metrics, messages and final global weights (FedOGL: with its stage-end
    bases, so the later stages fit under gradient projection; FedIIH: personalized, each
    client's copy starts from its own model with its factor blocks over it)."""
    one = run(compose, tmp_env, "one", [*overrides, "runner.stack_clients=false"])
    assert stacked_steps == []
    stacked = run(compose, tmp_env, "stacked", [*overrides, "runner.stack_clients=true"])
    assert stacked_steps and max(stacked_steps) > 1  # several clients per step
    assert_same_run(one, stacked)
    fedogl = "experiment=demo" in overrides and not any(
        o.startswith("algorithm=") for o in overrides
    )
    if fedogl:  # stages 2 and 3 fitted under Eq. (9)'s projection
        assert stacked[1]["modules"]["basis"]["bases"]


@pytest.mark.realdata
def test_stacked_cora_equals_one_at_a_time(
    tmp_env, compose, shared_data, monkeypatch, stacked_steps
):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    overrides = [
        "experiment=fl_cora",
        "algorithm=fedavg",
        "federation.rounds=2",
        "federation.local_epochs=2",
    ]
    one = run(compose, tmp_env, "one", [*overrides, "runner.stack_clients=false"])
    stacked = run(compose, tmp_env, "stacked", [*overrides, "runner.stack_clients=true"])
    assert stacked_steps == [5] * 4  # 2 rounds x 2 epochs, the 5 clients at once
    assert_same_run(one, stacked)


def same(a, b) -> bool:
    """Exact equality of nested checkpoint contents."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return bool(a == b)


@pytest.mark.slow
def test_two_gloo_ranks_stacking_their_shares_equal_the_sequential_run(tmp_env, compose):
    """FedOGL (teacher, replay, projection, prototypes), 5 clients on 2 ranks: rank 0 stacks
    2 clients, rank 1 stacks 3; the run is bitwise the sequential one-at-a-time run (server,
    every client's state, the RNG after the last fit)."""
    overrides = ["experiment=demo", "federation.rounds=1", "federation.local_epochs=2"]
    overrides += ["threads=1", "logger=none", "runner.progress=false"]
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "FEDLIGHTNING_CACHE": str(tmp_env / "cache"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = [*overrides, "runner=distributed", "runner.stack_clients=true", "hydra.run.dir=dist"]
    r = subprocess.run(
        [*cmd, "-m", "fedlightning", "train", *args],
        cwd=tmp_env,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    train(compose([*overrides, "runner.stack_clients=false"]), tmp_env / "seq", verbose=False)
    dist = torch.load(tmp_env / "dist" / "checkpoint.pt", weights_only=False)
    seq = torch.load(tmp_env / "seq" / "checkpoint.pt", weights_only=False)
    for c in (dist, seq):  # the entries, however they were pickled
        c["ledger"] = unpacked(c["ledger"])
    for key in ("server", "clients", "ledger", "rng"):
        assert same(dist[key], seq[key]), key
