"""One program per kind of run, from a composed config to ``summary.json``: graph federations
(``task=fl``, ``cil``, ``cir``: :mod:`.graph_program`), FedTIP's task protocol (``task=temporal``:
:mod:`.temporal_program`), the bank's pre-training (``task=bank``: :mod:`.bank_program`) and the
protocol manifest (:mod:`.manifest_program`). A training program is a :class:`Program`: it
supplies only what differs, and :func:`fedlightning.train.run` assembles the run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from fedlightning.config import build
from fedlightning.errors import ConfigError
from fedlightning.runs import Observer, Run, prepare_run_dir
from fedlightning.server.secure_sum import enabled


def metric_text(value: float | None, spec: str = ".4f") -> str:
    """``value`` formatted, or ``-`` for a metric that could not be computed (``None`` or
    NaN; the run's log says why, e.g. an untrained FedTIP has no class prototype)."""
    if value is None or not math.isfinite(value):
        return "-"
    return format(value, spec)


def secure_on(cfg: DictConfig, flower: bool) -> bool:
    """Whether ``federation.secure_sum`` is on (docs/security.md); refused in one line on
    Flower's nodes (``flower``), which do not mask."""
    on = enabled(cfg.federation.get("secure_sum", False))
    if on and flower:
        raise ConfigError(
            "federation.secure_sum",
            "runner=flower does not mask on its nodes: use runner=sequential or runner=distributed",
        )
    return on


class Program:
    """What one kind of run supplies to :func:`fedlightning.train.run`, the one function that
    assembles a run: the runner and its world, the run directory (on rank 0), the
    :class:`~fedlightning.runs.Run` (MLflow, summary, artifacts) and the order of the steps.
    One is made per run; ``run`` calls, in order: :meth:`check` (before the run directory
    exists), :meth:`make_runner`, :meth:`setup` on rank 0 (its result reaches every rank),
    :meth:`prepare` (the run's inputs, its schedule, a resume before the MLflow run; returns
    the MLflow tags), :meth:`work` inside the MLflow run (a failure there ends it ``FAILED``),
    then :meth:`fields` (``summary.json``) and :meth:`outputs` (the files, table and JSON
    files :meth:`~fedlightning.runs.Run.finish` writes)."""

    def __init__(self, cfg: DictConfig, observe: Observer | None = None) -> None:
        self.cfg, self.observe = cfg, observe
        self.run_dir, self.resuming, self.made = Path(), False, ()
        self.runner: Any = None
        self.run: Run | None = None

    def check(self) -> None:
        """Refuse what the config alone decides, before a run directory is made."""

    def make_runner(self, given: Any) -> Any:
        """The runner (``given`` by a Flower ServerApp, else ``cfg.runner``'s); ``None``: the
        run is one process, with no rounds."""
        return given if given is not None else build(self.cfg.runner, "runner")

    def setup(self, cfg: DictConfig, run_dir: Path) -> tuple[Any, ...]:
        """On rank 0: ``(cfg, run_dir, resuming, *made)``, the run directory made or resumed
        (:func:`~fedlightning.runs.prepare_run_dir`) and whatever else the program makes
        there (``made``)."""
        return prepare_run_dir(cfg, run_dir)

    def prepare(self) -> dict[str, str]:
        """The run's inputs and schedule, before its MLflow run; its MLflow tags."""
        raise NotImplementedError

    def work(self) -> None:
        """The run's training, inside its MLflow run."""
        raise NotImplementedError

    def fields(self) -> dict[str, Any]:
        """The fields of ``summary.json`` beside the experiment, seed, tags and timings."""
        raise NotImplementedError

    def outputs(self) -> dict[str, Any]:
        """:meth:`~fedlightning.runs.Run.finish`'s ``step``, ``files``, ``table`` and
        ``extra``."""
        raise NotImplementedError
