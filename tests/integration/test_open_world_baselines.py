"""TopoOOD, GRASP and CLIPN (docs/fedogl.md), for node classification and (GRASP, CLIPN)
cross-modal retrieval: each one's defining mechanism, its uplink against a hand count, its
score's direction checked on validation; end to end on the real data, deterministic,
resumed bitwise, and equal under two Gloo ranks (slow)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch_geometric.data import Data

from fedlightning.data.graphs import make_synthetic
from fedlightning.federation.executors import LeanExecutor
from fedlightning.methods.clipn.clipn import CLIPN, RetrievalCLIPN
from fedlightning.methods.clipn.clipn_client import NoBranch
from fedlightning.methods.grasp.grasp import GRASP, RetrievalGRASP
from fedlightning.methods.topoood.topoood import TopoOOD
from fedlightning.methods.topoood.topoood_score import dirichlet_energy
from fedlightning.metrics.open_set import msp_score
from fedlightning.models import MultimodalGNN
from fedlightning.models.cross_modal import CrossModalGNN
from fedlightning.train import train
from tests.inprocess import runs_once, summary_of

REPO = Path(__file__).resolve().parents[2]
SMALL = ["protocol.stream.stages=[2,1,1]", "federation.rounds=1", "logger=none"]
# retrieval on the synthetic graph: text -> image, as tests/retrieval/test_cir_loop.py
CIR = ["protocol=cil", "model=retrieval_gnn", "model.net.item=image", "task=cir"]


def small(method: str) -> list[str]:
    """The small run of ``method`` (``cil_*`` or ``cir_*``) on the synthetic graph."""
    return [f"algorithm={method}", *SMALL, *(CIR if method.startswith("cir_") else [])]


HANG_GUARD_S = 900  # only against a hang


def path_graph(n: int) -> torch.Tensor:
    src = list(range(n - 1)) + list(range(1, n))
    return torch.tensor([src, list(range(1, n)) + list(range(n - 1))])


def test_topoood_score_reads_the_neighbours_logits():
    """The topology energy of node 1 changes when only its neighbour's logits change (MSP,
    a per-node score, would not), and equals the hand energy of the known-class logits."""
    edges = path_graph(3)
    data = Data(edge_index=edges, num_nodes=3)
    known = torch.tensor([True, True, False])
    logits = torch.tensor([[2.0, 0.0, 9.0], [0.0, 1.0, 9.0], [1.0, 1.0, 9.0]])
    algo = TopoOOD(prop_steps=0)
    s = algo.node_score(logits, known, data, {}, {})
    assert torch.allclose(s, dirichlet_energy(logits[:, :2], edges))
    moved = logits.clone()
    moved[0, :2] = torch.tensor([-3.0, 4.0])
    assert algo.node_score(moved, known, data, {}, {})[1] != s[1]
    assert msp_score(moved, known)[1] == msp_score(logits, known)[1]
    smoothed = TopoOOD(prop_steps=2, prop_alpha=0.5).node_score(logits, known, data, {}, {})
    assert not torch.allclose(smoothed, s)


def test_grasp_score_raises_the_neighbours_of_the_selected_training_nodes():
    """On a path train(0) - cand(1) - cand(2) - ... the training node 0 sits next to the
    highest-scoring candidate, so G = {0}; propagation raises node 1's score above the same
    propagation without G (delta = 0 leaves the neighbourhood mean alone)."""
    n = 8
    edges = path_graph(n)
    y = torch.zeros(n, dtype=torch.long)
    train_mask = torch.zeros(n, dtype=torch.bool)
    train_mask[0] = True
    data = Data(edge_index=edges, y=y, train_mask=train_mask, num_nodes=n)
    data.val_mask = torch.zeros(n, dtype=torch.bool)
    data.test_mask = ~train_mask
    logits = torch.zeros(n, 2)
    logits[:, 0] = torch.tensor([3.0, 4.0, 2.0, 1.5, 1.0, 0.5, 0.2, 0.0])
    known = torch.tensor([True, True])
    on = GRASP(tau1=0.2, tau2=1.0, steps=2, delta=1.02).node_score(logits, known, data, {}, {})
    off = GRASP(tau1=0.2, tau2=1.0, steps=2, delta=0.0).node_score(logits, known, data, {}, {})
    assert on[1] > off[1] and on[0] > off[0]
    assert on[5] == off[5]  # beyond two hops of G


def branch_fit_graph() -> tuple[Data, dict[str, int]]:
    """120 synthetic nodes of 3 classes, every other one a training (and support) node, no
    replay, and the modalities' input widths; the torch seed set for the net built next."""
    graph = make_synthetic(num_nodes=120, num_classes=3, seed=0)
    data = graph.to_data()
    n = data.num_nodes
    data.train_mask = torch.arange(n) % 2 == 0
    data.sup_mask = data.train_mask
    data.replay_mask = torch.zeros(n, dtype=torch.bool)
    torch.manual_seed(0)
    return data, {m: x.size(1) for m, x in graph.features.items()}


def assert_fit_lowers(module, net, data, branch_loss) -> None:
    """15 local epochs of ``module`` on all stage classes lower ``branch_loss()`` (read in
    eval mode, without gradients) by more than 0.1."""
    module.set_stage(torch.tensor([0, 1, 2]), None, None)

    def loss() -> float:
        net.eval()
        with torch.no_grad():
            out = float(branch_loss())
        net.train()
        return out

    loss0 = loss()
    LeanExecutor().fit(module, data, 15, [])
    assert loss() < loss0 - 0.1, loss0


def test_clipn_fit_teaches_the_no_branch():
    """A local fit lowers the branch's ITBO + TSO loss on the training nodes (without the
    branch's term in the training loss, nothing would pull it down: the backbone's
    embeddings and prototypes enter the branch's loss detached)."""
    data, in_dims = branch_fit_graph()
    net = MultimodalGNN(in_dims=in_dims, num_classes=3, hidden=16)
    module = CLIPN(replay_budget=0).client_module(net, lambda p: torch.optim.Adam(p, lr=0.01))
    assert_fit_lowers(module, net, data, lambda: module.no_loss(net.embed(data), data))


def retrieval_view(n: int) -> SimpleNamespace:
    """A retrieval net's view of a graph where every node has both modalities."""
    every = torch.ones(n, dtype=torch.bool)
    return SimpleNamespace(
        pair_mask=lambda data: every, availability=lambda data, m: every, query="text"
    )


def unit_rows(cosines: list[float]) -> torch.Tensor:
    """Rows [b, sqrt(1 - b^2)]: cosine b with e1."""
    b = torch.tensor(cosines, dtype=torch.float64)
    return torch.stack([b, (1 - b**2).sqrt()], dim=1)


def masks(n: int, **ids: list[int]) -> dict[str, torch.Tensor]:
    out = {}
    for split in ("train", "val", "test"):
        m = torch.zeros(n, dtype=torch.bool)
        m[ids.get(split, [])] = True
        out[f"{split}_mask"] = m
    return out


def test_cir_grasp_propagates_the_top1_similarity_by_hand():
    """Path 0 - 1 - ... - 5, node 0 trains, 1-5 are test queries, every item e1: the base
    score is cos(q_i, e1) = b_i. tau1 = 0.2 of 5 candidates: node 1 (0.8) is predicted
    known, node 2 (0.1) unknown, so the training node 0 (next to node 1) has ratio 1 and
    G = {0}. One step with delta = 1.02: s_0 = (s_1 + 1.02 s_0) / 2, s_i = mean of the
    neighbours elsewhere. Without the propagation, or with an empty G, the values differ."""
    n, b = 6, [0.9, 0.8, 0.1, 0.6, 0.3, 0.4]
    data = Data(edge_index=path_graph(n), num_nodes=n, **masks(n, train=[0], test=[1, 2, 3, 4, 5]))
    q, k = unit_rows(b), unit_rows([1.0] * n)
    known = torch.ones(n, dtype=torch.bool)
    algo = RetrievalGRASP(tau1=0.2, tau2=1.0, steps=1, delta=1.02, replay_budget=0)
    s = algo.query_scores(retrieval_view(n), q, k, data, known, {})
    hand = [(0.8 + 1.02 * 0.9) / 2, (0.9 + 0.1) / 2, (0.8 + 0.6) / 2, (0.1 + 0.3) / 2]
    hand += [(0.6 + 0.4) / 2, 0.3]
    assert s.tolist() == pytest.approx(hand)
    two = dict(tau1=0.2, tau2=1.0, steps=2, replay_budget=0)
    on = RetrievalGRASP(delta=1.02, **two).query_scores(retrieval_view(n), q, k, data, known, {})
    off = RetrievalGRASP(delta=0.0, **two).query_scores(retrieval_view(n), q, k, data, known, {})
    assert on[1] > off[1] and on[0] > off[0] and on[5] == off[5]


def test_cir_clipn_scores_queries_by_atd_over_their_splits_items_by_hand():
    """A "no" branch whose MLP is zero and whose offset is e2: every item's "no" embedding
    is e2 (s = T = 1). Node 0 (train) meets its one item e1: p_yes = sig(1), softmax 1.
    Test node 1 (q = e1) against items e1, e2: p_yes = [sig(1), sig(0)], softmax
    [sig(1), sig(-1)]; test node 2 (q = e2): p_yes = [sig(-1), sig(0)], softmax
    [sig(-1), sig(1)]. Another offset (e1) changes every score: the branch is read."""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    n = 3
    data = Data(edge_index=torch.zeros(2, 0, dtype=torch.long), num_nodes=n)
    for key, m in masks(n, train=[0], test=[1, 2]).items():
        data[key] = m
    e = torch.eye(2)
    q = k = torch.stack([e[0], e[0], e[1]])
    algo = RetrievalCLIPN(scale=1.0, temperature=1.0, replay_budget=0)
    algo._branch = NoBranch(2, 1)
    zero = {f"no_branch.{k}": torch.zeros_like(v) for k, v in algo._branch.state_dict().items()}
    known = torch.ones(n, dtype=torch.bool)
    state = {**zero, "no_branch.offset": torch.tensor([[0.0, 1.0]])}
    s = algo.query_scores(retrieval_view(n), q, k, data, known, state)
    hand = [sig(1), sig(1) ** 2 + 0.5 * sig(-1), sig(-1) ** 2 + 0.5 * sig(1)]
    assert s.tolist() == pytest.approx(hand)
    other = {**zero, "no_branch.offset": torch.tensor([[1.0, 0.0]])}
    moved = algo.query_scores(retrieval_view(n), q, k, data, known, other)
    assert all(abs(a - b) > 1e-3 for a, b in zip(moved.tolist(), hand, strict=True))


def test_cir_clipn_fit_teaches_the_no_branch_over_the_items():
    """A local retrieval fit lowers the branch's ITBO + TSO loss over the paired training
    nodes (the embeddings enter it detached: only the branch's own term pulls it down)."""
    data, in_dims = branch_fit_graph()
    net = CrossModalGNN(in_dims, query="text", item="image", hidden=16)
    algo = RetrievalCLIPN(replay_budget=0)
    module = algo.client_module(net, lambda p: torch.optim.Adam(p, lr=0.01))
    assert_fit_lowers(module, net, data, lambda: module.no_loss(*net(data), data))


def hand_model_values(compose, over) -> tuple[int, int]:
    """Values of one model upload, counted from a freshly built MultimodalGNN (or, for
    retrieval, CrossModalGNN), and the graph's classes."""
    from fedlightning.programs.graph_program import load_graph

    cfg = compose(over)
    graph = load_graph(cfg)
    net_cfg = cfg.model.net
    in_dims = {m: x.size(1) for m, x in graph.features.items()}
    hidden, layers = int(net_cfg.hidden), int(net_cfg.gnn_layers)
    if cfg.task == "cir":
        net = CrossModalGNN(
            in_dims, query=net_cfg.query, item=net_cfg.item, hidden=hidden, gnn_layers=layers
        )
    else:
        net = MultimodalGNN(
            in_dims=in_dims, num_classes=graph.num_classes, hidden=hidden, gnn_layers=layers
        )
    return sum(v.numel() for v in net.state_dict().values()), graph.num_classes


@pytest.fixture(scope="module")
def sequential(tmp_path_factory, compose):
    """``sequential(method) -> run dir``: the small run of ``method`` in this process, once
    per module, shared by the uplink's hand count and the kill-and-resume and two-rank
    comparisons."""
    return runs_once(tmp_path_factory, compose, small)


@pytest.mark.parametrize(
    "method",
    [  # CLIPN has the extra fields; the others upload the plain model (slow: same path)
        pytest.param("cil_topoood", marks=pytest.mark.slow),
        pytest.param("cil_grasp", marks=pytest.mark.slow),
        "cil_clipn",
        pytest.param("cir_grasp", marks=pytest.mark.slow),
        "cir_clipn",
    ],
)
def test_uplink_matches_a_hand_count_and_the_sign_is_calibrated(method, sequential, compose):
    """Uplink = rounds x clients x (model + num_examples), CLIPN's model with its branch
    (2 h^2 + 2 h weights of g, and C h offsets, or h for retrieval's one offset); every
    stage's score oriented on validation."""
    over = small(method)
    run_dir = sequential(method)
    s = summary_of(run_dir)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    model, classes = hand_model_values(compose, over)
    h = int(cfg.model.net.hidden)
    clipn = method.endswith("_clipn")
    offsets = 1 if method.startswith("cir_") else classes
    branch = 2 * h * h + 2 * h + offsets * h if clipn else 0
    uploads = s["rounds"] * int(cfg.federation.clients)
    assert s["comm"]["uplink_values"] == uploads * (model + branch + 1)
    no_fields = [f for f in s["comm"]["fields"] if "no_branch" in f]
    assert bool(no_fields) == clipn
    if no_fields:
        assert sum(s["comm"]["fields"][f]["up"] for f in no_fields) == uploads * branch
    for stage in s["stages"]:
        assert stage["score_sign"] in (-1.0, 1.0)
        assert stage["val_auroc_ood"] >= 0.5  # oriented on validation
    assert s["tags"]["method"] == method[4:] and s["tags"]["variant"] == "full"
    assert s["tags"]["task"] == method[:3]
    history = json.loads((run_dir / "history.json").read_text())
    times = [h["round_time_s"] for h in history]
    assert s["timing"] == {
        "s_per_round": pytest.approx(sum(times) / len(times)),
        "rounds_timed": len(times),
    }


def test_the_loop_negates_a_score_that_ranks_validation_unknowns_higher():
    """``ContinualLoop.orient``: with ``calibrate_direction`` a score whose validation
    known nodes score below the unknown ones is negated on every split; without it (MSP,
    energy) the scores stay as they are."""
    from types import SimpleNamespace

    from fedlightning.federation.stages import ContinualLoop

    def parts():
        val = {"known_score": torch.tensor([0.1, 0.2]), "unknown_score": torch.tensor([0.9])}
        test = {
            "known_score": torch.tensor([0.3]),
            "unknown_score": torch.tensor([0.8]),
            "score": torch.tensor([0.3, 0.8]),
        }
        return {"val": [val], "test": [test]}

    calibrated = SimpleNamespace(algorithm=SimpleNamespace(calibrate_direction=True))
    p = parts()
    assert ContinualLoop.orient(calibrated, p) == -1.0
    assert p["test"][0]["score"].tolist() == pytest.approx([-0.3, -0.8])
    assert p["val"][0]["unknown_score"].tolist() == pytest.approx([-0.9])
    plain = SimpleNamespace(algorithm=SimpleNamespace(calibrate_direction=False))
    p = parts()
    assert ContinualLoop.orient(plain, p) == 1.0 and p["test"][0][
        "score"
    ].tolist() == pytest.approx([0.3, 0.8])


# ---------------------------------------------------------------------------- slow
def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "FEDLIGHTNING_CACHE": str(cwd / "cache"),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def _same(a: dict, b: dict) -> None:
    assert a["metrics"] == b["metrics"] and a["acc_matrix"] == b["acc_matrix"]
    assert a["comm"] == b["comm"] and a["stages"] == b["stages"]


# The kill-and-resume and two-rank runs take CLIPN, for cil and cir. All five methods are FedAvg
# + replay (ContinualFedAvg, or ContinualRetrieval for cir_*) and share its checkpoint and
# its gathering of client states, and all five keep the score's sign, calibrated on
# validation after each stage, in their stage results. TopoOOD and GRASP add no state and no
# message (their scores are functions of the global model and the client's graph, computed
# after each stage, as CLIPN's ATD is), so their resumed and ranked runs carry nothing that
# CLIPN's do not; CLIPN carries more: the "no" branch's fields in the model and its update,
# and the server's copy of the branch, built anew in each process.
RESUMED = ("cil_clipn", "cir_clipn")


@pytest.mark.slow
@pytest.mark.parametrize("method", RESUMED)
def test_killed_run_resumes_bitwise(method, tmp_env, sequential):
    """Killed in round 2 (after two fits) and resumed: bitwise the uninterrupted run."""
    over = small(method)
    fl = str(Path(sys.executable).parent / "fedlightning")
    killed = _run([fl, "train", *over, "hydra.run.dir=killed", "runner.kill_at=2:2"], tmp_env)
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = _run([fl, "train", "resume=killed", "logger=none"], tmp_env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    seq = summary_of(sequential(method))
    done = json.loads((tmp_env / "killed" / "summary.json").read_text())
    assert done["resumed"] is True
    _same(done, seq)


@pytest.mark.slow
@pytest.mark.parametrize("method", RESUMED)
def test_two_gloo_ranks_equal_the_sequential_run(method, tmp_env, sequential):
    """``runner=distributed`` under torchrun with two ranks: bitwise the sequential run
    (and so deterministic for a seed across processes)."""
    over = small(method)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*torchrun, "-m", "fedlightning", "train", *over, "runner=distributed", "hydra.run.dir=d"]
    dist = _run(cmd, tmp_env)
    assert dist.returncode == 0, dist.stderr[-3000:]
    seq = summary_of(sequential(method))
    _same(json.loads((tmp_env / "d" / "summary.json").read_text()), seq)


def first_stages(cfg, n: int = 2):
    """``cfg`` (an experiment) with the first ``n`` stages of its stream: the real setting,
    shorter."""
    cfg.protocol.stream.stages = list(cfg.protocol.stream.stages)[:n]
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("method", ("topoood", "grasp", "clipn"))
@pytest.mark.parametrize("dataset", ("citeseer_mm", "cora"))
def test_end_to_end_on_the_real_data(method, dataset, shared_data, env, compose, monkeypatch):
    """The experiment's first two stages (the second learns new classes with replay), one
    round each, in the shared cache (each dataset's partition is made once)."""
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    cfg = first_stages(
        compose(
            [
                f"experiment=cil_{dataset}",
                f"algorithm=cil_{method}",
                "federation.rounds=1",
                "logger=none",
            ]
        )
    )
    s = train(cfg, env / "run", verbose=False)
    assert len(s["stages"]) == 2
    assert s["tags"]["method"] == method and 0.0 <= s["metrics"]["am"] <= 1.0
    assert 0.0 <= s["metrics"]["auroc_ood"] <= 1.0 and s["comm"]["uplink_mib"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ("grasp", "clipn"))
def test_retrieval_end_to_end_on_the_real_data(method, shared_data, env, compose, monkeypatch):
    """As :func:`test_end_to_end_on_the_real_data`, for retrieval."""
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    cfg = first_stages(
        compose(
            [
                "experiment=cir_citeseer_mm",
                f"algorithm=cir_{method}",
                "federation.rounds=1",
                "logger=none",
            ]
        )
    )
    s = train(cfg, env / "run", verbose=False)
    assert len(s["stages"]) == 2
    assert s["tags"]["method"] == method and s["tags"]["task"] == "cir"
    assert 0.0 <= s["metrics"]["recall_at_1"] <= 1.0 and 0.0 <= s["metrics"]["auroc_ood"] <= 1.0
    assert s["comm"]["uplink_mib"] > 0
    assert all(st["score_sign"] in (-1.0, 1.0) for st in s["stages"])
