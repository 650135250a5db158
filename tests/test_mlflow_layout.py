"""The MLflow layout a user navigates (docs/experiments.md, "MLflow layout"): one experiment
per task family, run names with the seed, per-round curves, stage metrics at the round where
the stage ends, final metrics once at the last round; `report` finds runs by their tags
across the family experiments and the single experiment of older versions."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import fedlightning
from fedlightning.tracking.mlflow_tracker import run_name
from fedlightning.train import train

SMALL = ["federation.rounds=2", "federation.local_epochs=1", "dataset.num_nodes=300"]


@pytest.mark.slow
def test_layout_through_the_mlflow_client(tmp_env, compose, capsys):
    uri = f"sqlite:///{tmp_env / 'mlflow.db'}"
    cil = train(compose(["experiment=demo", "seed=3", *SMALL]), tmp_env / "job_0", verbose=False)
    fl = train(compose(["experiment=fl_synthetic", "algorithm=fedavg", "seed=1", *SMALL]), tmp_env / "job_1", verbose=False)  # fmt: skip

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    names = {e.name for e in client.search_experiments()}
    assert {"fedlightning/cil", "fedlightning/fl"} <= names and "fedlightning" not in names

    def run_of(job: str):
        return client.get_run(json.loads((tmp_env / job / "mlflow_run.json").read_text())["run_id"])

    r_cil, r_fl = run_of("job_0"), run_of("job_1")
    exp = {e.experiment_id: e.name for e in client.search_experiments()}
    assert exp[r_cil.info.experiment_id] == "fedlightning/cil"
    assert exp[r_fl.info.experiment_id] == "fedlightning/fl"
    # the seed, not the run folder (a multirun's job number), ends the name
    assert r_cil.info.run_name == "fedogl-synthetic-s3"
    assert r_fl.info.run_name == "fedavg-synthetic-s1"
    assert r_cil.data.tags["run_dir"] == str((tmp_env / "job_0").resolve())

    def steps(run, key: str) -> list[int]:
        return [m.step for m in client.get_metric_history(run.info.run_id, key)]

    # class-incremental: stages [2, 1, 1] x 2 rounds = 6 rounds; a stage ends every 2 rounds
    assert cil["rounds"] == 6
    assert steps(r_cil, "curves/test_acc") == [1, 2, 3, 4, 5, 6]  # one point per round
    assert steps(r_cil, "stage/fpr95") == [2, 4, 6]  # at the round where the stage ends
    assert steps(r_cil, "final/am") == [6]  # once, at the last round
    assert r_cil.data.metrics["final/am"] == pytest.approx(cil["metrics"]["am"])
    # seconds per round, measured by the run, logged beside the final metrics
    assert steps(r_cil, "final/s_per_round") == [6]
    assert r_cil.data.metrics["final/s_per_round"] == pytest.approx(cil["timing"]["s_per_round"])
    assert not [k for k in r_cil.data.metrics if k.startswith(("final_", "stage_"))]
    assert steps(r_fl, "curves/test_acc") == [1, 2] and steps(r_fl, "final/test_acc") == [2]
    assert r_fl.data.metrics["final/test_acc"] == pytest.approx(fl["metrics"]["test_acc"])

    # `report` finds the run in fedlightning/cil and an older run in the single experiment
    # "fedlightning"; a sweep trial's nested run is not a row
    old = client.create_experiment("fedlightning")
    tags = {k: v for k, v in r_cil.data.tags.items() if not k.startswith("mlflow.")}
    for name, extra in (("old", {}), ("nested", {"mlflow.parentRunId": r_fl.info.run_id})):
        run = client.create_run(old, run_name=name, tags={**tags, **extra})
        path = tmp_env / name / "summary.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**cil, "seed": 7 if name == "old" else 8}))
        client.log_artifact(run.info.run_id, str(path))
        client.set_terminated(run.info.run_id)
    from fedlightning.report import main

    assert main(["--task", "cil", "--tracking-uri", uri, "--out", str(tmp_env / "rep")]) == 0
    table = json.loads((tmp_env / "rep" / "cil_main_synthetic.json").read_text())
    assert table["fedogl"]["synthetic"]["am"]["n"] == 2  # seeds 3 and 7, not the nested 8


def ui_chart_order(keys: list[str]) -> list[str]:
    """The order in which MLflow 3's run page charts metrics (its bundled UI,
    ``getBaseChartAndSectionConfigs``): a section per name before the last '/', the named
    sections sorted, then the unprefixed "Model metrics", then ``system/``; in a section, the
    keys sorted."""

    def section(key: str) -> str:
        return key.rsplit("/", 1)[0] if "/" in key else ""

    named = sorted({section(k) for k in keys} - {"", "system"})
    order = [*named, "", "system"]
    return sorted(keys, key=lambda k: (order.index(section(k)), k))


def test_the_ui_opens_on_training_runs_and_their_curves(tmp_env, compose):
    """One small run, read back through MlflowClient: its experiment is tagged as model
    training with its family's description and keeps artifacts beside the store; the run
    carries its command line, version and commit; the first charts are per-round curves."""
    from mlflow.tracking import MlflowClient

    over = ["protocol.stream.stages=[3]", "federation.rounds=3", *SMALL[1:]]
    cfg = compose(over)
    s = train(cfg, tmp_env / "run", verbose=False)
    client = MlflowClient(f"sqlite:///{tmp_env / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fedlightning/cil")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "class-incremental" in exp.tags["mlflow.note.content"]
    assert exp.artifact_location == (tmp_env / "mlartifacts" / "fedlightning" / "cil").as_uri()
    (run,) = client.search_runs([exp.experiment_id])
    tags = run.data.tags
    assert run.info.run_name == "fedogl-synthetic-s0" == run_name("fedogl", "synthetic", 0)
    assert len(run.info.run_name) <= 24
    assert tags["fedlightning_version"] == fedlightning.__version__
    assert tags["command"] == tags["mlflow.source.name"] and tags["command"]
    commit = subprocess.run(
        ["git", "-C", str(Path(fedlightning.__file__).parent), "rev-parse", "HEAD"],
        capture_output=True, text=True,
    )  # fmt: skip
    if commit.returncode == 0:  # a checkout (an installed wheel has no commit)
        assert tags["mlflow.source.git.commit"] == commit.stdout.strip()
    charts = ui_chart_order(list(run.data.metrics))
    first = charts[0]
    assert first.startswith("curves/"), charts[:5]
    history = client.get_metric_history(run.info.run_id, first)
    assert [m.step for m in history] == [1, 2, 3]  # a curve, not a single dot
    assert charts.index("final/am") > max(
        i for i, k in enumerate(charts) if k.startswith("curves/")
    )
    assert run.data.metrics["final/am"] == pytest.approx(s["metrics"]["am"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "summary.json" in artifacts
    assert (tmp_env / "mlartifacts" / "fedlightning" / "cil" / run.info.run_id).is_dir()


def test_ui_chart_order_follows_the_sections():
    keys = ["test_acc", "final/am", "stage/fpr95", "curves/val_acc", "system/cpu", "curves/a"]
    assert ui_chart_order(keys) == [
        "curves/a", "curves/val_acc", "final/am", "stage/fpr95", "test_acc", "system/cpu",
    ]  # fmt: skip
