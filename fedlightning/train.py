"""``fedlightning train``'s entry point: the config's ``program._target_`` names the program
(:mod:`fedlightning.programs`; ``conf/program/``: ``graph``, ``temporal``, ``bank``) and
:func:`run` runs it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from fedlightning.errors import ConfigError

if TYPE_CHECKING:
    from fedlightning.programs import Program
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
    (a Flower ServerApp passes its own)."""
    from fedlightning.config import check_trainer

    check_trainer(cfg)  # the Trainer settings against the runner, an absent GPU: at once
    if not cfg.get("resume") and str(cfg.get("task")) in GRAPH_TASKS:
        from fedlightning.config import validate

        validate(cfg)  # a config error costs no import of torch: it is told at once
    from fedlightning.runs import holding_run_dirs

    with holding_run_dirs():  # the run's directory is its own until it returns
        return _train(cfg, run_dir, observe, verbose, runner)


#: the program of a run saved before programs were named by ``_target_``, by its ``task``
PROGRAM_OF_TASK = {
    "temporal": "fedlightning.programs.temporal_program.train_temporal",
    "bank": "fedlightning.programs.bank_program.train_bank",
}
GRAPH_PROGRAM = "fedlightning.programs.graph_program.train_graph"


def program_of(cfg: DictConfig) -> Callable[..., Program]:
    """The program ``cfg`` names (``program._target_``; a run saved before that key existed:
    by its ``task``): a :class:`~fedlightning.programs.Program` class."""
    from hydra.utils import get_method

    target = OmegaConf.select(cfg, "program._target_", default=None)
    if target is None:
        target = PROGRAM_OF_TASK.get(str(cfg.get("task")), GRAPH_PROGRAM)
    try:
        return get_method(str(target))
    except Exception as e:  # a mistyped path: one line naming the key
        raise ConfigError("program._target_", f"cannot import {target!r} ({e})") from None


def run(
    program: Callable[..., Program],
    cfg: DictConfig,
    run_dir: str | Path,
    observe: Observer | None = None,
    verbose: bool = True,
    runner: Any = None,
) -> dict[str, Any]:
    """Run ``program`` (a :class:`~fedlightning.programs.Program`) on ``cfg`` in ``run_dir``,
    the torch threads set first, then the program's steps in its order (only rank 0 writes)."""
    from fedlightning.federation.world import World
    from fedlightning.runs import Run, apply_threads

    threads = apply_threads(cfg.get("threads", "auto"))  # before any work: every runner's
    logging.getLogger("fedlightning").info("threads: %d (threads=%s)", threads, cfg.get("threads"))
    t0 = time.perf_counter()
    job = program(cfg, observe)
    job.check()
    job.runner = job.make_runner(runner)  # first: a distributed runner joins its ranks here
    world = World() if job.runner is None else job.runner.world
    job.cfg, job.run_dir, job.resuming, *job.made = world.on_main(job.setup, cfg, Path(run_dir))
    world.run_dir = job.run_dir
    job.run = run_ = Run(job.cfg, job.run_dir, world.is_main, job.resuming)
    tags = job.prepare()
    with run_.start(tags):
        job.work()
    summary = run_.summary(t0, **job.fields())
    out = job.outputs()
    return run_.finish(summary, **{**out, "table": out.get("table") if verbose else None})


def _train(
    cfg: DictConfig, run_dir: str | Path, observe: Observer | None, verbose: bool, runner: Any
) -> dict[str, Any]:
    from fedlightning.runs import trained_config

    program = program_of(trained_config(cfg))  # resume=DIR: the saved run's program
    return run(program, cfg, run_dir, observe, verbose, runner)
