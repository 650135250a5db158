"""MLflow runs: params, tags, per-round metrics, artifacts; resumable by run id.

The layout (docs/experiments.md, "MLflow layout"): a run goes to the MLflow experiment
``<logger.experiment_name>/<task>`` of its ``task`` tag (``fedlightning/cil``,
``fedlightning/sweep``, ...), a nested run to its parent's. A local store (SQLite file or
file store) is opened under a file lock, so that processes starting at once on a fresh store
create it once (MLflow's schema migrations are not safe to run concurrently)."""

from __future__ import annotations

import logging
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from fedlightning.errors import FedLightningError

log = logging.getLogger(__name__)

PARENT_TAG = "mlflow.parentRunId"
# Hang guard only: creating a fresh SQLite store (its schema migrations) takes seconds.
LOCK_TIMEOUT_S = 600.0
# Remote stores (no file to lock): how often to retry opening the store and its experiment.
OPEN_ATTEMPTS = 5
# MLflow 3's UI shows an experiment without this tag as a GenAI one (traces, evaluation
# runs); this value opens it on its training runs (mlflow/server/js: `experimentKind`).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
DESCRIPTION_TAG = "mlflow.note.content"  # the experiment's description in the UI
FAMILY_DESCRIPTIONS = {
    "fl": "Plain federated runs (FedAvg, FedProx, ...): per-round accuracy and communication.",
    "cil": "FedOGL's class-incremental open-world protocol: per-round accuracy, per-stage "
    "open-set metrics, final AM, FM, FPR95.",
    "cir": "FedOGL's cross-modal retrieval under class-incremental stages: Recall@k.",
    "temporal": "FedTIP and its comparators over the few-shot task manifest: per-task AUCs "
    "and uplink.",
    "bank": "Pre-training of FedTIP's frozen temporal bank (TGN/TGAT): per-epoch loss and AUC.",
    "sweep": "Optuna studies: a parent run per study, its trials and their training runs "
    "nested under it.",
    "report": "Tables and plots of `fedlightning report --log`.",
}
# The MLflow UI charts a run's metrics by section, the name before the last '/', sections in
# sorted order before the unprefixed ones: per-step curves under `curves/` come before the
# `final/` and `stage/` values (docs/experiments.md, "MLflow layout").
CURVES = "curves/"
RUN_NAME_WIDTH = 24  # what the runs table shows of a name before it cuts it


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}`` (nested mappings only)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def local_store(tracking_uri: str) -> Path | None:
    """The file or folder of a local store: ``sqlite:///PATH`` (relative) or
    ``sqlite:////PATH`` (absolute), ``file:///PATH`` or a plain path; ``None`` for a
    remote store (``http(s)://``, ``postgresql://``, ...) or an in-memory SQLite one."""
    uri = str(tracking_uri)
    if uri.startswith("sqlite:"):
        path = uri.removeprefix("sqlite:").split("?", 1)[0]
        path = path[3:] if path.startswith("///") else ""  # sqlite:// or sqlite:///:memory:
        return Path(unquote(path)) if path and path != ":memory:" else None
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:  # not a Windows drive letter
        return None
    return Path(uri)


@contextmanager
def store_lock(tracking_uri: str) -> Iterator[None]:
    """Hold ``<store>.lock`` (next to the SQLite file or the file store's folder) while
    the store is opened: the first process creates it, the others wait and then find it.
    Remote stores are not locked (see :func:`open_experiment`'s retries)."""
    path = local_store(tracking_uri)
    if path is None or not path.absolute().parent.is_dir():
        yield
        return
    from filelock import FileLock, Timeout  # a dependency of torch

    lock = FileLock(f"{path.absolute()}.lock")
    try:
        lock.acquire(timeout=LOCK_TIMEOUT_S)
    except Timeout:
        raise FedLightningError(
            f"MLflow store {tracking_uri}: {lock.lock_file} held by another process for "
            f"{LOCK_TIMEOUT_S:.0f} s; if no run is starting, delete it"
        ) from None
    except OSError as e:  # a read-only folder: an existing store is read without the lock
        log.debug("mlflow: no lock next to %s (%s)", path, e)
        yield
        return
    try:
        yield
    finally:
        lock.release()


def artifact_location(tracking_uri: str, name: str) -> str | None:
    """Where a new experiment ``name`` of a local SQLite store keeps its runs' artifacts:
    ``mlartifacts/<name>`` beside the database (MLflow's default, ``./mlruns`` of whatever
    folder the run started in, scatters them); ``None``: MLflow's default."""
    path = local_store(tracking_uri)
    if path is None or not str(tracking_uri).startswith("sqlite:"):
        return None
    return (path.absolute().parent / "mlartifacts" / name).as_uri()


def experiment_tags(name: str) -> dict[str, str]:
    """The tags of the experiment ``name``: model training, and the description of its
    family (the part after the last '/')."""
    family = name.rsplit("/", 1)[-1]
    described = FAMILY_DESCRIPTIONS.get(family)
    return {**EXPERIMENT_KIND, **({DESCRIPTION_TAG: described} if described else {})}


def open_experiment(tracking_uri: str, name: str, create: bool = True) -> tuple[Any, str | None]:
    """An ``MlflowClient`` at ``tracking_uri`` and the id of its experiment ``name``:
    created when missing (``create``, tagged by :func:`experiment_tags`, its artifacts at
    :func:`artifact_location`), else ``None``. The store is created (on first use) under
    :func:`store_lock`; a remote store is retried a few times, and an experiment another
    process created in the meantime is found. An experiment an older version created gets
    its tags."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    for attempt in range(OPEN_ATTEMPTS):
        try:
            with store_lock(tracking_uri):
                client = MlflowClient(tracking_uri)
                exp = client.get_experiment_by_name(name)
                if exp is not None and EXPERIMENT_KIND.keys() - exp.tags.keys():
                    for k, v in experiment_tags(name).items():
                        client.set_experiment_tag(exp.experiment_id, k, v)
                if exp is not None or not create:
                    return client, exp.experiment_id if exp else None
                where = artifact_location(tracking_uri, name)
                return client, client.create_experiment(
                    name, artifact_location=where, tags=experiment_tags(name)
                )
        except MlflowException as e:
            exists = getattr(e, "error_code", "") == "RESOURCE_ALREADY_EXISTS"
            if attempt == OPEN_ATTEMPTS - 1 or not (exists or local_store(tracking_uri) is None):
                raise
            time.sleep(0.2 * 2**attempt)  # another process created it, or a remote hiccup
    raise AssertionError("unreachable")


def family_experiment(prefix: str, tags: Mapping[str, str]) -> str:
    """The MLflow experiment of a run with ``tags``: ``<prefix>/<task>`` (one per task
    family: fl, cil, cir, temporal, bank, protocol, sweep, report), ``prefix`` without a
    task tag."""
    task = tags.get("task")
    return f"{prefix}/{task}" if task else prefix


def run_name(method: str, data: str, seed: Any, width: int = RUN_NAME_WIDTH) -> str:
    """``<method>-<data>-s<seed>`` within ``width`` characters (the runs table's): the data's
    name is cut to fit first, then the method's; the tags keep both whole."""
    tail = f"-s{seed}"
    room = max(width - len(tail), 3)
    if len(method) + 1 + len(data) > room:
        data = data[: max(room - len(method) - 1, 4)]
    return f"{method}-{data}"[:room] + tail


def source_tags() -> dict[str, str]:
    """Where a run came from: the command line (``command``, also MLflow's source name),
    the package's version and, in a git checkout, its commit (MLflow's own git tag)."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if program.startswith("__main__.py"):  # python -m fedlightning (the CLI adds " train")
        program = program.replace("__main__.py", "python -m fedlightning", 1)
    command = " ".join([program, shlex.join(sys.argv[1:])]).strip()[:5000]
    tags = {
        "command": command,
        "mlflow.source.name": command,
        "fedlightning_version": package_version(),
    }
    commit = git_commit(Path(__file__).resolve().parent)
    if commit:
        tags["mlflow.source.git.commit"], dirty = commit
        tags["git_dirty"] = str(dirty).lower()
    return tags


def package_version() -> str:
    """The installed distribution's version (the package's own in a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedlightning")
    except PackageNotFoundError:
        from fedlightning import __version__

        return __version__


def git_commit(folder: Path) -> tuple[str, bool] | None:
    """The commit of the git checkout that ``folder``'s code is tracked in, and whether its
    tracked files have changes; ``None`` for an installed wheel (its files belong to no
    checkout, even in a virtual environment inside one) or without git."""

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", "-C", str(folder), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip()

    try:
        git("ls-files", "--error-unmatch", Path(__file__).name)  # this file is the checkout's
        commit = git("rev-parse", "HEAD")
        return commit, bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None


class NullTracker:
    """Tracks nothing (``logger=none``)."""

    run_id: str | None = None

    def start(
        self, run_name: str, tags: dict[str, str], params: dict[str, Any], run_id: str | None = None
    ) -> str | None:
        return None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.log_metric_rows([(step, metrics)])

    def log_metric_rows(self, rows: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        """Several steps' metrics at once (one request per 500 values)."""

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def end(self, status: str = "FINISHED") -> None:
        pass


class MlflowTracker(NullTracker):
    """Logs one run to MLflow, at any MLflow URI (default: the local store that ``mlflow ui``
    reads), in the experiment of its family (:func:`family_experiment` under
    ``experiment_name``) or, nested (a ``mlflow.parentRunId`` tag), in its parent's."""

    def __init__(
        self, tracking_uri: str = "sqlite:///mlflow.db", experiment_name: str = "fedlightning"
    ) -> None:
        import mlflow  # slow import: only when tracking is on

        self.mlflow = mlflow
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name  # the prefix of the family experiments
        self.client: Any = None
        self.run_id = None

    def start(
        self, run_name: str, tags: dict[str, str], params: dict[str, Any], run_id: str | None = None
    ) -> str:
        """Create the run (or, with ``run_id``, continue it: its status RUNNING again and
        ``tags`` set again, so a resumed run follows a new parent)."""
        self.mlflow.set_tracking_uri(self.tracking_uri)
        if run_id is not None:  # resume: the same run continues
            with store_lock(self.tracking_uri):
                from mlflow.tracking import MlflowClient

                self.client, self.run_id = MlflowClient(self.tracking_uri), run_id
            self.client.update_run(run_id, status="RUNNING")
            self.set_tags(tags)
            return run_id
        parent = tags.get(PARENT_TAG)
        if parent:  # MLflow shows a nested run only in its parent's experiment
            self.client, _ = open_experiment(self.tracking_uri, self.experiment_name, False)
            exp_id = self.client.get_run(parent).info.experiment_id
        else:
            name = family_experiment(self.experiment_name, tags)
            self.client, exp_id = open_experiment(self.tracking_uri, name)
        run = self.client.create_run(exp_id, run_name=run_name, tags={**source_tags(), **tags})
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        log.info("mlflow: run %s (experiment id %s) at %s", self.run_id, exp_id, self.tracking_uri)
        return self.run_id

    def log_metric_rows(self, rows: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(k if "/" in k else CURVES + k, float(v), now, step)
            for step, metrics in rows
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))
        ]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i : i + 500])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, tags=items[i : i + 100])

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        for p in paths:
            if Path(p).exists():
                self.client.log_artifact(self.run_id, str(p))

    def end(self, status: str = "FINISHED") -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)
