"""MLflow for sweeps: the study's parent run, a nested run per trial, and the final plots."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from fedlightning.tracking.mlflow_tracker import mlflow_experiment
from fedlightning.tracking.plots import (
    plot_importances,
    plot_optimization_history,
    plot_sensitivity,
)

PARENT_ATTR = "mlflow_parent_run_id"


class SweepTracker:
    """Parent and trial runs of a study in one MLflow experiment (the experiment's
    ``logger.tracking_uri`` and ``logger.experiment_name``)."""

    def __init__(self, tracking_uri: str, experiment_name: str) -> None:
        self.client, self.exp_id = mlflow_experiment(tracking_uri, experiment_name)

    def parent(self, study: optuna.Study, spec: Any) -> str:
        """The study's run: created once, found again through the study on resume."""
        run_id = study.user_attrs.get(PARENT_ATTR)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        tags = {
            "task": "sweep",
            "experiment": spec.experiment,
            "study": study.study_name,
            "objective": spec.metric,
            "direction": spec.direction,
            "storage": spec.storage,
            "sweep_file": str(spec.path),
        }
        run = self.client.create_run(self.exp_id, run_name=f"sweep-{study.study_name}", tags=tags)
        run_id = run.info.run_id
        keys = ("trials", "seeds", "sampler", "pruner", "overrides")
        params = {k: json.dumps(getattr(spec, k)) for k in keys}
        params |= {f"space.{k}": json.dumps(v) for k, v in spec.space.items()}
        for k, v in params.items():
            self.client.log_param(run_id, k, str(v)[:6000])
        study.set_user_attr(PARENT_ATTR, run_id)
        return run_id

    def trial(self, parent: str, trial: optuna.Trial, params: dict[str, Any]) -> str:
        """A nested run for one trial, with its sampled parameters."""
        tags = {"mlflow.parentRunId": parent, "task": "sweep_trial", "trial": str(trial.number)}
        if "retry_of" in trial.user_attrs:
            tags["retry_of"] = str(trial.user_attrs["retry_of"])
        run = self.client.create_run(self.exp_id, run_name=f"trial-{trial.number}", tags=tags)
        for k, v in params.items():
            self.client.log_param(run.info.run_id, k, v)
        return run.info.run_id

    def end_trial(
        self, run: str, status: str, value: float | None, values: list[float], trial_dir: Path
    ) -> None:
        if value is not None and math.isfinite(value):
            self.client.log_metric(run, "objective", value)
        for i, v in enumerate(values):
            if math.isfinite(v):
                self.client.log_metric(run, "objective_seed", v, step=i)
        self.client.set_tag(run, "run_dir", str(trial_dir.resolve()))
        self.client.set_terminated(run, status=status)

    def finish(self, study: optuna.Study, spec: Any, parent: str, out_dir: Path) -> None:
        """Best parameters, trial table and plots on the parent run; the parent ends."""
        out_dir.mkdir(parents=True, exist_ok=True)
        files = [write_trials_csv(study, out_dir / "trials.csv")]
        done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
        if done:
            best = study.best_trial
            self.client.log_metric(parent, "best_value", best.value)
            self.client.set_tag(parent, "best_trial", str(best.number))
            for k, v in best.params.items():
                self.client.set_tag(parent, f"best.{k}", str(v))
            path = out_dir / "best_params.json"
            path.write_text(json.dumps({"value": best.value, "params": best.params}, indent=2))
            files.append(path)
            files += sweep_plots(study, spec, out_dir)
        for f in files:
            self.client.log_artifact(parent, str(f))
        self.client.set_terminated(parent, status="FINISHED")


def write_trials_csv(study: optuna.Study, path: Path) -> Path:
    """One row per trial: number, state, value, per-seed values, parameters."""
    keys = sorted({k for t in study.get_trials(deepcopy=False) for k in t.params})
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["number", "state", "value", "seed_values", *keys])
        for t in study.get_trials(deepcopy=False):
            seed_values = json.dumps(t.user_attrs.get("seed_values", []))
            w.writerow(
                [t.number, t.state.name, t.value, seed_values, *(t.params.get(k) for k in keys)]
            )
    return path


def sweep_plots(study: optuna.Study, spec: Any, out_dir: Path) -> list[Path]:
    """Optimization history, parameter importances, and one sensitivity curve a parameter."""
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    maximize = spec.direction == "maximize"
    paths = [
        plot_optimization_history(
            [t.value for t in done], out_dir / "optimization_history.png", maximize, spec.metric
        )
    ]
    if len(done) >= 2 and len(spec.space) >= 1:
        try:
            imp = optuna.importance.get_param_importances(study)
        except (RuntimeError, ValueError):  # e.g. every trial at the same point
            imp = {}
        if imp:
            paths.append(plot_importances(imp, out_dir / "param_importance.png"))
    for key, p in spec.space.items():
        numeric = [t for t in done if isinstance(t.params.get(key), (int, float))]
        xs = [t.params[key] for t in numeric]
        if len(set(xs)) < 2:
            continue
        seeds = [t.user_attrs.get("seed_values") or [t.value] for t in numeric]
        name = key.replace("/", "_")
        paths.append(
            plot_sensitivity(
                xs,
                seeds,
                out_dir / f"sensitivity_{name}.png",
                key,
                spec.metric,
                log_x=bool(p.get("log")),
            )
        )
    return paths
