"""tools/claims_study.py end to end at the smallest setting: a real sweep file of
sweeps/claims/ on Cora, its best trial's parameters run at the evaluation seeds, FedOGL's
ablations at that setting, the tables and the drift diagnostics."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "claims_study.py"


def _module():
    spec = importlib.util.spec_from_file_location("claims_study", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plasticity_is_the_mean_of_the_accuracy_matrix_diagonal():
    acc = [[0.9, None, None], [0.5, 0.7, None], [0.4, 0.3, 0.2]]
    assert _module().plasticity(acc) == pytest.approx((0.9 + 0.7 + 0.2) / 3)


def test_progress_curves_are_seed_means_per_stage_and_round(tmp_path):
    def run(seed, seen, accs, method="fedogl"):
        d = tmp_path / "best" / f"cir_{method}_citeseer_mm" / f"seed{seed}"
        d.mkdir(parents=True)
        tags = {"task": "cir", "dataset": "citeseer_mm", "method": method, "variant": "full"}
        stages = [{"seen_acc": v} for v in seen]
        (d / "summary.json").write_text(json.dumps({"tags": tags, "stages": stages}))
        (d / "history.json").write_text(json.dumps([{"test_acc": a} for a in accs]))

    run(0, [0.4, 0.2], [0.1, 0.3, 0.5])
    run(1, [0.6, 0.4], [0.3, 0.5, 0.7])
    run(0, [0.1, 0.1], [0.0, 0.0, 0.0], method="fedavg")
    curves = _module().progress(tmp_path)
    seen, rounds = curves[("cir", "citeseer_mm", "fedogl")]
    assert seen == pytest.approx([0.5, 0.3]) and rounds == pytest.approx([0.2, 0.4, 0.6])
    assert set(curves) == {("cir", "citeseer_mm", "fedogl"), ("cir", "citeseer_mm", "fedavg")}
    assert (tmp_path / "report" / "rounds_cir_citeseer_mm.png").stat().st_size > 0


@pytest.mark.slow
def test_claims_study_runs_the_best_setting_and_the_ablations(shared_data, tmp_env, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    out = tmp_env / "claims"
    cmd = [sys.executable, str(SCRIPT), "--only", "cil_fedogl_cora", "--trials", "2"]
    # two stages of one round and one local epoch, and no MLflow store: the study's tables
    # come from the run folders, and MLflow's store and runs took about 40% of the study's
    # time (a sweep's MLflow runs are tests/test_sweeps.py's to check, a run's
    # tests/test_mlflow_layout.py's)
    small = ["protocol.stream.stages=[2,2]", "federation.rounds=1", "federation.local_epochs=1"]
    cmd += ["--seeds", "1", "--out", str(out), "--set", *small, "logger=none"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    best = json.loads((out / "best" / "cil_fedogl_cora" / "best.json").read_text())
    study = optuna.load_study(
        study_name="cil_fedogl_cora", storage=f"sqlite:///{out / 'optuna' / 'cil_fedogl_cora.db'}"
    )
    assert len(study.trials) == 2 and best["params"] == study.best_trial.params
    assert best["val_am"] == pytest.approx(study.best_value)
    space = yaml.safe_load((REPO / "sweeps/claims/cil_fedogl_cora.yaml").read_text())["space"]
    assert set(best["params"]) == set(space)
    for seed in (1,):  # the tuned values are the runs' config
        run = out / "best" / "cil_fedogl_cora" / f"seed{seed}"
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["seed"] == seed
        for key, value in best["params"].items():
            node = cfg
            for part in key.split("."):
                node = node[part]
            assert node == pytest.approx(value)
    for c in ("replay", "distill", "projection", "prototypes"):
        runs = sorted((out / "ablations" / "cil_fedogl_cora" / f"no_{c}").glob("seed*/config.yaml"))
        assert len(runs) == 1 and all(
            yaml.safe_load(r.read_text())["algorithm"][c] is False for r in runs
        )
    report = out / "report"
    assert "fedogl" in (report / "claims_cil.md").read_text()
    ablation = (report / "claims_cil_ablation.md").read_text()
    assert all(f"no_{c}" in ablation for c in ("replay", "distill", "projection", "prototypes"))
    mechanism = (report / "mechanism_cora.md").read_text().splitlines()
    assert len(mechanism) == 2 + 5 and (report / "drift_cora.png").stat().st_size > 0
    assert (report / "seen_cil_cora.png").stat().st_size > 0
    assert "compute:" in done.stdout


def test_a_rejection_study_keeps_its_overrides_and_names_its_objective(tmp_path, monkeypatch):
    """A study of sweeps/claims/rejection/: its fixed overrides (the accuracy-tuned setting)
    reach every seed run beside the best parameters, and best.json names its metric."""
    mod = _module()
    sweep = REPO / "sweeps/claims/rejection/cil_grasp_cora.yaml"
    spec = yaml.safe_load(sweep.read_text())
    calls = []
    monkeypatch.setattr(mod, "fedlightning", lambda args, log: calls.append(args) or 1.0)
    monkeypatch.setattr(
        mod, "best_params", lambda storage, study: ({"algorithm.steps": 3}, 0.25, 7)
    )
    args = SimpleNamespace(out=str(tmp_path), set=[], seeds=[0, 1], trials=None)
    args.experiment_name = "x"
    assert mod.one_study(sweep, args) == 3.0  # the sweep and two seed runs
    best = json.loads((tmp_path / "best" / "cil_grasp_cora" / "best.json").read_text())
    assert spec["objective"] == {"metric": "val_fpr95", "direction": "minimize"}
    assert best["val_fpr95"] == 0.25 and best["trial"] == 7
    for seed, run in zip((0, 1), calls[1:], strict=True):
        assert run[:3] == ["train", "experiment=cil_cora", f"seed={seed}"]
        assert "algorithm=cil_grasp" in run  # the recipe's method, from the study's overrides
        assert run[3 : 3 + len(spec["overrides"])] == spec["overrides"]
        assert "algorithm.steps=3" in run
