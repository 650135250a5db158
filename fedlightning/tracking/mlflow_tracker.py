"""MLflow runs: params, tags, per-round metrics, artifacts; resumable by run id."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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


def mlflow_experiment(tracking_uri: str, name: str, create: bool = True) -> tuple[Any, str | None]:
    """An ``MlflowClient`` at ``tracking_uri`` and the id of its experiment ``name``: created
    when missing (``create``), else ``None``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp else client.create_experiment(name) if create else None
    return client, exp_id


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
    """Logs one federated run to MLflow, at any MLflow URI (default: the local store that
    ``mlflow ui`` reads)."""

    def __init__(
        self, tracking_uri: str = "sqlite:///mlflow.db", experiment_name: str = "fedlightning"
    ) -> None:
        import mlflow  # slow import: only when tracking is on

        self.mlflow = mlflow
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.client: Any = None
        self.run_id = None

    def start(
        self, run_name: str, tags: dict[str, str], params: dict[str, Any], run_id: str | None = None
    ) -> str:
        from mlflow.tracking import MlflowClient

        self.mlflow.set_tracking_uri(self.tracking_uri)
        if run_id is not None:  # resume: the same run continues
            self.client, self.run_id = MlflowClient(self.tracking_uri), run_id
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        self.client, exp_id = mlflow_experiment(self.tracking_uri, self.experiment_name)
        run = self.client.create_run(exp_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        log.info(
            "mlflow: run %s in experiment %r at %s",
            self.run_id,
            self.experiment_name,
            self.tracking_uri,
        )
        return self.run_id

    def log_metric_rows(self, rows: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        import time

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
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, v)

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        for p in paths:
            if Path(p).exists():
                self.client.log_artifact(self.run_id, str(p))

    def end(self, status: str = "FINISHED") -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)
