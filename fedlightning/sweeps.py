"""Optuna studies over Hydra configs: ``fedlightning sweep sweeps/<name>.yaml``.

Every trial runs the file's experiment once per seed with the sampled overrides, in process;
its value is the objective's mean over the seeds. The study lives in an Optuna storage, so
it resumes and can be shared by several processes; a dead process's trial is retried and no
parameter set runs twice (docs/experiments.md, "Sweeps")."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import psutil  # a dependency of torch-geometric
from omegaconf import OmegaConf
from optuna.trial import TrialState

from fedlightning.errors import ConfigError, RunStopped
from fedlightning.tracking import MlflowTracker
from fedlightning.tracking.mlflow_tracker import PARENT_TAG
from fedlightning.tracking.plots import (
    plot_importances,
    plot_optimization_history,
    plot_sensitivity,
)
from fedlightning.utils.seeding import derive_seed

log = logging.getLogger(__name__)

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("none", "median", "threshold")
PARAM_TYPES = ("float", "int", "categorical")
# Objectives measured only at a stage's end report this stage metric while the run goes.
STAGE_PROXY = {"val_am": "val_seen_acc", "val_fpr95": "val_fpr95"}
PARENT_ATTR = "mlflow_parent_run_id"
RUN_ATTR = "mlflow_run_id"  # a trial's MLflow run
FIELDS = ("experiment", "space", "objective", "trials", "seeds", "overrides", "sampler")
FIELDS += ("pruner", "storage", "study_name", "start_from_defaults")
PARAM_FIELDS = {"type", "low", "high", "log", "step", "choices"}
SAMPLER_FIELDS = {"tpe": {"name", "seed", "startup"}, "random": {"name", "seed"}}
SAMPLER_FIELDS["grid"] = {"name", "seed"}
# Consecutive sampled duplicates of finished or retried trials before a sweep gives up.
MAX_DUPLICATES = 50


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
    start_from_defaults: bool = False


def _fail(path: Path, key: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {key}", message)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_param(path: Path, key: str, p: Any) -> dict[str, Any]:
    where = f"space.{key}"
    if not isinstance(p, dict) or p.get("type") not in PARAM_TYPES:
        got = p.get("type") if isinstance(p, dict) else p
        raise _fail(path, f"{where}.type", f"one of {PARAM_TYPES}, got {got!r}")
    extra = sorted(set(p) - PARAM_FIELDS)
    if extra:
        raise _fail(
            path, f"{where}.{extra[0]}", f"unknown field; the fields are {sorted(PARAM_FIELDS)}"
        )
    if p["type"] == "categorical":
        if not isinstance(p.get("choices"), list) or not p["choices"]:
            raise _fail(path, f"{where}.choices", "a categorical parameter needs a non-empty list")
        return p
    for bound in ("low", "high"):
        if not _number(p.get(bound)):
            raise _fail(path, f"{where}.{bound}", f"must be a number, got {p.get(bound)!r}")
        if p["type"] == "int" and p[bound] != int(p[bound]):
            raise _fail(
                path, f"{where}.{bound}", f"an int parameter needs whole bounds, got {p[bound]}"
            )
    if p["low"] > p["high"]:
        raise _fail(path, where, f"low ({p['low']}) must not exceed high ({p['high']})")
    if not isinstance(p.get("log", False), bool):
        raise _fail(path, f"{where}.log", f"true or false, got {p['log']!r}")
    if p.get("log") and p["low"] <= 0:
        raise _fail(path, f"{where}.low", f"a log-scale range needs low > 0, got {p['low']}")
    if "step" in p and p["step"] is not None:
        if not _number(p["step"]) or p["step"] <= 0:
            raise _fail(path, f"{where}.step", f"a positive number, got {p['step']!r}")
        if p.get("log") and p["type"] == "float":
            raise _fail(path, f"{where}.step", "a float parameter takes `step` or `log`, not both")
    return p


def _points(space: dict[str, dict[str, Any]]) -> int | None:
    """How many distinct parameter sets the space holds (``None``: unbounded, a float)."""
    sizes = []
    for p in space.values():
        if p["type"] == "categorical":
            sizes.append(len(p["choices"]))
        elif p["type"] == "int":
            sizes.append((int(p["high"]) - int(p["low"])) // int(p.get("step") or 1) + 1)
        else:
            return None
    return math.prod(sizes)


def _read(path: Path) -> Any:
    """The file as plain containers; one line naming the file for a YAML or interpolation
    error."""
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # YAML syntax, a failing ${...}, bad encoding
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        mark = getattr(e, "context_mark", None) or getattr(e, "problem_mark", None)
        if mark is not None:  # YAML: where the construct that failed starts, and why
            what = (getattr(e, "context", None), getattr(e, "problem", None))
            reason = f"line {mark.line + 1}: " + "; ".join(w for w in what if w)
        raise ConfigError(str(path), f"not a readable sweep file ({reason})") from None


def load_spec(path: str | Path) -> SweepSpec:
    """Read and check a sweep file; every error names the file and the field. The objective
    must be a validation metric (``val_*``): a sweep never tunes on test data."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "sweep file not found")
    raw = _read(path)
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "a sweep file is a mapping")
    extra = sorted(set(raw) - set(FIELDS))
    if extra:
        raise _fail(path, extra[0], f"unknown field; the fields are {sorted(FIELDS)}")
    if not isinstance(raw.get("experiment"), str):
        raise _fail(path, "experiment", "name an experiment of conf/experiment/")
    objective = raw.get("objective")
    if not isinstance(objective, dict):
        got = "nothing (missing)" if objective is None else repr(objective)
        raise _fail(path, "objective", f"a mapping {{metric: val_..., direction: ...}}, got {got}")
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
    overrides = raw.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise _fail(path, "overrides", f"a list of Hydra overrides (key=value), got {overrides!r}")
    sampler = _component(path, "sampler", raw.get("sampler"), "tpe", SAMPLERS)
    extra = sorted(set(sampler) - SAMPLER_FIELDS[sampler["name"]])
    if extra:
        raise _fail(path, f"sampler.{extra[0]}", f"unknown for {sampler['name']}; "
                    f"it takes {sorted(SAMPLER_FIELDS[sampler['name']])}")  # fmt: skip
    for key in ("seed", "startup"):
        if key in sampler and (not isinstance(sampler[key], int) or sampler[key] < 0):
            raise _fail(path, f"sampler.{key}", f"a non-negative integer, got {sampler[key]!r}")
    pruner = _component(path, "pruner", raw.get("pruner"), "none", PRUNERS)
    if sampler["name"] == "grid" and any(p["type"] != "categorical" for p in space.values()):
        raise _fail(path, "space", "the grid sampler needs categorical parameters (choices)")
    size = _points(space)
    trials = raw.get("trials", size if sampler["name"] == "grid" else 10)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise _fail(path, "trials", f"a positive integer, got {trials!r}")
    if size is not None and trials > size:
        what = "grid" if sampler["name"] == "grid" else "search space"
        raise _fail(path, "trials", f"{trials} trials exceed the {what}'s {size} points")
    for key in ("storage", "study_name"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise _fail(path, key, f"a string, got {raw[key]!r}")
    start = raw.get("start_from_defaults", False)
    if not isinstance(start, bool):
        raise _fail(path, "start_from_defaults", f"true or false, got {start!r}")
    spec = SweepSpec(
        path=path,
        experiment=raw["experiment"],
        space=space,
        metric=metric,
        direction=direction,
        trials=trials,
        seeds=seeds,
        overrides=list(overrides),
        sampler=sampler,
        pruner=pruner,
        storage=str(raw.get("storage") or "sqlite:///optuna.db"),
        study_name=str(raw.get("study_name") or path.stem),
        start_from_defaults=start,
    )
    try:  # the pruner's options, as Optuna reads them
        make_pruner(spec)
    except (TypeError, ValueError) as e:
        raise _fail(path, "pruner", f"{e}".splitlines()[0]) from None
    return spec


def _component(path: Path, key: str, raw: Any, default: str, names: tuple) -> dict[str, Any]:
    """A ``{name: ..., options...}`` field (sampler, pruner), ``default`` when absent."""
    if raw is None:
        return {"name": default}
    if not isinstance(raw, dict):
        raise _fail(path, key, f"a mapping {{name: ...}} with name in {names}, got {raw!r}")
    if raw.get("name") not in names:
        raise _fail(path, f"{key}.name", f"one of {names}, got {raw.get('name')!r}")
    return dict(raw)


class AskTellGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler for our ask-and-tell loop, which counts the trials itself: the
    stock sampler calls ``study.stop()`` after the last grid point, which Optuna refuses
    outside ``study.optimize`` (a ``RuntimeError`` on the last ``tell``)."""

    def after_trial(self, study, trial, state, values) -> None:  # noqa: ANN001
        pass


def make_sampler(spec: SweepSpec, trial_number: int = 0) -> optuna.samplers.BaseSampler:
    """The file's sampler, seeded for the trial about to be asked: ``derive_seed(seed,
    trial_number)``. A sampler's random draws then depend on the trial's number, not on how
    many trials this process asked before: a resumed study does not draw again what the
    first process drew (a fresh sampler with the file's seed repeats its first trials)."""
    s = spec.sampler
    seed = derive_seed(s.get("seed", 0), trial_number) % 2**32
    if s["name"] == "grid":
        grid = {k: list(p["choices"]) for k, p in spec.space.items()}
        return AskTellGridSampler(grid, seed=seed)
    if s["name"] == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.get("startup", 5))


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


def retry_dead_trials(study: optuna.Study, client: Any = None) -> dict[int, int]:
    """Mark this host's trials whose process died as failed and queue their parameters
    again (``retry_of``); with an MLflow ``client``, close each one's trial run as KILLED,
    tagged ``retried_by`` (the retry's trial number). Return ``{dead: retry}`` numbers."""
    retried = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get("owner")
        if owner and not _alive(owner):
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            retry = max(w.number for w in waiting if w.user_attrs.get("retry_of") == t.number)
            retried[t.number] = retry
            run_id = t.user_attrs.get(RUN_ATTR)
            if client is not None and run_id:
                client.set_tag(run_id, "retried_by", str(retry))
                client.set_terminated(run_id, status="KILLED")
    return retried


def close_finished_run(client: Any, run_id: str) -> bool:
    """A seed run whose ``summary.json`` was written but whose process died before it closed
    its MLflow run (killed mid-trial, between the summary and the end) is ended FINISHED,
    tagged ``closed_by=sweep``: its results are on disk. Whether it was still open."""
    if client.get_run(run_id).info.status != "RUNNING":
        return False
    client.set_tag(run_id, "closed_by", "sweep")
    client.set_terminated(run_id, status="FINISHED")
    return True


def _params_of(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """A trial's parameters; a queued (WAITING) trial's are its fixed ones."""
    return dict(t.params or t.system_attrs.get("fixed_params", {}))


def duplicate_of(study: optuna.Study, trial: optuna.Trial) -> int | None:
    """The number of a finished, running or queued trial with ``trial``'s parameters."""
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
    for t in study.get_trials(deepcopy=False, states=states):
        if t.number != trial.number and _params_of(t) == trial.params:
            return t.number
    return None


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
        train: ``(cfg, run_dir, observe) -> summary``."""

    def __init__(self, spec: SweepSpec, out_dir: Path, overrides: list[str], compose, train):
        self.spec, self.out_dir, self.overrides = spec, Path(out_dir), list(overrides)
        self.compose, self.train = compose, train
        self.t0 = time.monotonic()
        try:
            base = compose([f"experiment={spec.experiment}", *spec.overrides, *self.overrides])
        except Exception as e:  # Hydra: an unknown experiment, group or key
            from hydra.errors import HydraException
            from omegaconf.errors import OmegaConfBaseException

            if not isinstance(e, (HydraException, OmegaConfBaseException)):
                raise
            reason = str(e).strip().splitlines()[0]
            raise _fail(spec.path, "experiment/overrides", reason) from None
        missing = [k for k in spec.space if OmegaConf.select(base, k, default=KeyError) is KeyError]
        if missing:
            raise _fail(
                spec.path, f"space.{missing[0]}", f"not a key of experiment {spec.experiment}"
            )
        self.defaults = experiment_setting(spec, base) if spec.start_from_defaults else None
        self.parent: MlflowTracker | None = None  # the study's MLflow run
        if base.logger.get("enabled", False):
            self.parent = MlflowTracker(base.logger.tracking_uri, base.logger.experiment_name)

    # --------------------------------------------------------------------- study
    def open_study(self) -> optuna.Study:
        """The study in the file's storage, created or loaded; one line naming the file's
        ``storage`` if Optuna cannot open it."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            return optuna.create_study(
                study_name=self.spec.study_name,
                storage=self.spec.storage,
                sampler=make_sampler(self.spec),
                pruner=make_pruner(self.spec),
                direction=self.spec.direction,
                load_if_exists=True,
            )
        except ValueError as e:  # e.g. a study of the same name with another direction
            raise _fail(self.spec.path, "study_name", str(e).splitlines()[0]) from None
        except Exception as e:  # an unknown URL scheme, a folder that does not exist, ...
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise _fail(self.spec.path, "storage", f"{self.spec.storage}: {reason}") from None

    def run(self) -> optuna.Study:
        study = self.open_study()
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
        try:
            self.run_trials(study)
        except BaseException:  # a failure (or Ctrl-C) ends the study's run: not RUNNING forever
            if self.parent:
                self.parent.end("FAILED")
            raise
        if self.parent:
            self.finish_parent(study)
        return study

    def run_trials(self, study: optuna.Study) -> None:
        """Trials until ``spec.trials`` have finished (a dead process's trials first)."""
        retried = retry_dead_trials(study, self.parent.client if self.parent else None)
        for dead, retry in retried.items():
            self.say(f"trial {dead} died with its process; trial {retry} runs its parameters")
        self.say(f"study {study.study_name}: {self.status(study)}")
        if self.defaults is not None and not study.get_trials(deepcopy=False):
            study.enqueue_trial(self.defaults)  # trial 0: the experiment's own setting
            self.say(f"trial 0 is the experiment's own setting: {_shown(self.defaults)}")
        duplicates = 0
        while finished(study) < self.spec.trials:
            study.sampler = make_sampler(self.spec, len(study.get_trials(deepcopy=False)))
            trial = study.ask()
            trial.set_user_attr("owner", f"{socket.gethostname()}:{os.getpid()}")
            params = {k: suggest(trial, k, p) for k, p in self.spec.space.items()}
            twin = duplicate_of(study, trial)
            if twin is not None:  # the same parameters give the same runs: draw again
                trial.set_user_attr("duplicate_of", twin)
                study.tell(trial, state=TrialState.FAIL)
                duplicates += 1
                if duplicates >= MAX_DUPLICATES:
                    raise _fail(
                        self.spec.path,
                        "space",
                        f"{MAX_DUPLICATES} draws in a row repeated finished or queued "
                        "trials: the search space looks exhausted; widen it or lower `trials`",
                    )
                continue
            duplicates = 0
            self.say(f"trial {trial.number} started  {_shown(trial.params)}  {self.status(study)}")
            state, value = self.run_trial(study, trial, params)
            study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
            self.progress(study, trial, state, value)

    def start_parent(self, study: optuna.Study) -> None:
        """The study's MLflow run: created once, found again through the study on resume;
        its parameters hold the file's fields and this command's overrides; the number of
        trials wanted, which a resume may change (``--trials``), is the tag ``trials``."""
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
        keys = ("seeds", "sampler", "pruner", "overrides")
        params = {k: json.dumps(getattr(spec, k)) for k in keys}
        params |= {f"space.{k}": json.dumps(v) for k, v in spec.space.items()}
        params["cli_overrides"] = json.dumps(self.overrides)
        resumed = study.user_attrs.get(PARENT_ATTR)
        tags["trials"] = str(spec.trials)  # a tag, not a parameter: a resume updates it
        run_id = self.parent.start(f"sweep-{study.study_name}", tags, params, resumed)
        if resumed:  # a resuming command's own overrides (the parameters keep the first's)
            self.parent.set_tags({"cli_overrides.resumed": json.dumps(self.overrides)})
        study.set_user_attr(PARENT_ATTR, run_id)

    def finish_parent(self, study: optuna.Study) -> None:
        """Best parameters (and a link to the best trial's run), trial table and plots on
        the parent run; the parent ends."""
        out_dir = self.out_dir / study.study_name
        out_dir.mkdir(parents=True, exist_ok=True)
        files = [write_trials_csv(study, out_dir / "trials.csv")]
        if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            best = study.best_trial
            self.parent.client.log_metric(self.parent.run_id, "best_value", best.value)
            tags = {"best_trial": str(best.number)}
            tags |= {f"best.{k}": str(v) for k, v in best.params.items()}
            run_id = best.user_attrs.get(RUN_ATTR)
            if run_id:
                exp = self.parent.client.get_run(run_id).info.experiment_id
                tags["best_trial_run_id"] = run_id
                tags["mlflow.note.content"] = (
                    f"Best trial: [trial {best.number}](#/experiments/{exp}/runs/{run_id}), "
                    f"{self.spec.metric} = {best.value:.4f}, parameters {best.params}"
                )
            self.parent.set_tags(tags)
            path = out_dir / "best_params.json"
            path.write_text(json.dumps({"value": best.value, "params": best.params}, indent=2))
            files += [path, *sweep_plots(study, self.spec, out_dir)]
        self.parent.log_artifacts(files)
        self.parent.end()

    # ------------------------------------------------------------------ progress
    def say(self, text: str) -> None:
        """One progress line, with the time since this process started."""
        elapsed = int(time.monotonic() - self.t0)
        clock = f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"
        print(f"[{clock}] {text}", flush=True)

    def status(self, study: optuna.Study) -> str:
        """``done/total trials done`` and the best value so far."""
        text = f"[{finished(study)}/{self.spec.trials} trials done"
        if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            text += f", best {self.spec.metric} {study.best_value:.4f} (trial "
            text += f"{study.best_trial.number})"
        return text + "]"

    def progress(self, study: optuna.Study, trial: optuna.Trial, state, value) -> None:
        shown = f"{self.spec.metric} {value:.4f}" if state == TrialState.COMPLETE else state.name
        self.say(f"trial {trial.number} {shown}  {_shown(trial.params)}  {self.status(study)}")

    # --------------------------------------------------------------------- trial
    def run_trial(self, study, trial, params: dict[str, Any]) -> tuple[TrialState, float | None]:
        home = trial.user_attrs.get("retry_of", trial.number)  # a retry resumes its runs
        trial_dir = self.out_dir / study.study_name / f"trial_{home}"
        run = self.trial_run(study, trial, params) if self.parent else None
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
                self.say(f"trial {trial.number} seed {seed}: {self.spec.metric} {values[-1]:.4f}")
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

    def trial_run(self, study, trial: optuna.Trial, params: dict[str, Any]) -> MlflowTracker:
        """A run nested in the study's, with the trial's sampled parameters; a retry's run
        names the run it replaces (``retry_of_run_id``), which gets ``retry_run_id``."""
        tags = {PARENT_TAG: self.parent.run_id, "task": "sweep_trial", "trial": str(trial.number)}
        dead_run = None
        if "retry_of" in trial.user_attrs:
            dead = study.trials[trial.user_attrs["retry_of"]]
            tags["retry_of"] = str(dead.number)
            dead_run = dead.user_attrs.get(RUN_ATTR)
            if dead_run:
                tags["retry_of_run_id"] = dead_run
        run = MlflowTracker(self.parent.tracking_uri, self.parent.experiment_name)
        run.start(f"trial-{trial.number}", tags, params)
        trial.set_user_attr(RUN_ATTR, run.run_id)
        if dead_run:
            run.client.set_tag(dead_run, "retry_run_id", run.run_id)
        return run

    def run_seed(self, run_dir: Path, params, seed: int, run, observe) -> dict[str, Any]:
        """One training run: read it if finished, resume it if checkpointed, else start. A
        run of a trial that died is moved under this trial's run (``run``): its finished
        and resumed runs nest there, one that died before its first checkpoint is KILLED."""
        from fedlightning.runs import MLFLOW_RUN_FILE  # (the run wrapper imports Hydra)

        saved = run_dir / MLFLOW_RUN_FILE
        old_id = json.loads(saved.read_text()).get("run_id") if saved.is_file() else None
        if (run_dir / "summary.json").exists():
            if run and old_id:
                run.client.set_tag(old_id, PARENT_TAG, run.run_id)
                close_finished_run(run.client, old_id)
            return json.loads((run_dir / "summary.json").read_text())
        over = [f"experiment={self.spec.experiment}", *self.spec.overrides, *self.overrides]
        over += [_override(k, v) for k, v in params.items()] + [f"seed={seed}"]
        if run:
            over.append(f"logger.parent_run_id={run.run_id}")
        if (run_dir / "checkpoint.pt").exists():
            over.append(f"resume={run_dir}")
        elif run and old_id:
            run.client.set_terminated(old_id, status="KILLED")
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


def experiment_setting(spec: SweepSpec, base: Any) -> dict[str, Any]:
    """The composed experiment's value of every searched key (``start_from_defaults``: the
    study's first trial), each checked against its search range: one line naming the file,
    the key and the range when a value lies outside it."""
    values = {}
    for key, p in spec.space.items():
        v = OmegaConf.select(base, key)
        if p["type"] == "categorical":
            ok = v in p["choices"]
        elif p["type"] == "int":
            ok = isinstance(v, int) and not isinstance(v, bool) and p["low"] <= v <= p["high"]
        else:
            ok = (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and p["low"] <= v <= p["high"]
            )
        if not ok:
            where = p.get("choices", [p.get("low"), p.get("high")])
            raise _fail(
                spec.path,
                f"space.{key}",
                f"start_from_defaults: the experiment's value {v!r} lies outside {where}",
            )
        values[key] = float(v) if p["type"] == "float" else v
    return values


def _shown(params: dict[str, Any]) -> str:
    return "  ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )


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
