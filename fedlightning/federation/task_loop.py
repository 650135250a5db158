"""FedTIP's per-task protocol loop (paper 001, Sec. 3.2-3.3, 4.4 and 5.1; docs/fedtip.md): per
task and family, a fresh adapter federated over the task's active clients, then scored by the
server on its validation and test segments; checkpointed after each task. One ledger covers
the run (scope ``task=<id>``, fields ``<family>/<field>``, Eq. 32), with the downlink of Eq.
(33): the bank once per newly provisioned client, the adapter and anchors every round.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor
from tqdm.auto import tqdm

from fedlightning.federation.ledger import DOWN, MIB, UP, CommLedger
from fedlightning.federation.loop import Schedule, check_min_clients
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.task_pool import task_results
from fedlightning.messages import ServerBroadcast
from fedlightning.server.reliability import with_robust
from fedlightning.utils.seeding import derive_seed, manual_seed

log = logging.getLogger(__name__)

Batch = dict[str, Tensor]


@dataclass
class TaskBatches:
    """One task: its id and each active client's support batch (client order).

    A Flower node holds only its own client's batch; ``ids`` and ``length`` then give every
    active client, in order, and the longest support (a round's stack is padded to it).
    """

    task: int
    clients: dict[int, Batch]
    ids: list[int] | None = None
    length: int | None = None

    @property
    def active(self) -> list[int]:
        return list(self.clients) if self.ids is None else list(self.ids)

    @property
    def longest(self) -> int:
        if self.length is not None:
            return self.length
        return max(len(b["h_u"]) for b in self.clients.values())


@dataclass
class TaskContext:
    """A task fit's seed, local steps ``E`` and executor (a :class:`TaskLoop`'s, or a
    Flower node's own)."""

    seed: int
    epochs: int
    executor: Any


class TaskLoop(Schedule):
    """Runs the task manifest (module docstring).

    Args:
        algorithm: the temporal method (FedTIP, a comparator or a baseline; its task verbs
            are :class:`~fedlightning.federation.algorithm.Algorithm`'s).
        tasks: every task's client batches, in task order.
        eval_batches: ``{"val": batch, "test": batch}``, the server's segments.
        families: task families to run (``nc`` needs state labels).
        dims: ``(d_h, d_t, d_e)`` of the adapter.
        runner: runs a round's clients (its ``executor`` runs the local fits).
        rounds, epochs, seed: R, E, and the seed every draw is keyed by (with task, family,
            round, client).
        bank_values: :math:`|\\mathcal{B}_0|`, float32 values of the bank (Eq. 33).
        checkpoint_path, on_task_end: as :class:`~fedlightning.federation.loop.FederatedLoop`'s,
            per task (``on_task_end(task_index, metrics)``).
        progress: the bar over tasks.
        workers: processes that run tasks at once (:mod:`~fedlightning.federation.task_pool`;
            the same results as one).
        min_clients: ``federation.min_clients`` (docs/security.md).
    """

    prepared = False  # the method's one-off exchange before the first task is done

    def __init__(
        self,
        algorithm: Any,
        tasks: Sequence[TaskBatches],
        eval_batches: dict[str, Batch],
        families: Sequence[str],
        dims: tuple[int, int, int],
        runner: Any,
        *,
        rounds: int,
        epochs: int,
        seed: int,
        bank_values: int = 0,
        checkpoint_path: str | Path | None = None,
        on_task_end: Callable[[int, dict[str, float]], None] | None = None,
        progress: bool = True,
        workers: int = 1,
        min_clients: int = 1,
    ) -> None:
        super().__init__(checkpoint_path)
        self.workers = workers
        self.min_clients = check_min_clients(min_clients)
        self.algorithm, self.tasks, self.eval_batches = algorithm, list(tasks), eval_batches
        self.families, self.dims, self.runner = list(families), dims, runner
        self.rounds, self.epochs, self.seed = rounds, epochs, seed
        self.bank_values = bank_values
        self.on_task_end, self.progress = on_task_end, progress
        self.results: list[dict[str, float]] = []
        self.provisioned: set[int] = set()

    @property
    def pooled(self) -> bool:
        """The clients' supports are pooled (``algorithm.pooled``): no messages, no bank sent."""
        return bool(self.algorithm.pooled)

    @property
    def pool_tasks(self) -> bool:
        """Tasks may run on forked processes (``task_workers``; ``algorithm.pool_tasks``)."""
        return bool(self.algorithm.pool_tasks)

    # ------------------------------------------------------------------ one family
    def new_adapter(self, task: TaskBatches, family: str) -> Any:
        r"""The task's initial adapter :math:`\Omega^{(0)}`, seeded by (seed, task, family)."""
        manual_seed(derive_seed(self.seed, "init", task.task, family))
        return self.algorithm.adapter(*self.dims)

    def federate(self, task: TaskBatches, family: str) -> tuple[Any, dict[int, Tensor]]:
        """The task's global adapter after ``rounds`` rounds, and its class prototypes; with
        ``algorithm.pooled``, after one client holding the union of the task's supports fit
        ``rounds x epochs`` steps (``algorithm.pooled_fit``; its support moves raw, so no
        message is counted)."""
        alg = self.algorithm
        adapter = self.new_adapter(task, family)
        module = alg.task_module(adapter, family)
        context = TaskContext(self.seed, self.epochs, self.runner.executor)
        if self.pooled:
            return alg.pooled_fit(context, task, family, module, adapter, self.rounds)
        server = with_robust(alg.task_server(module), alg.task_robust)
        params = {"task": task.task, "family": family, "ids": task.active, "length": task.longest}

        def work(broadcast: ServerBroadcast) -> ClientWork:
            todo = alg.task_work(context, task, family, module, broadcast)
            return replace(todo, kind="task_fit", params={**params, "epochs": self.epochs})

        for r in range(1, self.rounds + 1):
            federated_round(
                r,
                server,
                self.runner,
                [Member(k) for k in task.clients],
                work,
                self.ledger,
                prefix=family,
                scope=task_scope(task.task),
                min_clients=self.min_clients,
            )
        return alg.task_result(module, adapter, server)

    # ------------------------------------------------------------------ one task
    def run_task(self, task: TaskBatches) -> dict[str, float]:
        t0 = time.perf_counter()
        scope = task_scope(task.task)
        for k in task.clients:
            if k not in self.provisioned and not self.pooled:
                self.provisioned.add(k)
                self.ledger.record_values(DOWN, k, "bank", self.bank_values, scope)
        metrics: dict[str, float] = {"task": task.task}
        for family in self.families:
            adapter, protos = self.federate(task, family)
            if family == "nc" and (missing := sorted({0, 1} - set(protos))):
                log.warning(
                    "task %s nc: no prototype for class %s (no kept message observed it): "
                    "auc_nc not scored (null)",
                    task.task,
                    ", ".join(map(str, missing)),
                )
            segments = self.algorithm.task_segments(self, self.eval_batches)
            for split, batch in segments.items():
                prefix = "val_" if split == "val" else ""
                for k, v in self.algorithm.task_scores(adapter, protos, batch, family).items():
                    if not (split == "val" and k == "auc_ilp"):  # inductive flags: test only
                        metrics[prefix + k] = v
        metrics["rejected"] = float(self.ledger.rejected(scope=scope))
        metrics["uplink_mib"] = self.ledger.mib(UP, scope=scope)
        metrics["downlink_mib"] = self.ledger.mib(DOWN, scope=scope)
        metrics["task_time_s"] = time.perf_counter() - t0
        return metrics

    def run(self) -> list[dict[str, float]]:
        """Every task not done yet, in ``algorithm.task_threads()``; returns the per-task
        metrics."""
        with self.algorithm.task_threads():
            return self.run_tasks()

    def run_tasks(self) -> list[dict[str, float]]:
        """The method's one-off exchange (``algorithm.before_tasks``, before the first task
        it runs: counted in the ledger in the first task's scope on a fresh run, redone
        without counting on a resumed one, its result being deterministic), then every task
        not done yet."""
        todo = self.tasks[len(self.results) :]
        if todo and not self.prepared:
            ledger = self.ledger if not self.results else CommLedger()
            self.algorithm.before_tasks(self, ledger, task_scope(todo[0].task))
            self.prepared = True
        bar = tqdm(todo, desc="tasks", unit="task", disable=None if self.progress else True)
        t0 = time.perf_counter()
        done = task_results(self, todo, self.workers)
        for i, (task, metrics) in enumerate(zip(bar, done, strict=True), start=1):
            self.results.append(metrics)
            n = len(self.results)
            self.checkpoint()
            running = {k: v for k, v in self.final_metrics().items() if k.startswith("auc")}
            bar.set_postfix({k: f"{v:.3f}" for k, v in running.items() if not k.endswith("std")})
            elapsed = time.perf_counter() - t0
            log.info(
                "task %d/%d (%s): %s  up %.3f MiB  (%.1fs; %.0fs elapsed, eta %.0fs)",
                n,
                len(self.tasks),
                task.task,
                "  ".join(f"{k} {metrics[k]:.3f}" for k in sorted(metrics) if k.startswith("auc")),
                metrics["uplink_mib"],
                metrics["task_time_s"],
                elapsed,
                elapsed / i * (len(todo) - i),
            )
            if self.on_task_end:
                self.on_task_end(n, metrics)
        return self.results

    def timing(self) -> dict[str, float]:
        """``summary.json["timing"]``: the mean wall time of a task (``task_time_s``, bank
        and contexts excluded) over the tasks this process ran or a resumed run reloaded."""
        times = [r["task_time_s"] for r in self.results if "task_time_s" in r]
        return {
            "s_per_task": sum(times) / len(times) if times else float("nan"),
            "tasks_timed": len(times),
        }

    def final_metrics(self) -> dict[str, float]:
        """Mean and std over the tasks of every AUC, and the uplink/downlink per task (not
        for pooled training, whose support moves raw to the server)."""
        out: dict[str, float] = {}
        keys = [k for k in self.results[0] if k not in ("task", "task_time_s", "rejected")]
        if self.pooled:  # raw support pooled: no federated uplink
            keys = [k for k in keys if not k.endswith("_mib")]
        for k in keys:
            vals = np.array([r[k] for r in self.results], dtype=np.float64)
            ok = vals[~np.isnan(vals)]
            name = f"{k}_per_task" if k.endswith("_mib") else k
            out[name] = float(ok.mean()) if len(ok) else math.nan
            if not k.endswith("_mib"):
                out[f"{k}_std"] = float(ok.std()) if len(ok) else math.nan
        out["rejected"] = float(self.ledger.rejected())
        return out

    def comm(self) -> dict[str, Any]:
        """The ``comm`` block of ``summary.json``: the ledger's, per task, and every
        client's latest message size per family (``message_values``)."""
        out = self.ledger.summary()
        out["uplink_mib_per_task"] = out["uplink_mib"] / max(1, len(self.results))
        sizes = {f: self.ledger.message_values(f"{f}/") for f in self.families}
        out["message_values"] = {f: max(v.values()) for f, v in sizes.items() if v}
        out["message_values_per_client"] = {
            f: {str(k): n for k, n in v.items()} for f, v in sizes.items() if v
        }
        scopes = self.ledger.by("scope")
        out["per_task"] = {
            str(r["task"]): scopes.get(task_scope(r["task"]), {UP: 0, DOWN: 0})
            for r in self.results
        }
        out["bank_values"] = self.bank_values
        bank = out["fields"].get("bank", {DOWN: 0})[DOWN]  # Eq. (33)'s one-off term
        out["recurrent_downlink_mib_per_task"] = (
            4.0 * (out["downlink_values"] - bank) / MIB / max(1, len(self.results))
        )
        out["clients_provisioned"] = len(self.provisioned)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        return {**state, "results": self.results, "provisioned": sorted(self.provisioned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.results = list(state["results"])
        self.provisioned = set(state["provisioned"])


def task_scope(task: int) -> str:
    """The ledger scope of a task's messages."""
    return f"task={task}"


@dataclass
class Member:
    """A task's client as a runner sees it: its id, and no state kept between rounds."""

    client_id: int
    state: None = None
