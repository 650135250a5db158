"""FedGNN and FedLink on FedTIP's protocol: their equations against hand computations, the
mechanisms that define them, and end to end on the synthetic stream (uplink by hand,
resume, protocol-hash refusal)."""

import json
import shutil

import numpy as np
import pytest
import torch

from fedlightning.clients.temporal_prompt import score_segment as evaluate
from fedlightning.errors import FedLightningError, RunStopped
from fedlightning.messages import ClientUpdate
from fedlightning.methods.fedgnn.fedgnn import FedGNN
from fedlightning.methods.fedgnn.fedgnn_client import FedGNNClient
from fedlightning.methods.fedgnn.fedgnn_model import (
    FedGNNModel,
    HistoryGraph,
    RowMean,
    ScoreView,
    clip_norm,
    laplace,
    ldp_scale,
    ldp_update,
    mse_link_loss,
    pseudo_items,
    scored_segment,
)
from fedlightning.methods.fedgnn.fedgnn_server import row_mean_update, row_upload_problem
from fedlightning.methods.fedlink.fedlink import FedLink
from fedlightning.methods.fedlink.fedlink_model import (
    FedLinkModel,
    bce_link_loss,
    chronological_buffers,
)
from fedlightning.metrics.temporal import auroc
from fedlightning.train import train
from tests.integration.test_learning import TIP_SUPPORT, margin
from tests.integration.test_learning import UNTRAINED_FEDTIP as UNTRAINED


def tiny_graph(users=3, items=20, d=4) -> HistoryGraph:
    eu = np.array([0, 0, 1, 2, 2, 2])
    ei = np.array([1, 2, 2, 3, 4, 4])
    torch.manual_seed(0)
    return HistoryGraph(
        np.arange(users), np.arange(users, users + items),
        np.concatenate([np.arange(users), -np.ones(items, np.int64)]),
        np.concatenate([-np.ones(users, np.int64), np.arange(items)]),
        eu, ei, np.array([0, 0, 1, 0, 0, 0]),
        torch.randn(users, d), torch.randn(items, d), "h",
    )  # fmt: skip


# ---------------------------------------------------------------- equations, by hand
def test_ldp_scale_and_laplace_noise_match_clip_lr_and_epsilon():
    assert ldp_scale(0.01, 0.1, 1.0) == pytest.approx(0.002)  # 2 * 0.1 * 0.01 / 1
    assert ldp_scale(0.01, 0.1, 0.5) == pytest.approx(0.004)
    x = laplace((200_000,), 0.5, torch.Generator().manual_seed(1)).double()
    assert x.mean().item() == pytest.approx(0.0, abs=0.01)
    assert x.abs().mean().item() == pytest.approx(0.5, rel=0.01)  # E|X| = b
    noisy = ldp_update(torch.zeros(100_000), 0.01, 0.1, 1.0, torch.Generator().manual_seed(2))
    assert noisy.abs().mean().item() == pytest.approx(0.002, rel=0.02)
    assert torch.equal(ldp_update(torch.ones(3), 0.01, 0.1, 0.0, None), torch.ones(3))


def test_clip_norm_by_hand():
    assert torch.allclose(clip_norm(torch.tensor([3.0, 4.0]), 1.0), torch.tensor([0.6, 0.8]))
    assert torch.equal(clip_norm(torch.tensor([0.03, 0.04]), 1.0), torch.tensor([0.03, 0.04]))


def test_pseudo_items_avoid_the_touched_ones():
    g = torch.Generator().manual_seed(3)
    touched = torch.tensor([1, 4, 7])
    fake = pseudo_items(touched, 10, 4, g)
    assert len(fake) == 4 and not set(fake.tolist()) & {1, 4, 7}
    assert len(pseudo_items(touched, 10, 100, g)) == 7  # at most every untouched row


def test_row_mean_update_by_hand():
    table = torch.zeros(3, 2)
    rows = [torch.tensor([0, 1]), torch.tensor([1])]
    deltas = [torch.tensor([[1.0, 1.0], [2.0, 0.0]]), torch.tensor([[4.0, 6.0]])]
    out = row_mean_update(table, rows, deltas, [1.0, 3.0])
    assert torch.allclose(out[0], torch.tensor([1.0, 1.0]))
    assert torch.allclose(out[1], torch.tensor([(2 + 12) / 4, 18 / 4]))  # weighted by 1 and 3
    assert torch.equal(out[2], torch.zeros(2))  # nobody sent it


def test_row_uploads_are_screened_before_they_touch_a_table():
    def up(idx, rows, **more):
        tensors = {"items.idx": torch.tensor(idx), "items.delta": torch.zeros(rows, 2), **more}
        return ClientUpdate(round=1, client_id=0, tensors=tensors)

    assert row_upload_problem(up([0, 3], 2), "items", 4) is None
    assert row_upload_problem(up([0, 3], 1), "items", 4) == "items.delta: 1 rows for 2 items.idx"
    assert row_upload_problem(up([0, 4], 2), "items", 4) == "items.idx: rows must lie in 0..3"
    assert row_upload_problem(up([1, 1], 2), "items", 4) == "items.idx: a row sent twice"
    bad = up([0], 1, **{"expansion.idx": torch.tensor([-1])})
    assert row_upload_problem(bad, "items", 4) is None  # not checked unless named
    assert row_upload_problem(bad, "items", 4, also=("expansion.idx",)) == (
        "expansion.idx: rows must lie in 0..3"
    )


def test_row_mean_adjacency_by_hand():
    a = RowMean(np.array([0, 0, 2, 0]), np.array([1, 2, 0, 1]), (3, 3)).all().to_dense()
    want = torch.tensor([[0, 2 / 3, 1 / 3], [0, 0, 0], [1, 0, 0]])
    assert torch.allclose(a, want)


def test_losses_by_hand():
    pos, neg, ok = torch.tensor([0.5, 2.0]), torch.tensor([1.0, -1.0]), torch.tensor([True, False])
    assert mse_link_loss(pos, neg, ok).item() == pytest.approx((0.25 + 1.0) / 2)
    want = -(np.log(1 / (1 + np.exp(-0.5))) + np.log(1 - 1 / (1 + np.exp(-1.0)))) / 2
    assert bce_link_loss(pos, neg, ok).item() == pytest.approx(want, rel=1e-6)


def test_chronological_buffers():
    assert [b.tolist() for b in chronological_buffers(5, 2)] == [[0, 1], [2, 3], [4]]


def test_the_score_view_gives_the_scores_auc():
    """The task loop's server-side AUC of a baseline's scores is the AUC of the scores."""
    n = 50
    gen = torch.Generator().manual_seed(4)
    pos, neg = torch.randn(n, generator=gen) * 30 + 1, torch.randn(n, generator=gen) * 30
    batch = {"mask": torch.ones(1, n, dtype=torch.bool), "neg_ok": torch.ones(1, n, dtype=torch.bool),
             "inductive": torch.zeros(1, n, dtype=torch.bool), "h_u": torch.zeros(1, n, 2),
             "te": torch.zeros(1, n, 1), "x": torch.zeros(1, n, 0), "r_u": torch.zeros(1, n),
             "y": (torch.rand(1, n, generator=gen) > 0.5).long()}  # fmt: skip
    out = evaluate(ScoreView(), {}, scored_segment(batch, pos, neg), "lp")
    want = auroc(torch.cat([pos, neg]), torch.cat([torch.ones(n), torch.zeros(n)]))
    assert out["auc_tlp"] == pytest.approx(want, abs=1e-12)
    out = evaluate(ScoreView(), ScoreView.prototypes(), scored_segment(batch, pos, None), "nc")
    assert out["auc_nc"] == pytest.approx(auroc(pos, batch["y"][0]), abs=1e-12)


# ---------------------------------------------------------------- mechanisms
def test_fedgnn_upload_carries_pseudo_items_and_laplace_noise_of_its_scale():
    """Removing the pseudo-items or the noise fails this: the upload's rows are the touched
    items plus exactly ``pseudo_items`` others with fake (non-zero) updates, and a fit that
    changed nothing still uploads Laplace noise of scale 2 * clip * lr / epsilon."""
    g = tiny_graph(d=32)  # 4,160 dense values: the mean |noise| within 4 standard errors
    torch.manual_seed(0)
    model = FedGNNModel(g)
    module = FedGNNClient(model, "lp", lr=0.01, clip=0.1)
    alg = FedGNN(pseudo_items=5, lr=0.01, ldp_clip=0.1, epsilon=1.0)
    alg.graph = g
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    with torch.no_grad():  # a "fit" that moved two touched item rows
        model.items[[1, 2]] += 0.05
    batch = {"u": torch.tensor([0]), "i": torch.tensor([2]), "j": torch.tensor([9]),
             "ok": torch.tensor([True]), "h_u": torch.zeros(1, 32), "y": torch.zeros(1)}  # fmt: skip
    u = alg.upload(module, batch, start, 1, 0, torch.Generator().manual_seed(5))
    touched = {1, 2, 9}  # user 0's history items 1, 2; the event's 2; its negative 9
    assert set(u.tensors["expansion.idx"].tolist()) == touched
    rows = u.tensors["items.idx"].tolist()
    assert len(rows) == len(touched) + 5 and touched < set(rows)
    fake = [r for r in rows if r not in touched]
    scale = ldp_scale(0.01, 0.1, 1.0)
    delta = u.tensors["items.delta"]
    assert all(delta[rows.index(r)].abs().max() > 0 for r in fake)
    dense = u.tensors["dense"]  # nothing moved: pure noise
    assert dense.abs().mean().item() == pytest.approx(scale, rel=0.065)
    off = FedGNN(pseudo_items=0, epsilon=0.0)
    off.graph = g
    quiet = off.upload(module, batch, start, 2, 0, torch.Generator().manual_seed(5))
    assert set(quiet.tensors["items.idx"].tolist()) == touched
    assert torch.equal(quiet.tensors["dense"], torch.zeros_like(dense))


def test_fedlink_buffers_see_only_earlier_support_and_start_from_the_bank():
    g = tiny_graph()
    model = FedLinkModel(g)
    assert torch.equal(model.users, g.user_state) and torch.equal(model.items, g.item_state)
    alg = FedLink(buffer_size=2)
    alg.graph, alg.protocol_owner = g, np.array([0, 1, 0] + [-1] * 20)

    class Stream:  # support events 0..3: (user 0, item 5), (2, 6), (0, 7), (2, 8)
        src = np.array([0, 2, 0, 2])
        dst = np.array([3 + 5, 3 + 6, 3 + 7, 3 + 8])

    alg.stream = Stream
    batch = {"events": torch.arange(4), "neg_id": torch.tensor([3, 3, 3, 3]),
             "neg_ok": torch.ones(4, dtype=torch.bool), "h_u": torch.zeros(4, 4),
             "y": torch.zeros(4, dtype=torch.long)}  # fmt: skip
    rows, bufs = alg.client_buffers(0, batch)
    assert rows.tolist() == [0, 2] and len(bufs) == 2
    # buffer 1's graph: the history of users 0, 2 plus events 0, 1 (items 5, 6), not 2, 3
    seen = lambda b: set(b["a_ui"].coalesce().indices()[1].tolist())  # noqa: E731
    assert seen(bufs[0]) == {1, 2, 3, 4}
    assert seen(bufs[1]) == {1, 2, 3, 4, 5, 6}


# ---------------------------------------------------------------- end to end
SMALL = [
    "protocol.tasks.num_tasks=2",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
    "threads=1",
]


def touched_items(stream, manifest, events, negs, family):
    """Item rows a client's fit reads, from the stream alone: its users' history items
    and, for link prediction, its events' items and negatives."""
    items = np.unique(stream.dst)
    hist = np.flatnonzero(np.isin(np.asarray(manifest["outcome"]), [0, 1]))
    users = set(stream.src[events].tolist())
    nodes = {int(stream.dst[e]) for e in hist if int(stream.src[e]) in users}
    if family == "lp":
        nodes |= set(stream.dst[events].tolist()) | {int(j) for j in negs if j >= 0}
    return len(np.intersect1d(items, list(nodes)))


def test_fedgnn_synthetic_uplink_by_hand_and_pseudo_items_in_the_ledger(env, compose):
    from fedlightning.data.temporal import make_synthetic_stream

    over = ["experiment=temporal_synthetic", "algorithm=fedgnn", *SMALL, "algorithm.pseudo_items=5"]
    s = train(compose(over), env / "a", verbose=False)
    assert s["tags"]["method"] == "fedgnn" and s["hashes"]["history_graph"]
    assert not np.isnan(s["metrics"]["auc_tlp"]) and not np.isnan(s["metrics"]["auc_nc"])
    stream = make_synthetic_stream(num_events=20000, seed=2026)
    manifest = json.loads((env / "a" / "manifest.json").read_text())
    tasks = json.loads((env / "a" / "tasks.json").read_text())["tasks"]
    negatives = json.loads((env / "a" / "negatives.json").read_text())
    negs = negatives["tasks"][negatives["mode"]]
    d, total, fakes = 64, 0, 0
    for t in tasks:
        events_sorted = sorted(e for ev in t["support"].values() for e in ev)
        neg_of = dict(zip(events_sorted, negs[str(t["task"])], strict=True))
        for events in t["support"].values():
            for fam, dense in (("nc", 2 * d * d + 2 * d + 1), ("lp", 2 * (2 * d * d + d))):
                n = touched_items(stream, manifest, events, [neg_of[e] for e in events], fam)
                rows = min(n + 5, 50)
                fakes += rows - n  # five pseudo-items, or every untouched row
                total += 2 * (dense + rows * (d + 1) + 1) + n  # + round 1's expansion ids
    assert s["comm"]["uplink_values"] == total
    fields = s["comm"]["fields"]
    pseudo = sum(fields[f"{f}/items.idx"]["up"] for f in ("nc", "lp")) / 2  # per round
    assert pseudo - sum(fields[f"{f}/expansion.idx"]["up"] for f in ("nc", "lp")) == fakes > 0


def test_fedlink_synthetic_uplink_by_hand(env, compose):
    s = train(
        compose(["experiment=temporal_synthetic", "algorithm=fedlink", *SMALL]),
        env / "b",
        verbose=False,
    )
    assert s["tags"]["method"] == "fedlink"
    assert not np.isnan(s["metrics"]["auc_tlp"])
    owner = np.asarray(json.loads((env / "b" / "ownership.json").read_text())["owner"])
    tasks = json.loads((env / "b" / "tasks.json").read_text())["tasks"]
    d, items, total = 64, 50, 0
    gnn = 2 * 2 * (2 * d * d + d)
    for t in tasks:
        for k in t["support"]:
            users = int((owner == int(k)).sum())
            for dense in (gnn + d + 1, gnn):
                total += 2 * (dense + items * d + users * (d + 1) + 1)
    assert s["comm"]["uplink_values"] == total


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedgnn_synthetic", "fedlink_synthetic"])
def test_baseline_resumes_at_the_next_task_and_refuses_a_changed_protocol(name, env, compose):
    over = [
        "experiment=temporal_synthetic",
        f"algorithm={name.removesuffix('_synthetic')}",
        *SMALL,
        "federation.rounds=1",
        "federation.local_epochs=1",
    ]
    straight = train(compose(over), env / "straight", verbose=False)

    def stop(kind, step, metrics):
        if step == 1:
            raise RunStopped("stopped after task 1")

    with pytest.raises(RunStopped):
        train(compose(over), env / "cut", observe=stop, verbose=False)
    again = env / "again"
    shutil.copytree(env / "cut", again)  # the stopped run, once more: resumed below, refused
    resumed = train(compose([f"resume={env / 'cut'}"]), env / "x", verbose=False)
    assert resumed["resumed"] and resumed["metrics"] == straight["metrics"]
    assert resumed["comm"]["uplink_values"] == straight["comm"]["uplink_values"]
    saved = json.loads((again / "protocol.json").read_text())
    saved["hashes"]["tasks"] = "0" * 16
    (again / "protocol.json").write_text(json.dumps(saved))
    with pytest.raises(FedLightningError, match="refusing to resume"):
        train(compose([*over, f"resume={again}"]), env / "y")


def test_flower_is_refused_before_any_training(tmp_env, compose):
    from fedlightning.errors import ConfigError

    for name in ("fedgnn_synthetic", "fedlink_synthetic"):
        cfg = compose(
            [
                "experiment=temporal_synthetic",
                f"algorithm={name.removesuffix('_synthetic')}",
                "runner=flower",
                "logger=none",
            ]
        )
        with pytest.raises(ConfigError, match="runner=flower cannot run"):
            train(cfg, tmp_env / name, verbose=False)
        assert not (tmp_env / name).exists()  # refused before a run directory exists


# ---------------------------------------------------------------- learning
LEARN = [  # FedTIP's learning setting: 3 tasks
    "protocol.tasks.num_tasks=3",
    *TIP_SUPPORT,
    "families=[lp]",
    "logger=none",
    "runner.progress=false",
]
FIRST_TASK = "max_tasks=1"  # the first of LEARN's 3 tasks (a task is scored on every test event)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, shared_cache):
    """``pairs(name)``: the method at R=20 x E=5 and its untrained self (one round, one step
    at lr 1e-12: SGD's and Adam's steps are then below float32's resolution of every
    weight) on the first task of LEARN's manifest, each run once per module."""
    from tests.conftest import compose_cfg

    done: dict[str, tuple[dict, dict]] = {}

    def get(name: str) -> tuple[dict, dict]:
        if name not in done:
            root = tmp_path_factory.mktemp(name)
            over = [
                "experiment=temporal_synthetic",
                f"algorithm={name.removesuffix('_synthetic')}",
                *LEARN,
                FIRST_TASK,
            ]
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("FEDLIGHTNING_CACHE", str(shared_cache))
                trained = train(
                    compose_cfg([*over, "federation.rounds=20", "federation.local_epochs=5"]),
                    root / "trained",
                    verbose=False,
                )
                untrained = train(
                    compose_cfg([*over, *UNTRAINED]), root / "untrained", verbose=False
                )
            done[name] = (trained, untrained)
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedgnn_synthetic", "fedlink_synthetic"])
def test_baseline_link_prediction_beats_its_untrained_self(name, pairs):
    """auc_tlp over every test event (n: the test events), on the first task. Measured
    (seed 2026): FedGNN 0.5441 vs 0.4728 (margin 0.0265), at the paper's SGD lr 0.01 and
    clip 0.1; FedLink 0.6534 vs 0.5847 (margin 0.0261); over all 3 tasks (3x the time),
    FedGNN 0.5384 vs 0.4819, FedLink 0.655 vs 0.5332. I-LP (n: the inductive test events,
    margin ~0.049): FedGNN 0.4638 vs 0.3979 (over the margin by 0.017, over the 3 tasks by
    0.001: not asserted), FedLink 0.4386 vs 0.6163 (it gets worse:
    :func:`test_fedlink_inductive_link_prediction_does_not_learn`)."""
    trained, untrained = pairs(name)
    a0, a1, n = (
        untrained["metrics"]["auc_tlp"],
        trained["metrics"]["auc_tlp"],
        trained["table"]["test"],
    )
    assert a1 > a0 + margin(a0, n), (a0, a1, n)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="measured: FedLink's I-LP falls from 0.6163 to 0.4386 (margin 0.0483): an "
    "inductive node has no history edge and one shared bank state as its ID embedding, so "
    "training the seen nodes' rows and items ranks the seen negatives above the new "
    "positives (docs/fedtip.md, FedLink); strict, so the day it learns this test says so",
)
def test_fedlink_inductive_link_prediction_does_not_learn(pairs):
    trained, untrained = pairs("fedlink_synthetic")
    a0, a1 = untrained["metrics"]["auc_ilp"], trained["metrics"]["auc_ilp"]
    n = trained["table"]["ind_test"]
    assert a1 > a0 + margin(a0, n), (a0, a1, n)


# ---------------------------------------------------------------- real data
REAL = [
    "max_tasks=1",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=3000",
    "logger=none",
    "runner.progress=false",
]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedgnn", "fedlink"])
@pytest.mark.parametrize("data, families", [("bitcoin_alpha", ["nc", "lp"]), ("wikipedia", ["lp"])])
def test_baseline_on_real_data(method, data, families, env, compose, shared_data, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    s = train(
        compose([f"experiment=temporal_{data}", f"algorithm={method}", *REAL]),
        env / "r",
        verbose=False,
    )
    assert s["families"] == families and s["tasks_done"] == 1
    assert s["tags"]["method"] == method and s["hashes"]["history_graph"]
    keys = ["auc_tlp", "auc_ilp"] + (["auc_nc"] if "nc" in families else [])
    assert all(0.0 <= s["metrics"][k] <= 1.0 for k in keys), s["metrics"]
    assert s["comm"]["uplink_values"] > 0


# ---------------------------------------------------------------- distributed
DIST = [  # 2 tasks of 5 clients: rank 0 fits 2 of a round's clients, rank 1 3
    "dataset.num_events=5000",
    "protocol.tasks.num_tasks=2",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedgnn_synthetic", "fedlink_synthetic"])
def test_two_gloo_ranks_equal_the_sequential_run(name, tmp_env, monkeypatch):
    """``runner=distributed`` under torchrun: every rank builds the history graph, fits its
    share of each round's clients (each fit and upload seeded by task, family, round and
    client) and runs the same server step; rank 0's summary is bitwise the sequential one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import compose_cfg

    repo = Path(__file__).resolve().parents[2]
    over = ["experiment=temporal_synthetic", f"algorithm={name.removesuffix('_synthetic')}", *DIST]
    env = {**os.environ, "FEDLIGHTNING_CACHE": str(tmp_env / "cache"),
           "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = subprocess.run(
        [*cmd, "-m", "fedlightning", "train", *over, "runner=distributed", "hydra.run.dir=d"],
        cwd=tmp_env, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    dist = json.loads((tmp_env / "d" / "summary.json").read_text())
    seq = train(compose_cfg(over), tmp_env / "seq", verbose=False)
    assert dist["metrics"] == seq["metrics"]  # bitwise: the same floats
    assert dist["comm"] == seq["comm"] and dist["hashes"] == seq["hashes"]
    assert dist["tasks_done"] == 2 and 0.0 < dist["metrics"]["auc_tlp"] < 1.0
