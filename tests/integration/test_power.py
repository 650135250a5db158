"""POWER end to end (docs/fedogl.md, "POWER"): its uplink against a hand count, its server's
pseudo-nodes, its buffer, bitwise resume, distributed == sequential, learning, and both real
datasets from the experiment names."""

from __future__ import annotations

import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from fedlightning.data.partition import Partition
from fedlightning.data.streams import ClassStream
from fedlightning.federation.ledger import unpacked
from fedlightning.programs.graph_program import build_clients, load_graph
from fedlightning.train import train
from tests.federation.test_distributed import dist_env, sequential, torchrun  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

BASE = [
    "protocol=cil",
    "algorithm=cil_power",
    "protocol.stream.stages=[2,1]",
    "federation.rounds=1",
    "logger=none",
    "task=cil",
    "name=cil_power_synthetic",
]


# the server's gradient matching at 2 L-BFGS steps of 20 iterations (default 20 steps: 90% of
# a small run's time); what needs no learning or no converged pseudo-node takes it
RECON = "algorithm.recon.steps=2"
FEW = ["federation.clients=3", "federation.local_epochs=1", RECON]  # what needs no learning
SMALL = ["federation.rounds=1", "federation.local_epochs=1", "federation.clients=2", RECON]
# one L-BFGS step of 5 iterations: for what compares two runs of the same reconstruction
# (resumed == uninterrupted, two ranks == one process), not its pseudo-nodes
SHORT_RECON = ["algorithm.recon.steps=1", "algorithm.recon.max_iter=5"]


def ge_size(d: int, c: int) -> int:
    """GE's weights: D -> 128 -> 128 -> 64 -> C, with biases."""
    return d * 128 + 128 + 128 * 128 + 128 + 128 * 64 + 64 + 64 * c + c


def test_class_gradients_are_counted_become_pseudo_nodes_and_move_the_model(tmp_env, compose):
    run = tmp_env / "run"
    s = train(compose([*BASE, *FEW]), run, verbose=False)
    cfg = OmegaConf.load(run / "config.yaml")
    graph = load_graph(cfg)
    part, stream = Partition.load(run / "partition.json"), ClassStream.load(run / "stream.json")
    d = sum(x.size(1) for x in graph.features.values())
    uploaded = []  # (client, stage, class): one slot per observed class with training nodes
    clients = build_clients(graph, part)
    for c in clients:
        for t in range(2):
            for cls in stream.observed[c.client_id][t]:
                if bool((c.data.train_mask & (c.data.y == cls)).any()):
                    uploaded.append((c.client_id, t, cls))
    fields = s["comm"]["fields"]
    grads = sum(v["up"] for k, v in fields.items() if k.startswith("power_grad."))
    counts = sum(v["up"] for k, v in fields.items() if k.startswith("power_count."))
    assert counts == len(uploaded) > 0
    assert grads == len(uploaded) * ge_size(d, graph.num_classes)
    assert all(v["down"] == 0 for k, v in fields.items() if k.startswith("power_"))
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    mem = ckpt["server"]["modules"]["power"]
    # one pseudo-node per upload, labelled by the gradient alone as the class it came from
    assert sorted(mem["y"].tolist()) == sorted(cls for _, _, cls in uploaded)
    # the class counts the server holds are the clients' training nodes per class
    for k, t, cls in uploaded:
        n = int((clients[k].data.train_mask & (clients[k].data.y == cls)).sum())
        assert float(mem["counts"][t][k][cls]) == n
    # POWER's own buffer: one node per observed class of every past stage, on each client
    for cid, st in ckpt["clients"].items():
        for t, nodes in st["replay"].items():
            assert nodes.numel() == len(stream.observed[int(cid)][t])
    assert s["tags"]["method"] == "power" and s["tags"]["variant"] == "full"
    # without the server part: plain FedAvg, no upload
    off = train(compose([*BASE, *FEW, "algorithm.server_kd=false"]), tmp_env / "off", verbose=False)  # fmt: skip
    assert not any(k.startswith("power_") for k in off["comm"]["fields"])
    assert off["tags"]["variant"] == "no_server_kd"
    b = torch.load(tmp_env / "off" / "checkpoint.pt", weights_only=False)["server"]
    a = ckpt["server"]
    # the same FedAvg rounds up to the server's distillation, which moves the model
    assert not all(
        torch.equal(a["global_state"][k], b["global_state"][k]) for k in a["global_state"]
    )
    assert s["metrics"] != off["metrics"]


def test_power_learns_on_the_synthetic_graph(tmp_env, compose):
    """The trained run beats its untrained self (lr 1e-12 on clients and server) by three
    standard errors of the mean new-class accuracy (tests/integration/test_learning.py)."""
    from tests.integration.test_learning import learned, learned_margin, trained_and_untrained

    trained, untrained = trained_and_untrained(
        compose, tmp_env, BASE, ["algorithm.server_lr=1e-12"]
    )
    p0, p1 = learned(untrained), learned(trained)
    assert p1 > p0 + learned_margin(tmp_env / "untrained", untrained), (p0, p1)


def test_killed_mid_round_resumes_bitwise(tmp_path, compose, monkeypatch):
    """SIGKILL after the second client of round 2 (a stage's first round: class gradients in
    flight, buffers of stage 0 selected), ``resume=DIR`` (in this process, as the reference):
    the uninterrupted run's metrics and ledger."""
    from tests.inprocess import fl_ok
    from tests.integration.test_kill_resume import REPO, fl

    over = [*BASE, *FEW[:2], *SHORT_RECON]
    env = {
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(tmp_path / "cache"))
    killed = fl([*over, "hydra.run.dir=killed", "runner.kill_at=2:2"], tmp_path, env)
    assert killed.returncode == -9, killed.stderr[-2000:]
    fl_ok(["train", "resume=killed", "logger=none"], tmp_path, env)
    train(compose(over), tmp_path / "full", verbose=False)
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "killed"))
    assert b["resumed"] is True and a["resumed"] is False
    assert a["metrics"] == b["metrics"] and a["acc_matrix"] == b["acc_matrix"]
    assert a["comm"] == b["comm"] and "power_count.0" in a["comm"]["fields"]
    ledgers = [
        torch.load(tmp_path / d / "checkpoint.pt", weights_only=False)["ledger"]
        for d in ("full", "killed")
    ]
    assert unpacked(ledgers[0]) == unpacked(ledgers[1])  # every message, entry by entry


@pytest.mark.parametrize("experiment", ["cil_power_citeseer_mm", "cil_power_cora"])
def test_runs_from_its_experiment_name(experiment, tmp_env, compose, shared_data, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    s = train(
        compose(
            [f"experiment=cil_{experiment[10:]}", "algorithm=cil_power", *SMALL, "logger=none"]
        ),
        tmp_env / "r",
        verbose=False,
    )
    assert s["tags"]["method"] == "power" and 0.0 <= s["metrics"]["am"] <= 1.0
    assert any(k.startswith("power_grad.") for k in s["comm"]["fields"])
    for key in ("fm", "fpr95", "auroc_ood"):
        assert key in s["metrics"]


def test_two_gloo_ranks_equal_the_sequential_run(tmp_env, dist_env, compose):  # noqa: F811
    """Cora, 2 stages of one round, 3 of 5 clients a round (clients move between ranks):
    class gradients, server reconstruction and distillation under two ranks equal the
    sequential run, bitwise."""
    over = [
        "experiment=cil_cora",
        "algorithm=cil_power",
        "protocol.stream.stages=[2,2]",
        *SMALL[:2],
        *SHORT_RECON,
        "federation.participation=0.6",
    ]
    r, _ = torchrun(
        [*over, "runner=distributed", "logger=none", "hydra.run.dir=d"], tmp_env, dist_env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    dist = json.loads((tmp_env / "d" / "summary.json").read_text())
    seq = sequential(compose, over, tmp_env / "seq")
    assert dist["metrics"] == seq["metrics"] and dist["acc_matrix"] == seq["acc_matrix"]
    assert dist["comm"] == seq["comm"] and "power_count.0" in seq["comm"]["fields"]
