"""The command line as a user runs it: `fedlightning train ...` in a fresh directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.inprocess import fl_ok

pytestmark = pytest.mark.slow


def fl(args: list[str], cwd: Path, env: dict | None = None, module: bool = False):
    cmd = (
        [sys.executable, "-m", "fedlightning"]
        if module
        else [str(Path(sys.executable).parent / "fedlightning")]
    )
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [*cmd, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600
    )


def run_dirs(root: Path, name: str) -> list[Path]:
    """The runs of experiment ``name``: ``outputs/<data>/<name>/<time>``."""
    return sorted(p for p in (root / "outputs").glob(f"*/{name}/*") if p.is_dir())


@pytest.fixture
def cli_env(tmp_path, shared_data):
    return {
        "FEDLIGHTNING_DATA": str(shared_data),
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }


def test_default_demo_logs_everything_to_mlflow(tmp_path, cli_env):
    env = {k: v for k, v in cli_env.items() if k != "MLFLOW_TRACKING_URI"}  # the default store
    r = fl(["train", "federation.rounds=2", "plots=true"], tmp_path, env)  # stages [2, 1, 1]
    assert r.returncode == 0, r.stderr
    assert "test_acc" in r.stdout and "uplink" in r.stdout and "fpr95" in r.stdout  # summary
    (run,) = run_dirs(tmp_path, "demo")
    summary = json.loads((run / "summary.json").read_text())
    assert (run / "config.yaml").exists() and (run / "partition.json").exists()
    assert (
        summary["hashes"]["partition"] == json.loads((run / "partition.json").read_text())["hash"]
    )
    assert (tmp_path / "mlflow.db").exists()  # default: ./mlflow.db

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = json.loads((run / "mlflow_run.json").read_text())["run_id"]
    mrun = client.get_run(run_id)
    tags = mrun.data.tags
    for key, value in {
        "method": "fedogl",
        "dataset": "synthetic",
        "task": "cil",
        "variant": "full",
        "backbone": "gcn",
        "seed": "0",
        "hash_partition": summary["hashes"]["partition"],
    }.items():
        assert tags[key] == value
    assert mrun.data.params["federation.rounds"] == "2"
    assert mrun.data.params["dataset.missing_rate"] == "0.2"  # some nodes lack a modality
    assert mrun.data.params["algorithm._target_"] == "fedlightning.methods.fedogl.fedogl.FedOGL"
    assert mrun.data.params["threads"] == "auto"  # the setting, and the number it gave
    assert int(mrun.data.params["threads_used"]) == summary["threads"] >= 1
    hist = client.get_metric_history(run_id, "curves/test_acc")
    assert [m.step for m in hist] == [1, 2, 3, 4, 5, 6]
    for key in ("am", "fm", "fpr95", "val_am", "d_sem"):
        assert mrun.data.metrics[f"final/{key}"] == pytest.approx(summary["metrics"][key])
    assert hist[-1].value == pytest.approx(summary["metrics"]["test_acc"])
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.json", "config.yaml", "curves.png", "partition.json", "stream.json"} <= arts
    assert mrun.info.status == "FINISHED"


def test_python_m_and_multirun(tmp_path, cli_env):
    r = fl(
        ["train", "-m", "seed=0,1", "federation.rounds=1", "logger=none"],
        tmp_path,
        cli_env,
        module=True,
    )
    assert r.returncode == 0, r.stderr
    sums = sorted((tmp_path / "multirun").rglob("summary.json"))
    assert len(sums) == 2
    seeds = sorted(json.loads(p.read_text())["seed"] for p in sums)
    assert seeds == [0, 1]


def test_lightning_ddp_refuses_multirun(tmp_path, cli_env):
    """Lightning's launcher would start the whole sweep again as rank 1: one-line error."""
    ddp = ["runner=sequential_trainer", "runner.executor.devices=2"]
    r = fl(["train", "-m", "seed=0,1", *ddp, "logger=none"], tmp_path, cli_env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "runner.executor.devices" in line and "multirun" in line


def test_truncated_npz_is_named(tmp_path, cli_env, shared_data):
    data = tmp_path / "data" / "gnn_benchmark"
    data.mkdir(parents=True)
    (data / "cora.npz").write_bytes(
        (shared_data / "gnn_benchmark" / "cora.npz").read_bytes()[:5000]
    )
    r = fl(
        ["train", "experiment=fl_cora", "algorithm=fedavg", "dataset.source=npz", "logger=none"],
        tmp_path,
        {**cli_env, "FEDLIGHTNING_DATA": str(tmp_path / "data")},
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "cora.npz" in line


def test_unknown_experiment_name_fails_cleanly(tmp_path, cli_env):
    r = fl(["train", "experiment=nope"], tmp_path, cli_env)
    assert r.returncode != 0 and "nope" in r.stderr and "Traceback" not in r.stderr


def test_killed_run_resumes_to_identical_metrics(tmp_path, cli_env):
    base = [
        "train",
        "experiment=fl_cora",
        "algorithm=fedavg",
        "federation.rounds=4",
        "federation.local_epochs=2",
    ]
    fl_ok([*base, "hydra.run.dir=full", "logger=none"], tmp_path, cli_env)
    killed = fl([*base, "hydra.run.dir=killed", "runner.kill_at=3:2"], tmp_path, cli_env)
    assert killed.returncode == -9  # SIGKILL after the second client of round 3
    assert not (tmp_path / "killed" / "summary.json").exists()
    resumed = fl(["train", "resume=killed"], tmp_path, cli_env)
    assert resumed.returncode == 0, resumed.stderr
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert a["metrics"] == b["metrics"]  # bitwise: same floats
    assert a["comm"] == b["comm"] and a["hashes"] == b["hashes"] and b["resumed"] is True
    hist_a = json.loads((tmp_path / "full" / "history.json").read_text())
    hist_b = json.loads((tmp_path / "killed" / "history.json").read_text())
    assert [h["test_acc"] for h in hist_a] == [h["test_acc"] for h in hist_b]
    # the MLflow run continues: one run, metrics of all four rounds
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cli_env["MLFLOW_TRACKING_URI"])
    run_id = json.loads((tmp_path / "killed" / "mlflow_run.json").read_text())["run_id"]
    assert sorted({m.step for m in client.get_metric_history(run_id, "curves/test_acc")}) == [
        1,
        2,
        3,
        4,
    ]
    assert client.get_run(run_id).info.status == "FINISHED"
    shutil.rmtree(tmp_path / "full")


def test_fedogl_killed_after_a_stage_end_resumes_identically(tmp_path, cli_env):
    """The default demo (FedOGL: prototype banks and bases that grow at every stage end)
    killed in stage 2 resumes to the uninterrupted run's metrics and ledger."""
    base = ["train", "federation.rounds=2", "logger=none"]
    fl_ok([*base, "hydra.run.dir=full"], tmp_path, cli_env)
    killed = fl([*base, "hydra.run.dir=killed", "runner.kill_at=3:2"], tmp_path, cli_env)
    assert killed.returncode == -9
    resumed = fl([*base, "resume=killed"], tmp_path, cli_env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "killed"))
    assert a["metrics"] == b["metrics"] and a["comm"] == b["comm"] and b["resumed"] is True
    # FEDLIGHTNING_PLOTS=false (the suite's default, tests/conftest.py): tables, no PNG
    assert (tmp_path / "full" / "acc_matrix.csv").exists()
    assert not list((tmp_path / "full").glob("*.png"))


def test_cil_run_logs_stages_and_resumes_identically(tmp_path, cli_env):
    base = [
        "train",
        "experiment=cil_cora",
        "algorithm=cil_fedavg_replay",
        "federation.rounds=2",
        "plots=true",
        "algorithm.lambda_dis=1.0",
    ]
    fl_ok([*base, "hydra.run.dir=full", "logger=none"], tmp_path, cli_env)
    killed = fl([*base, "hydra.run.dir=killed", "runner.kill_at=3:2"], tmp_path, cli_env)
    assert killed.returncode == -9  # in stage 2, after the teacher was frozen for 2 clients
    resumed = fl(["train", "resume=killed", "plots=true"], tmp_path, cli_env)
    assert resumed.returncode == 0, resumed.stderr
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert a["metrics"] == b["metrics"] and a["acc_matrix"] == b["acc_matrix"]
    assert a["hashes"] == b["hashes"] and set(a["hashes"]) == {"partition", "stream"}
    assert "am" in resumed.stdout and "fpr95" in resumed.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(cli_env["MLFLOW_TRACKING_URI"])
    run_id = json.loads((tmp_path / "killed" / "mlflow_run.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.data.tags["task"] == "cil" and run.data.tags["hash_stream"] == a["hashes"]["stream"]
    assert [m.step for m in client.get_metric_history(run_id, "stage/fpr95")] == [2, 4, 6]
    arts = {x.path for x in client.list_artifacts(run_id)}
    assert {"acc_matrix.png", "acc_matrix.csv", "seen_acc.png", "stream.json"} <= arts
