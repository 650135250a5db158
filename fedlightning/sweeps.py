"""Optuna studies over Hydra configs: ``fedlightning sweep sweeps/<name>.yaml``.

Every trial runs the file's experiment once per seed with the sampled overrides, in process;
its value is the objective's mean over the seeds. The study lives in an Optuna storage, so
it resumes and can be shared by several processes: a trial whose process died is marked
failed and its parameters run again, resuming its checkpointed runs (docs/experiments.md).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import socket
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import psutil  # a dependency of torch-geometric
from omegaconf import OmegaConf
from optuna.trial import TrialState

from fedlightning.errors import ConfigError, RunStopped
from fedlightning.tracking import MlflowTracker
from fedlightning.tracking.plots import (
    plot_importances,
    plot_optimization_history,
    plot_sensitivity,
)

log = logging.getLogger(__name__)

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("none", "median", "threshold")
PARAM_TYPES = ("float", "int", "categorical")
# Objectives measured only at a stage's end report this stage metric while the run goes.
STAGE_PROXY = {"val_am": "val_seen_acc", "val_fpr95": "val_fpr95"}
PARENT_ATTR = "mlflow_parent_run_id"


@dataclass
class SweepSpec:
    """A sweep file checked by :func:`load_spec`, its defaults filled in; ``path`` for
    error messages."""

    path: Path
    experiment: str
    space: dict[str, dict[str, Any]]
    metric: str
    direction: str
    trials: int
    seeds: list[int]
    overrides: list[str]
    sampler: dict[str, Any]
    pruner: dict[str, Any]
    storage: str
    study_name: str


def _fail(path: Path, key: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {key}", message)


def _check_param(path: Path, key: str, p: Any) -> dict[str, Any]:
    where = f"space.{key}"
    if not isinstance(p, dict) or p.get("type") not in PARAM_TYPES:
        raise _fail(path, where, f"needs `type` in {PARAM_TYPES}, got {p!r}")
    if p["type"] == "categorical":
        if not isinstance(p.get("choices"), list) or not p["choices"]:
            raise _fail(path, f"{where}.choices", "a categorical parameter needs a non-empty list")
        return p
    for bound in ("low", "high"):
        if not isinstance(p.get(bound), (int, float)) or isinstance(p.get(bound), bool):
            raise _fail(path, f"{where}.{bound}", f"must be a number, got {p.get(bound)!r}")
    if p["low"] > p["high"]:
        raise _fail(path, where, f"low ({p['low']}) must not exceed high ({p['high']})")
    if p.get("log") and p["low"] <= 0:
        raise _fail(path, f"{where}.low", f"a log-scale range needs low > 0, got {p['low']}")
    return p


def load_spec(path: str | Path) -> SweepSpec:
    """Read and check a sweep file; every error names the file and the field. The objective
    must be a validation metric (``val_*``): a sweep never tunes on test data."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "sweep file not found")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "a sweep file is a mapping")
    known = {"experiment", "space", "objective", "trials", "seeds", "overrides", "sampler"}
    known |= {"pruner", "storage", "study_name"}
    extra = sorted(set(raw) - known)
    if extra:
        raise _fail(path, extra[0], f"unknown field; the fields are {sorted(known)}")
    if not isinstance(raw.get("experiment"), str):
        raise _fail(path, "experiment", "name an experiment of conf/experiment/")
    objective = raw.get("objective") or {}
    metric = objective.get("metric")
    if not isinstance(metric, str) or not metric.startswith("val_"):
        raise _fail(
            path,
            "objective.metric",
            f"must be a validation metric (a name starting with `val_`), got {metric!r}: "
            "sweeps select on validation data and report test data",
        )
    direction = objective.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        raise _fail(path, "objective.direction", f"maximize or minimize, got {direction!r}")
    space = raw.get("space")
    if not isinstance(space, dict) or not space:
        raise _fail(path, "space", "name at least one config key to search")
    space = {k: _check_param(path, k, p) for k, p in space.items()}
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise _fail(path, "seeds", f"a non-empty list of integers, got {seeds!r}")
    sampler = dict(raw.get("sampler") or {"name": "tpe"})
    if sampler.get("name") not in SAMPLERS:
        raise _fail(path, "sampler.name", f"one of {SAMPLERS}, got {sampler.get('name')!r}")
    pruner = dict(raw.get("pruner") or {"name": "none"})
    if pruner.get("name") not in PRUNERS:
        raise _fail(path, "pruner.name", f"one of {PRUNERS}, got {pruner.get('name')!r}")
    if sampler["name"] == "grid" and any(p["type"] != "categorical" for p in space.values()):
        raise _fail(path, "space", "the grid sampler needs categorical parameters (choices)")
    size = math.prod(len(p["choices"]) for p in space.values()) if sampler["name"] == "grid" else 0
    trials = raw.get("trials", size or 10)
    if not isinstance(trials, int) or trials < 1:
        raise _fail(path, "trials", f"a positive integer, got {trials!r}")
    if size and trials > size:
        raise _fail(path, "trials", f"{trials} trials exceed the grid's {size} points")
    return SweepSpec(
        path=path,
        experiment=raw["experiment"],
        space=space,
        metric=metric,
        direction=direction,
        trials=trials,
        seeds=seeds,
        overrides=[str(o) for o in raw.get("overrides", [])],
        sampler=sampler,
        pruner=pruner,
        storage=str(raw.get("storage") or "sqlite:///optuna.db"),
        study_name=str(raw.get("study_name") or path.stem),
    )


class AskTellGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler for our ask-and-tell loop, which counts the trials itself: the
    stock sampler calls ``study.stop()`` after the last grid point, which Optuna refuses
    outside ``study.optimize`` (a ``RuntimeError`` on the last ``tell``)."""

    def after_trial(self, study, trial, state, values) -> None:  # noqa: ANN001
        pass


def make_sampler(spec: SweepSpec) -> optuna.samplers.BaseSampler:
    s = spec.sampler
    if s["name"] == "grid":
        grid = {k: list(p["choices"]) for k, p in spec.space.items()}
        return AskTellGridSampler(grid, seed=s.get("seed", 0))
    if s["name"] == "random":
        return optuna.samplers.RandomSampler(seed=s.get("seed", 0))
    return optuna.samplers.TPESampler(seed=s.get("seed", 0), n_startup_trials=s.get("startup", 5))


def make_pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    p = {k: v for k, v in spec.pruner.items() if k != "name"}
    if spec.pruner["name"] == "median":
        return optuna.pruners.MedianPruner(**p)
    if spec.pruner["name"] == "threshold":
        return optuna.pruners.ThresholdPruner(**p)
    return optuna.pruners.NopPruner()


def suggest(trial: optuna.Trial, key: str, p: dict[str, Any]) -> Any:
    """One sampled value of a parameter of the search space."""
    if p["type"] == "categorical":
        return trial.suggest_categorical(key, p["choices"])
    if p["type"] == "int":
        return trial.suggest_int(
            key, int(p["low"]), int(p["high"]), step=int(p.get("step", 1)), log=p.get("log", False)
        )
    return trial.suggest_float(
        key, float(p["low"]), float(p["high"]), step=p.get("step"), log=p.get("log", False)
    )


def _override(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value) if isinstance(value, (list, dict)) else value}"


def _alive(owner: str) -> bool:
    """Whether ``host:pid`` runs; another machine's trial: only its own process can tell."""
    host, _, pid = owner.partition(":")
    return host != socket.gethostname() or psutil.pid_exists(int(pid))


def retry_dead_trials(study: optuna.Study) -> list[int]:
    """Mark this host's trials whose process died as failed and queue their parameters
    again (``retry_of``); return the trial numbers retried."""
    retried = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get("owner")
        if owner and not _alive(owner):
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            retried.append(t.number)
    return retried


def finished(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


class Sweep:
    """One process's work on a study: run trials until ``spec.trials`` have finished; with
    the experiment's logger on, the study is an MLflow run and each trial a nested one.

    Args:
        spec: a checked sweep file.
        out_dir: where trial runs go: ``<out_dir>/<study>/trial_<n>/seed_<s>``.
        overrides: extra Hydra overrides for every run (after the file's own).
        compose: ``overrides -> DictConfig`` (:func:`fedlightning.config.compose`).
        train: ``(cfg, run_dir, observe) -> summary``.
    """

    def __init__(self, spec: SweepSpec, out_dir: Path, overrides: list[str], compose, train):
        self.spec, self.out_dir, self.overrides = spec, Path(out_dir), list(overrides)
        self.compose, self.train = compose, train
        base = compose([f"experiment={spec.experiment}", *spec.overrides, *self.overrides])
        missing = [k for k in spec.space if OmegaConf.select(base, k, default=KeyError) is KeyError]
        if missing:
            raise _fail(
                spec.path, f"space.{missing[0]}", f"not a key of experiment {spec.experiment}"
            )
        self.parent: MlflowTracker | None = None  # the study's MLflow run
        if base.logger.get("enabled", False):
            self.parent = MlflowTracker(base.logger.tracking_uri, base.logger.experiment_name)

    # --------------------------------------------------------------------- study
    def run(self) -> optuna.Study:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=self.spec.study_name,
            storage=self.spec.storage,
            sampler=make_sampler(self.spec),
            pruner=make_pruner(self.spec),
            direction=self.spec.direction,
            load_if_exists=True,
        )
        for key, value in (("metric", self.spec.metric), ("experiment", self.spec.experiment)):
            if study.user_attrs.get(key, value) != value:
                raise _fail(
                    self.spec.path,
                    "study_name",
                    f"study {study.study_name!r} in {self.spec.storage} optimizes {key} "
                    f"{study.user_attrs[key]!r}, not {value!r}: choose another study_name",
                )
            study.set_user_attr(key, value)
        if self.parent:
            self.start_parent(study)
        retried = retry_dead_trials(study)
        if retried:
            log.info("sweep %s: trials %s died; running their parameters again", study, retried)
        while finished(study) < self.spec.trials:
            trial = study.ask()
            trial.set_user_attr("owner", f"{socket.gethostname()}:{os.getpid()}")
            state, value = self.run_trial(study, trial)
            study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
            self.progress(study, trial, state, value)
        if self.parent:
            self.finish_parent(study)
        return study

    def start_parent(self, study: optuna.Study) -> None:
        """The study's MLflow run: created once, found again through the study on resume."""
        spec = self.spec
        tags = {
            "task": "sweep",
            "experiment": spec.experiment,
            "study": study.study_name,
            "objective": spec.metric,
            "direction": spec.direction,
            "storage": spec.storage,
            "sweep_file": str(spec.path),
        }
        keys = ("trials", "seeds", "sampler", "pruner", "overrides")
        params = {k: json.dumps(getattr(spec, k)) for k in keys}
        params |= {f"space.{k}": json.dumps(v) for k, v in spec.space.items()}
        resumed = study.user_attrs.get(PARENT_ATTR)
        run_id = self.parent.start(f"sweep-{study.study_name}", tags, params, resumed)
        study.set_user_attr(PARENT_ATTR, run_id)

    def finish_parent(self, study: optuna.Study) -> None:
        """Best parameters, trial table and plots on the parent run; the parent ends."""
        out_dir = self.out_dir / study.study_name
        out_dir.mkdir(parents=True, exist_ok=True)
        files = [write_trials_csv(study, out_dir / "trials.csv")]
        if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            best = study.best_trial
            self.parent.client.log_metric(self.parent.run_id, "best_value", best.value)
            self.parent.set_tags(
                {"best_trial": str(best.number)}
                | {f"best.{k}": str(v) for k, v in best.params.items()}
            )
            path = out_dir / "best_params.json"
            path.write_text(json.dumps({"value": best.value, "params": best.params}, indent=2))
            files += [path, *sweep_plots(study, self.spec, out_dir)]
        self.parent.log_artifacts(files)
        self.parent.end()

    def progress(self, study: optuna.Study, trial: optuna.Trial, state, value) -> None:
        params = "  ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items()
        )
        best = ""
        if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            best = f"  (best {study.best_value:.4f}, trial {study.best_trial.number})"
        shown = f"{self.spec.metric} {value:.4f}" if state == TrialState.COMPLETE else state.name
        print(
            f"trial {trial.number}  [{finished(study)}/{self.spec.trials}]  {params}  "
            f"{shown}{best}",
            flush=True,
        )

    # --------------------------------------------------------------------- trial
    def run_trial(self, study, trial) -> tuple[TrialState, float | None]:
        params = {k: suggest(trial, k, p) for k, p in self.spec.space.items()}
        home = trial.user_attrs.get("retry_of", trial.number)  # a retry resumes its runs
        trial_dir = self.out_dir / study.study_name / f"trial_{home}"
        run = self.trial_run(trial, params) if self.parent else None
        values: list[float] = []

        def end(status: str, value: float | None) -> None:
            if run:  # the objective and each seed's value where finite
                seeds = [(i, {"objective_seed": v}) for i, v in enumerate(values)]
                run.log_metric_rows([(0, {"objective": value}), *seeds])
                run.set_tags({"run_dir": str(trial_dir.resolve())})
                run.end(status)

        try:
            for i, seed in enumerate(self.spec.seeds):
                observe = self.pruning_observer(trial) if i == 0 else None
                summary = self.run_seed(trial_dir / f"seed_{seed}", params, seed, run, observe)
                values.append(float(summary["metrics"].get(self.spec.metric, math.nan)))
        except RunStopped:
            end("KILLED", None)
            return TrialState.PRUNED, None
        except BaseException:
            end("FAILED", None)
            study.tell(trial, state=TrialState.FAIL)
            raise
        value = statistics.fmean(values)
        trial.set_user_attr("seed_values", values)
        trial.set_user_attr("run_dir", str(trial_dir))
        if math.isnan(value):
            end("FAILED", value)
            return TrialState.FAIL, None
        end("FINISHED", value)
        return TrialState.COMPLETE, value

    def trial_run(self, trial: optuna.Trial, params: dict[str, Any]) -> MlflowTracker:
        """A run nested in the study's, with the trial's sampled parameters."""
        tags = {
            "mlflow.parentRunId": self.parent.run_id,
            "task": "sweep_trial",
            "trial": str(trial.number),
        }
        if "retry_of" in trial.user_attrs:
            tags["retry_of"] = str(trial.user_attrs["retry_of"])
        run = MlflowTracker(self.parent.tracking_uri, self.parent.experiment_name)
        run.start(f"trial-{trial.number}", tags, params)
        return run

    def run_seed(self, run_dir: Path, params, seed: int, run, observe) -> dict[str, Any]:
        """One training run: read it if finished, resume it if checkpointed, else start."""
        if (run_dir / "summary.json").exists():
            return json.loads((run_dir / "summary.json").read_text())
        over = [f"experiment={self.spec.experiment}", *self.spec.overrides, *self.overrides]
        over += [_override(k, v) for k, v in params.items()] + [f"seed={seed}"]
        if run:
            over.append(f"logger.parent_run_id={run.run_id}")
        if (run_dir / "checkpoint.pt").exists():
            over.append(f"resume={run_dir}")
        return self.train(self.compose(over), run_dir, observe)

    def pruning_observer(self, trial: optuna.Trial):
        stage_key = STAGE_PROXY.get(self.spec.metric)

        def observe(kind: str, step: int, metrics: dict[str, float]) -> None:
            key = stage_key if kind == "stage" else self.spec.metric
            if key is None or (kind == "round" and stage_key) or key not in metrics:
                return
            value = float(metrics[key])
            if math.isnan(value):
                return
            trial.report(value, step)
            if trial.should_prune():
                raise RunStopped(f"trial {trial.number} pruned at {kind} {step}")

        return observe


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


def sweep_plots(study: optuna.Study, spec: SweepSpec, out_dir: Path) -> list[Path]:
    """Optimization history, parameter importances, and one sensitivity curve a parameter."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    maximize = spec.direction == "maximize"
    history = out_dir / "optimization_history.png"
    paths = [plot_optimization_history([t.value for t in done], history, maximize, spec.metric)]
    if len(done) >= 2:
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
        path = out_dir / f"sensitivity_{key.replace('/', '_')}.png"
        log_x = bool(p.get("log"))
        paths.append(plot_sensitivity(xs, seeds, path, key, spec.metric, log_x=log_x))
    return paths
