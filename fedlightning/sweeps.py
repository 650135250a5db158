"""Optuna studies over Hydra configs: ``fedlightning sweep sweeps/<name>.yaml``.

Every trial runs the file's experiment once per seed with the sampled overrides, in process;
its value is the objective's mean over the seeds. The study lives in an Optuna storage, so
it resumes and can be shared by several processes: a trial whose process died is marked
failed and its parameters run again, resuming its checkpointed runs (docs/experiments.md).
"""

from __future__ import annotations

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
from omegaconf import OmegaConf
from optuna.trial import TrialState

from fedlightning.errors import ConfigError, RunStopped

log = logging.getLogger(__name__)

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("none", "median", "threshold")
PARAM_TYPES = ("float", "int", "categorical")
# Objectives measured only at a stage's end report this stage metric while the run goes.
STAGE_PROXY = {"val_am": "val_seen_acc", "val_fpr95": "val_fpr95"}


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

    def grid(self) -> dict[str, list[Any]]:
        return {k: list(p["choices"]) for k, p in self.space.items()}


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
        return AskTellGridSampler(spec.grid(), seed=s.get("seed", 0))
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
    host, _, pid = owner.partition(":")
    if host != socket.gethostname():
        return True  # another machine's trial: only its own process can tell
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


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
    """One process's work on a study: run trials until ``spec.trials`` have finished.

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
        self.tracker = None
        if base.logger.get("enabled", False):
            from fedlightning.sweep_tracking import SweepTracker

            self.tracker = SweepTracker(base.logger.tracking_uri, base.logger.experiment_name)

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
        parent = self.tracker.parent(study, self.spec) if self.tracker else None
        retried = retry_dead_trials(study)
        if retried:
            log.info("sweep %s: trials %s died; running their parameters again", study, retried)
        while finished(study) < self.spec.trials:
            trial = study.ask()
            trial.set_user_attr("owner", f"{socket.gethostname()}:{os.getpid()}")
            state, value = self.run_trial(study, trial, parent)
            study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
            self.progress(study, trial, state, value)
        if self.tracker:
            self.tracker.finish(study, self.spec, parent, self.out_dir / study.study_name)
        return study

    def progress(self, study: optuna.Study, trial: optuna.Trial, state, value) -> None:
        params = "  ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items()
        )
        best = ""
        if any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
            best = f"  (best {study.best_value:.4f}, trial {study.best_trial.number})"
        shown = f"{self.spec.metric} {value:.4f}" if state == TrialState.COMPLETE else state.name
        print(
            f"trial {trial.number}  [{finished(study)}/{self.spec.trials}]  {params}  "
            f"{shown}{best}",
            flush=True,
        )

    # --------------------------------------------------------------------- trial
    def run_trial(self, study, trial, parent) -> tuple[TrialState, float | None]:
        params = {k: suggest(trial, k, p) for k, p in self.spec.space.items()}
        home = trial.user_attrs.get("retry_of", trial.number)  # a retry resumes its runs
        trial_dir = self.out_dir / study.study_name / f"trial_{home}"
        run = self.tracker.trial(parent, trial, params) if self.tracker else None
        values: list[float] = []

        def end(status: str, value: float | None) -> None:
            if run:
                self.tracker.end_trial(run, status, value, values, trial_dir)

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

    def run_seed(self, run_dir: Path, params, seed: int, run, observe) -> dict[str, Any]:
        """One training run: read it if finished, resume it if checkpointed, else start."""
        if (run_dir / "summary.json").exists():
            return json.loads((run_dir / "summary.json").read_text())
        over = [f"experiment={self.spec.experiment}", *self.spec.overrides, *self.overrides]
        over += [_override(k, v) for k, v in params.items()] + [f"seed={seed}"]
        if run:
            over.append(f"logger.parent_run_id={run}")
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
