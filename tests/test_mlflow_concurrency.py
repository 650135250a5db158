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

# One process: import the tracker, say it is ready, wait for the common start, then log a
# run as a training run does (tags and the config's params, per-round metrics, final
# metrics, an artifact, the end).
WORKER = """
import sys, time
from pathlib import Path
from fedlightning.tracking import MlflowTracker
uri, i, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
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
"""


def start_at_once(uri: str, n: int, folder: Path) -> list[subprocess.CompletedProcess]:
    """``n`` worker processes, released together once all of them have imported MLflow."""
    env = {
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps the file store for those who ask
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, uri, str(i), str(folder)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + HANG_GUARD_S
    while len(list(folder.glob("ready_*"))) < n and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    (folder / "go").touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=HANG_GUARD_S)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


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
        assert [m.step for m in client.get_metric_history(r.info.run_id, "val_acc")] == [1, 2, 3]
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


@pytest.mark.slow
def test_five_trainings_at_once_on_a_fresh_store(tmp_path):
    """Five real `fedlightning train` runs, started together on a fresh SQLite store."""
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
        for i in range(5)
    ]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=HANG_GUARD_S)
        assert p.returncode == 0, err[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("fedlightning/cil")
    runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'")
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "1", "2", "3", "4"]
    for i in range(5):
        assert (tmp_path / f"run_{i}" / "summary.json").exists()
