"""A sweep ends cleanly: a failure marks its MLflow run FAILED, a resume updates the trials
it wants, the end names the output folder and the MLflow run, Optuna's lines go to the
sweep's log; ``sweep dashboard`` opens optuna-dashboard on the study's storage; ``report``
picks each task's own metrics."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import optuna
import pytest

from fedlightning.config import compose
from fedlightning.errors import DataError
from fedlightning.report import DEFAULT_METRICS
from fedlightning.sweeps import Sweep, load_spec
from tests.inprocess import fl_here, fl_ok

SPEC = """
experiment: fl_synthetic
space:
  algorithm.mu: {type: float, low: 0.001, high: 0.1, log: true}
overrides: [algorithm=fedprox]
objective: {metric: val_acc}
trials: 1
storage: sqlite:///optuna.db
"""


@pytest.fixture
def sweep_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(tmp_path / "cache"))
    (tmp_path / "s.yaml").write_text(SPEC)
    return tmp_path


def parent_run(root: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fedlightning/sweep")
    runs = client.search_runs([exp.experiment_id], "tags.task = 'sweep'")
    assert len(runs) == 1
    return runs[0]


def test_a_failing_sweep_marks_its_run_failed(sweep_env):
    def missing_data(cfg, run_dir, observe):
        raise DataError(sweep_env / "data" / "cora.npz", "not found")

    spec = load_spec(sweep_env / "s.yaml")
    with pytest.raises(DataError):
        Sweep(spec, sweep_env / "out", [], compose, missing_data).run()
    assert parent_run(sweep_env).info.status == "FAILED"


def test_a_resumed_sweep_updates_its_trials(sweep_env):
    def fake_train(cfg, run_dir, observe):  # the objective without training
        return {"metrics": {"val_acc": float(cfg.algorithm.mu)}}

    spec = load_spec(sweep_env / "s.yaml")
    Sweep(spec, sweep_env / "out", [], compose, fake_train).run()
    first = parent_run(sweep_env)
    assert (first.info.status, first.data.tags["trials"]) == ("FINISHED", "1")
    spec.trials = 2
    study = Sweep(spec, sweep_env / "out", [], compose, fake_train).run()
    again = parent_run(sweep_env)
    assert again.info.run_id == first.info.run_id and again.data.tags["trials"] == "2"
    assert len(study.trials) == 2 and again.info.status == "FINISHED"


@pytest.fixture
def clean_logging():
    """Restore what ``fedlightning sweep`` sets on the ``optuna`` and warnings loggers."""
    names = ("optuna", "py.warnings")
    saved = {
        n: (list(logging.getLogger(n).handlers), logging.getLogger(n).propagate) for n in names
    }
    yield
    for n, (handlers, propagate) in saved.items():
        logging.getLogger(n).handlers[:] = handlers
        logging.getLogger(n).propagate = propagate
    logging.captureWarnings(False)
    optuna.logging.enable_default_handler()


def test_the_end_names_the_output_and_the_mlflow_run(sweep_env, clean_logging):
    over = ["federation.rounds=1", "federation.local_epochs=1", "dataset.num_nodes=200"]
    r = fl_ok(["sweep", "s.yaml", "--out", "out", *over], sweep_env, {})
    run = parent_run(sweep_env)
    assert f"output           {Path('out') / 's'} (" in r.stdout
    assert f"mlflow run       {run.info.run_id} (" in r.stdout
    log = sweep_env / "out" / "s" / "sweep.log"
    optuna.logging.get_logger("optuna.study").warning("a warning of Optuna's")
    assert "a warning of Optuna's" in log.read_text()
    assert "optuna" not in r.stderr.lower()


def test_dashboard_opens_on_the_studys_storage(sweep_env, monkeypatch):
    r = fl_here(["sweep", "dashboard", "s.yaml"], sweep_env, {})
    if "optuna_dashboard" not in sys.modules:
        try:
            import optuna_dashboard  # noqa: F401
        except ImportError:
            assert r.returncode == 2 and "pip install 'fedlightning[dashboard]'" in r.stderr
    served = []
    fake = types.SimpleNamespace(run_server=lambda storage, **kw: served.append((storage, kw)))
    monkeypatch.setitem(sys.modules, "optuna_dashboard", fake)
    r = fl_ok(["sweep", "dashboard", "s.yaml", "--port", "8099"], sweep_env, {})
    assert served == [("sqlite:///optuna.db", {"host": "127.0.0.1", "port": 8099})]
    assert "http://127.0.0.1:8099/" in r.stdout


def test_report_picks_each_tasks_own_metrics(tmp_path):
    """``report --task fl`` on two plain runs: their accuracies, not AM/FM/FPR95."""
    for seed, acc in ((0, 0.5), (1, 0.7)):
        run = tmp_path / "runs" / f"s{seed}"
        run.mkdir(parents=True)
        tags = {"task": "fl", "method": "fedavg", "dataset": "cora", "variant": "full"}
        tags |= {"backbone": "gcn", "seed": str(seed), "experiment": "fedavg_cora"}
        summary = {"experiment": "fedavg_cora", "seed": seed, "tags": tags, "wall_time_s": 1.0}
        summary |= {"metrics": {"test_acc": acc, "val_acc": acc - 0.1}}
        summary |= {"comm": {"uplink_mib": 2.0, "downlink_mib": 2.0}, "config": {}}
        (run / "summary.json").write_text(json.dumps(summary))
    r = fl_ok(["report", "--task", "fl", "--dirs", "runs", "--out", "rep"], tmp_path, {})
    table = json.loads((tmp_path / "rep" / "fl_main_cora.json").read_text())
    assert set(table["fedavg"]["cora"]) == set(DEFAULT_METRICS["fl"].split(","))
    assert table["fedavg"]["cora"]["test_acc"]["mean"] == pytest.approx(0.6)
    assert "\x1b" not in r.stdout and "%|" not in r.stderr  # no progress bars when piped
