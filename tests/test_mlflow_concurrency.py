"""Processes that start at once on a fresh MLflow store all log their runs: the store is
created once, under a file lock (fedlightning/tracking/mlflow_tracker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlightning.tracking.mlflow_tracker import local_store

REPO = Path(__file__).resolve().parents[1]
FL = str(Path(sys.executable).parent / "fedlightning")
HANG_GUARD_S = 600  # far above the normal time (seconds): only a hang trips it

# One launcher process imports MLflow and its stores once, then forks ``n`` workers (MLflow's
# import takes seconds of CPU per process: ten processes importing it after the common start
# spread out over tens of seconds on a small machine, while forked workers that need no import
# all reach the fresh store within milliseconds of each other, the tightest race). Each worker
# writes its stderr to ``stderr_<i>``, says it is ready, waits for the common start, then logs
# a run as a training run does (tags and the config's params, per-round metrics, final
# metrics, an artifact, the end); the launcher waits for them all and writes their exit codes.
LAUNCHER = """
import os, sys, time, traceback
from pathlib import Path
import mlflow, mlflow.tracking, mlflow.store.tracking.file_store
import mlflow.store.tracking.sqlalchemy_store
from fedlightning.tracking import MlflowTracker
uri, n, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])

def work(i):
    (folder / f"ready_{i}").touch()
    while not (folder / "go").exists():
        time.sleep(0.01)
    t = MlflowTracker(uri, "fedlightning")
    tags = {"task": "fl", "seed": str(i), "experiment": "concurrency"}
    t.start(f"run-seed{i}", tags, {"seed": i, "federation.rounds": 3, "model.hidden": 16})
    for r in (1, 2, 3):
        t.log_metrics({"train_loss": 1.0 / r, "val_acc": 0.1 * r}, step=r)
    t.log_metrics({"final/val_acc": 0.3}, step=3)
    art = folder / f"summary_{i}.json"
    art.write_text("{}")
    t.log_artifacts([art])
    t.end("FINISHED")

pids = []
for i in range(n):
    pid = os.fork()
    if pid == 0:  # a worker: its own stderr file, its exit code the launcher's report
        code = 1
        try:
            os.dup2(os.open(folder / f"stderr_{i}", os.O_WRONLY | os.O_CREAT), 2)
            work(i)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    pids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
(folder / "codes").write_text(" ".join(map(str, codes)))
"""


def start_at_once(uri: str, n: int, folder: Path) -> list[subprocess.CompletedProcess]:
    """``n`` worker processes (forked by one launcher that imported MLflow), released
    together once all of them are ready; each worker's exit code and stderr."""
    env = {
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps the file store for those who ask
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, uri, str(n), str(folder)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + HANG_GUARD_S
    while len(list(folder.glob("ready_*"))) < n and time.monotonic() < deadline:
        if launcher.poll() is not None:  # failed before forking them all
            break
        time.sleep(0.05)
    (folder / "go").touch()
    out, err = launcher.communicate(timeout=HANG_GUARD_S)
    assert launcher.returncode == 0 and (folder / "codes").exists(), err[-3000:]
    codes = [int(c) for c in (folder / "codes").read_text().split()]
    return [
        subprocess.CompletedProcess(
            [*launcher.args, f"worker {i}"], code, "", (folder / f"stderr_{i}").read_text()
        )
        for i, code in enumerate(codes)
    ]


@pytest.mark.parametrize(
    ("kind", "n"),
    [
        ("sqlite", 3),  # the reported failure: 2 of 3 runs lost to migration tracebacks
        pytest.param("sqlite", 10, marks=pytest.mark.slow),
        pytest.param("file", 10, marks=pytest.mark.slow),
    ],
)
def test_processes_on_a_fresh_store_all_log_their_runs(tmp_path, monkeypatch, kind, n):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    if kind == "sqlite":
        uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    else:
        uri = f"file://{tmp_path / 'store' / 'mlruns'}"
    (tmp_path / "store").mkdir()
    results = start_at_once(uri, n, tmp_path)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (exp,) = [e for e in client.search_experiments() if e.name.startswith("fedlightning")]
    assert exp.name == "fedlightning/fl"  # one experiment, made once
    runs = client.search_runs([exp.experiment_id], max_results=100)
    assert sorted(r.info.run_name for r in runs) == sorted(f"run-seed{i}" for i in range(n))
    assert {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        assert [m.step for m in client.get_metric_history(r.info.run_id, "curves/val_acc")] == [
            1,
            2,
            3,
        ]
        assert r.data.params["federation.rounds"] == "3"
        assert [a.path for a in client.list_artifacts(r.info.run_id)] == [
            f"summary_{r.data.tags['seed']}.json"
        ]


def test_local_store_paths():
    assert str(local_store("sqlite:///mlflow.db")) == "mlflow.db"
    assert str(local_store("sqlite:////tmp/x/mlflow.db?timeout=5")) == "/tmp/x/mlflow.db"
    assert str(local_store("file:///tmp/mlruns")) == "/tmp/mlruns"
    assert str(local_store("./mlruns")) == "mlruns"
    for remote in ("http://host:5000", "postgresql://u@h/db", "sqlite://", "databricks"):
        assert local_store(remote) is None or remote == "databricks"


TRAININGS = 3  # without the lock, 2 of 3 real trainings lost their runs (the reported failure)


@pytest.mark.slow
def test_real_trainings_at_once_on_a_fresh_store(tmp_path):
    """Three real `fedlightning train` runs, started together on a fresh SQLite store (each
    pays its interpreter's and torch's start-up: the race under many more processes is
    :func:`test_processes_on_a_fresh_store_all_log_their_runs`'s)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    procs = [
        subprocess.Popen(
            [FL, "train", "experiment=demo", "federation.rounds=1", "federation.local_epochs=1",
             "dataset.num_nodes=300", f"seed={i}", f"hydra.run.dir=run_{i}"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(TRAININGS)
    ]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=HANG_GUARD_S)
        assert p.returncode == 0, err[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("fedlightning/cil")
    runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'")
    assert sorted(r.data.tags["seed"] for r in runs) == [str(i) for i in range(TRAININGS)]
    for i in range(TRAININGS):
        assert (tmp_path / f"run_{i}" / "summary.json").exists()
