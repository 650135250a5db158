"""runner=distributed: contiguous shares, a world of one, and 2 Gloo ranks under torchrun that
give bitwise the sequential run's metrics (FedTIP's stacked rounds too), fail fast when a
rank dies and resume."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlightning.clients import NodeClassifier
from fedlightning.data.graphs import make_synthetic
from fedlightning.errors import ConfigError
from fedlightning.federation import executors
from fedlightning.federation.executors import LeanExecutor
from fedlightning.federation.ledger import unpacked
from fedlightning.federation.runners import DistributedRunner, contiguous_shares
from fedlightning.messages import ClientUpdate
from fedlightning.models import MultimodalGNN
from fedlightning.train import train

REPO = Path(__file__).resolve().parents[2]
CORA = ["experiment=fl_cora", "algorithm=fedavg", "federation.rounds=2"]
CIL = [  # partial participation moves clients between ranks; the teacher is client state
    "experiment=cil_cora",
    "algorithm=cil_fedavg_replay",
    "federation.rounds=2",
    "federation.participation=0.6",
    "federation.local_epochs=1",
    "algorithm.lambda_dis=1.0",
]
FEDTIP = [  # 2 tasks of 5 clients: rank 0 fits 2 of a round's clients as one stack, rank 1 3
    "experiment=temporal_synthetic",
    "algorithm=fedtip",
    "dataset.num_events=5000",
    "protocol.tasks.num_tasks=2",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
]


# ---------------------------------------------------------------------------- in-process
def test_contiguous_shares_cover_the_list_in_order():
    for n in range(12):
        for size in (1, 2, 3, 4):
            shares = contiguous_shares(n, size)
            assert len(shares) == size
            assert [i for s in shares for i in s] == list(range(n))
            lengths = [len(s) for s in shares]
            assert max(lengths) - min(lengths) <= 1


def test_contiguous_shares_example():
    assert contiguous_shares(5, 2) == [range(0, 2), range(2, 5)]
    assert contiguous_shares(1, 2) == [range(0, 0), range(0, 1)]


@pytest.fixture
def no_torchrun(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


def test_without_torchrun_a_world_of_one(no_torchrun):
    runner = DistributedRunner(LeanExecutor(), device="cpu")
    assert (runner.world.rank, runner.world.size, runner.world.is_main) == (0, 1, True)
    assert runner.executor.device == torch.device("cpu")

    class Client:
        def __init__(self, k):
            self.client_id, self.state = k, {}

    def fit(client):
        client.state["fits"] = client.state.get("fits", 0) + 1
        draw = float(torch.rand(()))
        return ClientUpdate(round=1, client_id=client.client_id, scalars={"draw": draw})

    torch.manual_seed(0)
    expected = torch.rand(4).tolist()
    torch.manual_seed(0)
    clients = [Client(k) for k in (3, 0, 2)]
    updates = runner.run_round(1, clients, fit)
    assert [u.client_id for u in updates] == [3, 0, 2]
    assert [u.scalars["draw"] for u in updates] == expected[:3]
    assert [c.state["fits"] for c in clients] == [1, 1, 1]
    assert float(torch.rand(())) == expected[3]  # the RNG goes on from the last fit


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"backend": "mpi"}, "runner.backend"),
        ({"device": "tpu"}, "runner.device"),
        ({"timeout_s": 0}, "runner.client_timeout_s"),
        ({"client_timeout_s": -1}, "runner.client_timeout_s"),
    ],
)
def test_bad_runner_settings_name_the_key(no_torchrun, kwargs, key):
    with pytest.raises(ConfigError, match=key):
        DistributedRunner(LeanExecutor(), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_config_error(no_torchrun):
    with pytest.raises(ConfigError, match="CUDA is not available"):
        DistributedRunner(LeanExecutor(), device="cuda")


def test_executor_device_path_moves_a_copy_and_comes_back(monkeypatch):
    """The device path (here to the CPU: the code a GPU takes) gives the same weights,
    leaves the client's data alone and ends with the module on the CPU. The move is made
    to put new tensors into the batch in place, as ``Data.to("cuda")`` does."""
    monkeypatch.setattr(
        executors, "move_data_to_device", lambda batch, device: batch.apply(torch.clone)
    )
    g = make_synthetic(num_nodes=120, num_classes=3, seed=1)
    data = g.to_data()
    data.train_mask = torch.arange(120) % 2 == 0
    torch.manual_seed(0)
    net = MultimodalGNN({m: x.size(1) for m, x in g.features.items()}, 3, hidden=16)
    fitted = []
    for device in (None, "cpu"):
        module = NodeClassifier(copy.deepcopy(net), partial(torch.optim.Adam, lr=0.01), 0.1)
        module.receive(net.state_dict())
        stores = dict(data.items())
        torch.manual_seed(1)
        LeanExecutor(device=device).fit(module, data, 3)
        assert all(data[k] is v for k, v in stores.items())
        assert module.device == torch.device("cpu")
        fitted.append(module.net.state_dict())
    for k in fitted[0]:
        assert torch.equal(fitted[0][k], fitted[1][k]), k
    assert not torch.equal(fitted[0]["head.weight"], net.state_dict()["head.weight"])


@pytest.mark.slow
def test_world_of_one_equals_sequential_in_process(tmp_env, compose, no_torchrun):
    base = ["experiment=fl_synthetic", "algorithm=fedavg", "federation.rounds=2", "logger=none"]
    seq = train(compose(base), tmp_env / "seq")
    dist = train(compose([*base, "runner=distributed"]), tmp_env / "dist")
    assert dist["metrics"] == seq["metrics"] and dist["comm"] == seq["comm"]


def test_unsupported_task_is_refused(tmp_env, compose):
    cfg = compose(["experiment=bank_synthetic", "bank=tgn", "runner=distributed", "logger=none"])
    with pytest.raises(ConfigError, match="runner=distributed does not support task=bank"):
        train(cfg, tmp_env / "bank")


# ---------------------------------------------------------------------------- torchrun
HANG_GUARD_S = 1800  # waits on torchrun: far above the normal time, only against a hang


def torchrun(args: list[str], cwd: Path, env: dict[str, str], timeout: float = HANG_GUARD_S):
    """``torchrun --standalone --nproc_per_node=2 -m fedlightning train ARGS``; seconds taken."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    t0 = time.perf_counter()
    r = subprocess.run(
        [*cmd, "-m", "fedlightning", "train", *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, time.perf_counter() - t0


@pytest.fixture
def dist_env(tmp_path, shared_data, monkeypatch):
    """The environment of the torchrun processes and of the in-process reference run; the
    same intra-op threads in every process as in the reference."""
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    return {
        "FEDLIGHTNING_DATA": str(shared_data),
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def same(a, b) -> bool:
    """Exact equality of nested checkpoint contents (tensors, arrays, containers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def sequential(compose, overrides: list[str], run_dir: Path) -> dict:
    """The in-process sequential run of the same config (the reference)."""
    return train(compose([*overrides, "logger=none"]), run_dir, verbose=False)


@pytest.mark.slow
def test_two_gloo_ranks_equal_the_sequential_run(tmp_env, dist_env, compose):
    r, _ = torchrun([*CORA, "runner=distributed"], tmp_env, dist_env)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = (tmp_env / "outputs" / "cora" / "fedavg_cora").iterdir()  # rank 1 left none
    dist = json.loads((run / "summary.json").read_text())
    seq = sequential(compose, CORA, tmp_env / "seq")
    assert dist["metrics"] == seq["metrics"]  # bitwise: the same floats
    assert dist["comm"] == seq["comm"] and dist["hashes"] == seq["hashes"]
    assert dist["metrics"]["test_acc"] > 0.3  # it trained (7 classes)
    hist = json.loads((run / "history.json").read_text())
    seq_hist = json.loads((tmp_env / "seq" / "history.json").read_text())
    assert [h["test_acc"] for h in hist] == [h["test_acc"] for h in seq_hist]
    assert r.stdout.count("test_acc_at_best_val") == 1  # only rank 0 prints the summary
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    seq_ckpt = torch.load(tmp_env / "seq" / "checkpoint.pt", weights_only=False)
    for c in (ckpt, seq_ckpt):  # the entries, however they were pickled
        c["ledger"] = unpacked(c["ledger"])
    for key in ("server", "clients", "ledger", "rng", "completed_rounds"):
        assert same(ckpt[key], seq_ckpt[key]), key  # the RNG too: it follows the last fit

    from mlflow.tracking import MlflowClient

    client = MlflowClient(dist_env["MLFLOW_TRACKING_URI"])
    (exp,) = [e for e in client.search_experiments() if e.name == "fedlightning/fl"]
    (mrun,) = client.search_runs([exp.experiment_id])  # rank 0 alone logs
    assert [m.step for m in client.get_metric_history(mrun.info.run_id, "curves/test_acc")] == [
        1,
        2,
    ]
    assert mrun.data.metrics["final/test_acc"] == pytest.approx(seq["metrics"]["test_acc"])


@pytest.mark.slow
def test_client_state_follows_clients_across_ranks(tmp_env, dist_env, compose):
    """CIL with partial participation: client 1 takes its teacher on rank 0 in round 5 and
    trains with it on rank 1 in round 6; without the state exchange the metrics differ."""
    r, _ = torchrun(
        [*CIL, "runner=distributed", "logger=none", "hydra.run.dir=d"], tmp_env, dist_env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    dist = json.loads((tmp_env / "d" / "summary.json").read_text())
    seq = sequential(compose, CIL, tmp_env / "seq")
    assert dist["metrics"] == seq["metrics"] and dist["acc_matrix"] == seq["acc_matrix"]
    assert dist["comm"] == seq["comm"]


@pytest.mark.slow
def test_fedtip_shares_of_a_stack_equal_the_sequential_stack(tmp_env, dist_env, compose):
    """FedTIP with dropout: each rank fits its share of a round's clients as a smaller stack,
    with the whole round's padding and dropout draws, which gives bitwise the sequential
    run's single stack. Rank 0 alone builds the bank and contexts (the cache) and writes."""
    r, _ = torchrun(
        [*FEDTIP, "runner=distributed", "logger=none", "hydra.run.dir=d"], tmp_env, dist_env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    dist = json.loads((tmp_env / "d" / "summary.json").read_text())
    seq = sequential(compose, FEDTIP, tmp_env / "seq")
    assert not dist["bank"]["reused"] and seq["bank"]["reused"]  # the sequential run's cache
    assert dist["metrics"] == seq["metrics"]  # bitwise: the same floats
    assert dist["comm"] == seq["comm"] and dist["hashes"] == seq["hashes"]
    assert dist["tasks_done"] == 2 and 0.0 < dist["metrics"]["auc_tlp"] < 1.0
    assert r.stdout.count("uplink per task") == 1  # only rank 0 prints the summary


FEDOGL_RUNS = {
    # server bases and prototype memory, stage-end basis exchange, replay and teacher on
    # the clients; 2 stages of 2 rounds, 3 of 5 clients a round (all 5 answer the exchange)
    "cil": [
        "experiment=cil_cora",
        "algorithm=fedogl",
        "protocol.stream.stages=[2,2]",
        "federation.rounds=2",
        "federation.participation=0.6",
        "federation.local_epochs=1",
    ],
    # cross-modal retrieval: 2 stages, 3 clients, each rank answering the stage-end exchange
    # for its share of the stage's clients
    "cir": [
        "experiment=cir_citeseer_mm",
        "algorithm=cir_fedogl",
        "federation.rounds=1",
        "federation.clients=3",
        "federation.local_epochs=1",
        "protocol.stream.stages=[2,2]",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(FEDOGL_RUNS))
def test_fedogl_two_gloo_ranks_equal_the_sequential_run(kind, tmp_env, dist_env, compose):
    """FedOGL (class-incremental node classification and cross-modal retrieval) under two
    Gloo ranks: the stage-end basis exchange runs through the runner like any round."""
    over = FEDOGL_RUNS[kind]
    r, _ = torchrun(
        [*over, "runner=distributed", "logger=none", "hydra.run.dir=d"], tmp_env, dist_env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    dist = json.loads((tmp_env / "d" / "summary.json").read_text())
    seq = sequential(compose, over, tmp_env / "seq")
    assert dist["metrics"] == seq["metrics"] and dist["acc_matrix"] == seq["acc_matrix"]
    assert dist["comm"] == seq["comm"]
    assert "basis_nodes" in seq["comm"]["fields"]  # the stage-end basis exchange was counted


SCAFFOLD_RUNS = {
    "plain": ["experiment=fl_synthetic", "federation.rounds=2"],
    "class_incremental": ["experiment=cil_cora", "federation.rounds=1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SCAFFOLD_RUNS))
def test_scaffold_two_gloo_ranks_equal_the_sequential_run(kind, tmp_env, dist_env, compose):
    """The worked example of "Adding a method" under torchrun, plain and class-incremental:
    its clients' control variates are client state and its server module's ``c`` is server
    state, so two ranks need nothing of it and end bitwise where one process ends."""
    over = [*SCAFFOLD_RUNS[kind], "algorithm=scaffold", "federation.clients=3"]
    r, _ = torchrun(
        [*over, "runner=distributed", "logger=none", "hydra.run.dir=d"], tmp_env, dist_env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    dist = json.loads((tmp_env / "d" / "summary.json").read_text())
    seq = sequential(compose, over, tmp_env / "seq")
    assert dist["metrics"] == seq["metrics"] and dist["comm"] == seq["comm"]
    assert any(f.startswith("control_delta.") for f in seq["comm"]["fields"])
    ckpt = torch.load(tmp_env / "d" / "checkpoint.pt", weights_only=False)
    seq_ckpt = torch.load(tmp_env / "seq" / "checkpoint.pt", weights_only=False)
    assert same(ckpt["server"], seq_ckpt["server"])  # the server's control variate too
    assert same(ckpt["clients"], seq_ckpt["clients"])  # and every client's own


@pytest.mark.slow
def test_killed_rank_fails_fast_and_the_run_resumes(tmp_env, dist_env, compose):
    base = [
        "experiment=fl_cora",
        "algorithm=fedavg",
        "federation.rounds=2",
        "federation.local_epochs=1",
        "logger=none",
    ]
    killed, seconds = torchrun(
        [*base, "runner=distributed", "runner.kill_at=2:4", "hydra.run.dir=killed"],
        tmp_env,
        dist_env,
    )
    # rank 1 fits clients 3-5 and dies after client 4 of round 2 (the last); torchrun stops rank 0
    assert killed.returncode != 0
    assert seconds < 600  # not a hang until the process group's timeout (600 s)
    assert "SIGKILL" in killed.stderr and "rank      : 1" in killed.stderr
    run_dir = tmp_env / "killed"
    assert "error: rank 0 of 2" in killed.stderr and f"resume={run_dir}" in killed.stderr
    assert not (run_dir / "summary.json").exists()
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert state["completed_rounds"] == 1

    resumed, _ = torchrun(["resume=killed", "runner=distributed"], tmp_env, dist_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = json.loads((run_dir / "summary.json").read_text())
    seq = sequential(compose, base, tmp_env / "seq")
    assert done["resumed"] is True and done["rounds"] == 2
    assert done["metrics"] == seq["metrics"] and done["comm"] == seq["comm"]


STALL = """
import sys, time
from fedlightning.federation.world import RankLost, join_world

world = join_world("gloo", "cpu", timeout_s=3)
if world.rank == 1:
    time.sleep(600)  # a rank that hangs instead of dying
t0 = time.perf_counter()
try:
    world.all_gather(world.rank, "gathering round 1")
except RankLost as e:
    print(f"waited {time.perf_counter() - t0:.1f} s: {e}", file=sys.stderr, flush=True)
    sys.exit(3)
"""


@pytest.mark.slow
def test_a_stalled_rank_times_out_with_a_clear_error(tmp_path, dist_env):
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    t0 = time.perf_counter()
    r = subprocess.run(
        [*cmd, str(script)],
        cwd=tmp_path,
        env={**os.environ, **dist_env},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert r.returncode != 0 and time.perf_counter() - t0 < 600  # not the stalled rank's sleep
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("waited")]
    waited = float(line.split()[1])
    assert 2.5 <= waited < 60  # the 3 s timeout, not a hang (a loaded machine adds little)
    assert (
        "rank 0 of 2: gathering round 1" in line
        and "within 3 s (10 x runner.client_timeout_s)" in line
    )
    assert "resume=RUN_DIR runner=distributed" in line
