"""kill -9 during FedOGL's stage-end exchange, sequentially and under ``runner=distributed``
(two Gloo ranks under torchrun), and in the middle of a FedTIP task, then ``resume=DIR``:
bitwise the uninterrupted run's summary metrics (accuracy matrix) and ledger
(``runner.kill_at=ROUND:N:KIND[:TIMES]``).

The killed runs are real subprocesses (``fedlightning train``, torchrun); a sequential
resume runs :func:`fedlightning.cli.main` (what the console script runs) in this process,
as the uninterrupted references do, on the subprocesses' threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedlightning.federation.ledger import unpacked
from fedlightning.train import train
from tests.inprocess import fl_ok

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The default demo (FedOGL on the synthetic graph, stages [2, 1, 1]) with one round a stage
# of one local epoch: round 2 ends stage 2, and its stage-end exchange (residual bases,
# Eq. (7)) follows it.
DEMO = ["federation.rounds=1", "federation.local_epochs=1", "logger=none"]
HANG_GUARD_S = 900  # far above the normal time (tens of seconds); only against a hang


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def fl(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``fedlightning train ARGS`` as a user runs it."""
    return run([str(Path(sys.executable).parent / "fedlightning"), "train", *args], cwd, env)


def torchrun(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=2 -m fedlightning train ARGS``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return run([*cmd, "-m", "fedlightning", "train", *args], cwd, env)


@pytest.fixture
def env(tmp_path, monkeypatch) -> dict[str, str]:
    """The subprocesses' environment; the in-process reference shares its cache and threads."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(tmp_path / "cache"))
    return {
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


@pytest.fixture(scope="module")
def demo_full(tmp_path_factory, compose) -> Path:
    """The uninterrupted demo run (in this process), the reference of both stage-end kills."""
    root = tmp_path_factory.mktemp("demo_full")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("FEDLIGHTNING_CACHE", str(root / "cache"))
        train(compose(DEMO), root / "full", verbose=False)
    return root / "full"


def assert_same_run(done: Path, reference: Path) -> None:
    """Bitwise the same summary metrics, matrix and communication, and the same ledger."""
    a = json.loads((reference / "summary.json").read_text())
    b = json.loads((done / "summary.json").read_text())
    assert b["resumed"] is True and a["resumed"] is False
    assert a["metrics"] == b["metrics"] and a["acc_matrix"] == b["acc_matrix"]
    assert a["comm"] == b["comm"] and a["hashes"] == b["hashes"]
    assert "basis_nodes" in a["comm"]["fields"]  # the stage-end exchange was counted
    ledger_a = torch.load(reference / "checkpoint.pt", weights_only=False)["ledger"]
    ledger_b = torch.load(done / "checkpoint.pt", weights_only=False)["ledger"]
    assert unpacked(ledger_a) == unpacked(ledger_b)  # every message, entry by entry


def assert_killed_in_exchange(r: subprocess.CompletedProcess, run_dir: Path, where: str) -> None:
    """Killed inside stage 2's exchange (the killing rank says so on stderr, at WHERE: round
    2's stage-end work, client N, rank R), which follows the stage's evaluation: the last
    checkpoint is round 1's, and nothing claims the run finished."""
    assert r.returncode != 0, r.stderr[-2000:]
    assert f"runner.kill_at: SIGKILL after round 2, {where}" in r.stderr, r.stderr[-3000:]
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["completed_rounds"] == 1
    assert not (run_dir / "summary.json").exists()


def test_sequential_kill_in_the_stage_end_exchange_resumes_bitwise(tmp_path, env, demo_full):
    killed = fl([*DEMO, "hydra.run.dir=killed", "runner.kill_at=2:2:stage_end"], tmp_path, env)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert_killed_in_exchange(killed, tmp_path / "killed", "client 2, stage_end, rank 0")
    assert "stage 2/3" in killed.stdout + killed.stderr  # the evaluation's log came first
    fl_ok(["train", "resume=killed", "logger=none"], tmp_path, env)
    assert_same_run(tmp_path / "killed", demo_full)


def test_distributed_kill_in_the_stage_end_exchange_resumes_bitwise(tmp_path, env, demo_full):
    """Rank 1 answers positions 2.. of the exchange and dies after the third client; torchrun
    stops rank 0 (perhaps before it logged the stage's evaluation: the ranks evaluate
    independently); the resumed two-rank run equals the uninterrupted sequential run."""
    dist = ["runner=distributed"]
    args = [*DEMO, *dist, "hydra.run.dir=killed", "runner.kill_at=2:3:stage_end"]
    killed = torchrun(args, tmp_path, env)
    assert "SIGKILL" in killed.stderr and "rank      : 1" in killed.stderr, killed.stderr[-3000:]
    assert_killed_in_exchange(killed, tmp_path / "killed", "client 3, stage_end, rank 1")
    resumed = torchrun(["resume=killed", *dist, "logger=none"], tmp_path, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "killed", demo_full)


# FedTIP on a shorter synthetic stream: 2 tasks, each with families nc and lp of 2 rounds
FEDTIP = [
    "experiment=temporal_synthetic",
    "algorithm=fedtip",
    "dataset.num_events=5000",
    "protocol.tasks.num_tasks=2",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
]


def test_fedtip_kill_in_the_middle_of_a_task_resumes_bitwise(tmp_path, env, compose):
    """Round 1 of a task's family comes for the third time in task 2 (after task 1's nc and
    lp): killed after its first client, the run resumes from task 1's checkpoint and
    finishes task 2."""
    killed = fl([*FEDTIP, "hydra.run.dir=killed", "runner.kill_at=1:1:task_fit:3"], tmp_path, env)
    assert killed.returncode == -9, killed.stderr[-2000:]
    state = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)
    assert len(state["results"]) == 1  # task 1 done, task 2 cut in its first round
    assert not (tmp_path / "killed" / "summary.json").exists()
    fl_ok(["train", "resume=killed", "logger=none"], tmp_path, env)
    full = train(compose(FEDTIP), tmp_path / "full", verbose=False)
    done = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert done["resumed"] is True and done["tasks_done"] == full["tasks_done"] == 2
    assert done["metrics"] == full["metrics"] and done["comm"] == full["comm"]
    ledger_a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)["ledger"]
    ledger_b = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)["ledger"]
    assert unpacked(ledger_a) == unpacked(ledger_b)  # the same entries, however chunked
