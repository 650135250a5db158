"""A FedTIP run's tasks on several processes at once (``task_workers``; docs/fedtip.md,
"Fast path"): the tasks are independent, so :func:`task_results` runs them on ``workers``
forked processes of one thread each (an OpenMP pool does not survive a fork), each with a
fresh ledger and the provisioned set the task would have seen in one process, and hands
back each task's metrics in manifest order, merging its ledger entries in that order:
bitwise the one-process run with ``threads=1``. Checkpoints, progress and tracking stay in
the calling process."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fedlightning.errors import ConfigError
from fedlightning.federation.ledger import CommLedger

_JOB: dict[str, Any] = {}  # what a forked worker reads: the loop and its tasks


def resolve_workers(workers: Any, tasks: int, runner: Any = None, poolable: bool = True) -> int:
    """``task_workers``: a positive int, or ``auto`` (the default: the usable cores, at most
    ``tasks``; 1 where only one process can run them or with ``runner.kill_at``); ``None`` is
    1. More than one needs ``runner=sequential`` on the CPU, a system that forks, and
    ``poolable`` tasks (:attr:`~fedlightning.federation.task_loop.TaskLoop.pool_tasks`):
    otherwise one line naming the key (``auto``: 1)."""
    device = getattr(getattr(runner, "executor", None), "device", None)
    forkable = runner is None or (
        type(runner).__name__ == "SequentialRunner"
        and getattr(getattr(runner, "world", None), "size", 1) == 1
        and (device is None or device.type == "cpu")
        and hasattr(os, "fork")
    )
    if workers is None:
        return 1
    if workers == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        killing = getattr(runner, "kill_at", None) is not None
        return max(1, min(cores, tasks)) if forkable and poolable and not killing else 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError("task_workers", f"a positive integer or auto, got {workers!r}")
    if workers > 1 and not forkable:
        raise ConfigError(
            "task_workers", f"{workers} processes need runner=sequential on the CPU; use 1"
        )
    if workers > 1 and not poolable:
        raise ConfigError(
            "task_workers",
            f"this method's one-off exchange before its first task is counted in that task; "
            f"{workers} processes would lose it from the task's own uplink: use 1 or auto",
        )
    return workers


def _run_one(i: int) -> tuple[dict[str, float], dict[str, list]]:
    loop, todo, before = _JOB["loop"], _JOB["todo"], _JOB["before"]
    loop.ledger = CommLedger()  # this task's records only
    loop.provisioned = set(before[i])
    metrics = loop.run_task(todo[i])
    return metrics, loop.ledger.state_dict()


def task_results(loop: Any, todo: Sequence[Any], workers: int = 1) -> Iterator[dict[str, float]]:
    """``loop.run_task(task)`` of every task of ``todo`` in order, on ``workers`` processes
    (module docstring; ``1``: in this process). After each yielded task the loop's ledger
    and ``provisioned`` set are those a one-process run has at that point."""
    if workers <= 1 or len(todo) <= 1 or not hasattr(os, "fork"):
        for task in todo:
            yield loop.run_task(task)
        return
    before, seen = [], set(loop.provisioned)
    for task in todo:
        before.append(frozenset(seen))
        if not loop.pooled:
            seen |= set(task.clients)
    _JOB.update(loop=loop, todo=list(todo), before=before)
    context = multiprocessing.get_context("fork")
    try:  # one thread each: OpenMP's pool does not survive a fork (the processes replace it)
        with context.Pool(min(workers, len(todo)), torch.set_num_threads, (1,)) as pool:
            for task, (metrics, part) in zip(
                todo, pool.imap(_run_one, range(len(todo)), chunksize=1), strict=True
            ):
                loop.ledger.extend(part)  # after the earlier tasks' records
                if not loop.pooled:
                    loop.provisioned |= set(task.clients)
                yield metrics
    finally:
        _JOB.clear()
