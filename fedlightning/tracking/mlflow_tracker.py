"""MLflow runs: params, tags, per-round metrics, artifacts; resumable by run id.

The layout (docs/experiments.md, "MLflow layout"): a run goes to the MLflow experiment
``<logger.experiment_name>/<task>`` of its ``task`` tag (``fedlightning/cil``,
``fedlightning/sweep``, ...), a nested run to its parent's. A local store (SQLite file or
file store) is opened under a file lock, so that processes starting at once on a fresh store
create it once (MLflow's schema migrations are not safe to run concurrently).
"""

from __future__ import annotations

import logging
import math
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


def open_experiment(tracking_uri: str, name: str, create: bool = True) -> tuple[Any, str | None]:
    """An ``MlflowClient`` at ``tracking_uri`` and the id of its experiment ``name``:
    created when missing (``create``), else ``None``. The store is created (on first use)
    under :func:`store_lock`; a remote store is retried a few times, and an experiment
    another process created in the meantime is found."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    for attempt in range(OPEN_ATTEMPTS):
        try:
            with store_lock(tracking_uri):
                client = MlflowClient(tracking_uri)
                exp = client.get_experiment_by_name(name)
                if exp is not None or not create:
                    return client, exp.experiment_id if exp else None
                return client, client.create_experiment(name)
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
        run = self.client.create_run(exp_id, run_name=run_name, tags=tags)
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
            Metric(k, float(v), now, step)
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
