"""``fedlightning train``'s entry point: the run's ``task`` picks the program
(:mod:`fedlightning.programs`): ``fl``/``cil``/``cir``, ``temporal`` or ``bank``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from fedlightning.errors import ConfigError

if TYPE_CHECKING:
    from fedlightning.runs import Observer

GRAPH_TASKS = ("fl", "cil", "cir")


def train(
    cfg: DictConfig,
    run_dir: str | Path,
    observe: Observer | None = None,
    verbose: bool = True,
    runner: Any = None,
) -> dict[str, Any]:
    """Run the experiment ``cfg`` in ``run_dir``; return the summary (also written to disk).

    ``observe(kind, step, metrics)`` sees every round's, stage's or task's metrics after
    they are checkpointed and logged; raising :class:`~fedlightning.errors.RunStopped` there
    ends the run as ``KILLED`` (a pruned sweep trial). ``verbose=False`` leaves out the
    summary table on stdout. ``runner``, when given, replaces the one ``cfg.runner`` builds
    (a Flower ServerApp passes its own).
    """
    from fedlightning.config import check_trainer

    check_trainer(cfg)  # the Trainer settings against the runner, an absent GPU: at once
    if not cfg.get("resume") and str(cfg.get("task")) in GRAPH_TASKS:
        from fedlightning.config import validate

        validate(cfg)  # a config error costs no import of torch: it is told at once
    from fedlightning.runs import holding_run_dirs

    with holding_run_dirs():  # the run's directory is its own until it returns
        return _train(cfg, run_dir, observe, verbose, runner)


def _train(
    cfg: DictConfig, run_dir: str | Path, observe: Observer | None, verbose: bool, runner: Any
) -> dict[str, Any]:
    from fedlightning.runs import apply_threads, trained_config

    task = str(trained_config(cfg).get("task"))  # resume=DIR: the saved run's task
    threads = apply_threads(cfg.get("threads", "auto"))  # before any work: every runner's
    logging.getLogger("fedlightning").info("threads: %d (threads=%s)", threads, cfg.get("threads"))
    target = str(OmegaConf.select(cfg, "runner._target_", default=""))
    if target.endswith(".DistributedRunner") and task == "bank":
        raise ConfigError(
            "runner",
            "runner=distributed does not support task=bank: the bank is pre-trained "
            "centrally, in one process; use runner=sequential",
        )
    if task == "bank":  # FedTIP's temporal bank: no federation
        from fedlightning.programs.bank_program import train_bank

        return train_bank(cfg, Path(run_dir), verbose=verbose)
    if task == "temporal":  # FedTIP and its comparators over the task manifest
        from fedlightning.programs.temporal_program import train_temporal

        return train_temporal(cfg, Path(run_dir), observe=observe, verbose=verbose, runner=runner)
    from fedlightning.programs.graph_program import train_graph

    return train_graph(cfg, run_dir, observe=observe, verbose=verbose, runner=runner)
