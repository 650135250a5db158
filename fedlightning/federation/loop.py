"""The federated round loop: sample, broadcast, fit locally, aggregate, evaluate, checkpoint."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import Algorithm, FederatedClient
from fedlightning.federation.ledger import DOWN, UP, CommLedger
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.stacking import UnionEvaluate, why_not_stacked
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.runs import CHECKPOINT_FORMAT
from fedlightning.utils.io import save_torch
from fedlightning.utils.seeding import derive_seed, manual_seed, rng_state, set_rng_state

log = logging.getLogger(__name__)


def sample_clients(seed: int, round: int, num_clients: int, fraction: float) -> list[int]:
    """The clients taking part in ``round``: ``max(1, round(fraction K))`` (half up), seeded."""
    m = max(1, int(np.floor(fraction * num_clients + 0.5)))
    if m >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(derive_seed(seed, "sample", round))
    return sorted(rng.choice(num_clients, size=m, replace=False).tolist())


def check_min_clients(value: Any) -> int:
    """``federation.min_clients``: a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("federation.min_clients", f"must be an integer >= 1, got {value!r}")
    return value


def pooled_metrics(results: dict[int, dict[str, int]]) -> dict[str, float]:
    """Accuracy pooled over clients (weighted by nodes) per split, and per client on test."""

    def acc(rs: Sequence[dict[str, int]], split: str) -> float:
        total = sum(r[f"{split}_total"] for r in rs)
        return sum(r[f"{split}_correct"] for r in rs) / total if total else float("nan")

    out = {f"{s}_acc": acc(list(results.values()), s) for s in ("train", "val", "test")}
    return out | {f"client{k}_test_acc": acc([r], "test") for k, r in results.items()}


def local_fit(
    algorithm: Algorithm,
    module: pl.LightningModule,
    broadcast: ServerBroadcast,
    executor: Any,
    epochs: int,
    seed: int,
    client: FederatedClient,
) -> ClientUpdate:
    """One client's part of a round: receive the broadcast, fit locally, return the update.
    The same call runs in this process, on another rank or on the client's Flower node;
    seeded by ``(seed, "fit", round, client)``, its result does not depend on where."""
    manual_seed(derive_seed(seed, "fit", broadcast.round, client.client_id))
    return algorithm.local_fit(module, client, broadcast, executor, epochs)


def local_fit_share(
    algorithm: Algorithm,
    module: pl.LightningModule,
    broadcast: ServerBroadcast,
    executor: Any,
    epochs: int,
    seed: int,
    clients: Sequence[FederatedClient],
    positions: range,
) -> list[ClientUpdate]:
    """:func:`local_fit` of the round's ``clients`` at ``positions`` as one stacked fit
    (``algorithm.local_fit_share``): client ``k``'s dropout is seeded by ``(seed, "fit",
    round, k)`` as its own fit would be."""
    mine = [clients[i] for i in positions]
    seeds = [derive_seed(seed, "fit", broadcast.round, c.client_id) for c in mine]
    return algorithm.local_fit_share(module, mine, broadcast, executor, epochs, seeds)


@dataclass
class LocalEvaluate:
    """The global model on one client's whole subgraph: correct and total nodes per split."""

    module: pl.LightningModule
    global_state: dict[str, torch.Tensor]

    def __call__(self, client: FederatedClient) -> dict[str, int]:
        self.module.receive(self.global_state)
        return self.module.evaluate(client.data)


class Schedule:
    """What every schedule keeps: the run's ledger, a checkpoint after each step, and the
    run's ``identity`` (experiment, config hash, protocol hashes), set by the program that
    builds the schedule and saved in every checkpoint so that a resume can check it."""

    identity: dict[str, Any] | None = None

    def __init__(self, checkpoint_path: str | Path | None) -> None:
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.ledger = CommLedger()

    def checkpoint(self) -> None:
        """Write :meth:`state_dict` to ``checkpoint_path`` (if any)."""
        if self.checkpoint_path:
            save_torch(self.checkpoint_path, self.state_dict())

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "identity": self.identity,
            "ledger": self.ledger.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger.load_state_dict(state["ledger"])


class FederatedLoop(Schedule):
    """Runs rounds ``start..rounds`` and checkpoints the whole federated state after each.

    Args:
        algorithm, server, clients, runner: the method, its server, all clients, where they run.
        module: the client LightningModule, shared by all clients (their persistent state
            lives in :attr:`FederatedClient.state`, not in the module).
        rounds, participation, local_epochs, seed: from the config; every local fit is
            seeded by ``(seed, "fit", round, client)``.
        checkpoint_path: where to write the state after every round (``None``: nowhere).
        on_round_end: ``(round, metrics) -> None`` after the checkpoint, e.g. MLflow logging.
        min_clients: ``federation.min_clients``: a round whose kept messages fall below it
            after the server dropped some stops the run (docs/security.md)."""

    def __init__(
        self,
        algorithm: Algorithm,
        module: pl.LightningModule,
        server: Any,
        clients: Sequence[FederatedClient],
        runner: Any,
        *,
        rounds: int,
        participation: float = 1.0,
        local_epochs: int = 1,
        seed: int = 0,
        checkpoint_path: str | Path | None = None,
        on_round_end: Callable[[int, dict[str, float]], None] | None = None,
        min_clients: int = 1,
    ) -> None:
        super().__init__(checkpoint_path)
        self.min_clients = check_min_clients(min_clients)
        self.algorithm, self.module, self.server = algorithm, module, server
        self.clients, self.runner = list(clients), runner
        self.rounds, self.participation = rounds, participation
        self.local_epochs, self.seed = local_epochs, seed
        self.on_round_end = on_round_end
        self.history: list[dict[str, float]] = []
        self.completed_rounds = 0
        self.last_updates: list[ClientUpdate] = []  # the round's kept updates (not saved)
        self._stacking: bool | None = None
        algorithm.prepare_clients(self.clients)

    # ------------------------------------------------------------------ one round
    def run_round(self, round: int) -> dict[str, float]:
        t0 = time.perf_counter()
        sampled = sample_clients(self.seed, round, len(self.clients), self.participation)
        round_clients = [self.clients[k] for k in sampled]
        updates = federated_round(
            round,
            self.server,
            self.runner,
            round_clients,
            partial(self.work, clients=round_clients),
            self.ledger,
            desc=f"round {round}/{self.rounds}",
            min_clients=self.min_clients,
        )
        self.last_updates = updates
        metrics = self.evaluate(round)
        if self.algorithm.report_train_loss:  # the clients' own loss, only when they send it
            weights = [u.num_examples for u in updates]
            metrics["train_loss"] = float(
                np.average(
                    [u.scalars["train_loss"] for u in updates],
                    weights=weights if sum(weights) > 0 else None,
                )
            )
        metrics["rejected"] = float(self.ledger.rejected(round=round))
        if self.ledger.screened:  # a robust rule runs: the clients it set aside
            metrics["suspicious"] = float(self.ledger.suspected(round=round))
        metrics["uplink_mib"] = self.ledger.mib(UP)
        metrics["downlink_mib"] = self.ledger.mib(DOWN)
        metrics["round_time_s"] = time.perf_counter() - t0
        return metrics

    def work(
        self, broadcast: ServerBroadcast, clients: Sequence[FederatedClient] = ()
    ) -> ClientWork:
        """The clients' part of a round: each one's :func:`local_fit`, or, when the round's
        ``clients`` are stacked (:meth:`stacking`), a share's :func:`local_fit_share`."""
        args = (self.algorithm, self.module, broadcast, self.runner.executor)
        args += (self.local_epochs, self.seed)
        share = partial(local_fit_share, *args, list(clients)) if self.stacking() else None
        params = {"epochs": int(self.local_epochs)}
        return ClientWork(
            one=partial(local_fit, *args),
            share=share,
            kind="fit",
            params=params,
            uplink=self.algorithm.uplink(broadcast),
            downlink=self.algorithm.downlink(self.server.global_state),
        )

    def stacking(self) -> bool:
        """Whether the round's clients fit as one stack and evaluate in one pass
        (``runner.stack_clients``, docs/scaling.md): when the runner asks for it and the
        method, its client module, its net and its optimizer allow it
        (:func:`~fedlightning.federation.stacking.why_not_stacked`); else one at a time."""
        if self._stacking is None:
            wanted = bool(getattr(self.runner, "stack_clients", False))
            why = why_not_stacked(self.algorithm, self.module) if wanted else ""
            if why:
                log.info("clients fit one at a time (runner.stack_clients): %s", why)
            self._stacking = wanted and not why
        return self._stacking

    def evaluate(self, round: int) -> dict[str, float]:
        """The global model on every client's whole subgraph (a measurement, not counted);
        in one pass over all clients when they are stacked."""
        if self.stacking():
            evaluate = UnionEvaluate(self.module, self.server.global_state, self.clients)
        else:
            evaluate = LocalEvaluate(self.module, self.server.global_state)
        return pooled_metrics(self.runner.evaluate(round, self.clients, evaluate))

    def run(self) -> list[dict[str, float]]:
        for r in range(self.completed_rounds + 1, self.rounds + 1):
            metrics = self.run_round(r)
            loss = f"  train_loss {metrics['train_loss']:.4f}" if "train_loss" in metrics else ""
            dropped = f"  rejected {metrics['rejected']:.0f}" if metrics.get("rejected") else ""
            log.info(
                "round %d/%d  train_acc %.4f  val_acc %.4f  test_acc %.4f%s%s  up %.3f MiB  (%.1fs)",
                r,
                self.rounds,
                metrics["train_acc"],
                metrics["val_acc"],
                metrics["test_acc"],
                loss,
                dropped,
                metrics["uplink_mib"],
                metrics["round_time_s"],
            )
            self.end_of_round(r)  # after the round's line: a stage's summary follows its last round
            self.history.append({"round": r, **metrics})
            self.completed_rounds = r
            self.checkpoint()  # before reporting: a resumed run never logs a step twice
            self.report(r, metrics)
        return self.history

    def end_of_round(self, round: int) -> None:
        """Extra work after a round's evaluation (a stage's end, say)."""

    def report(self, round: int, metrics: dict[str, float]) -> None:
        """Hand a finished, checkpointed round's metrics to ``on_round_end``."""
        if self.on_round_end:
            self.on_round_end(round, metrics)

    def final_metrics(self) -> dict[str, float]:
        """Final-round metrics and the test accuracy at the round of best validation accuracy."""
        last = self.history[-1]
        best = max(self.history, key=lambda h: (h["val_acc"], -h["round"]))
        out = {k: last[k] for k in ("test_acc", "val_acc", "train_acc", "train_loss") if k in last}
        out.update({k: v for k, v in last.items() if k.startswith("client")})
        out["best_val_acc"] = best["val_acc"]
        out["best_val_round"] = best["round"]
        out["test_acc_at_best_val"] = best["test_acc"]
        out["rejected"] = float(self.ledger.rejected())
        if self.ledger.screened:
            out["suspicious"] = float(self.ledger.suspected())
        return out

    def summary_extras(self) -> dict[str, Any]:
        """Extra blocks for ``summary.json`` (the accuracy matrix, per-stage results, ...)."""
        return {}

    def timing(self) -> dict[str, float]:
        """``summary.json["timing"]``: the mean wall time of a round (``round_time_s``: fits,
        aggregation and the round's evaluation) over every round, a resumed run's earlier
        ones included; kept out of ``metrics``, which two runs of one seed share bitwise."""
        times = [h["round_time_s"] for h in self.history if "round_time_s" in h]
        return {
            "s_per_round": sum(times) / len(times) if times else math.nan,
            "rounds_timed": float(len(times)),
        }

    def write_artifacts(self, run_dir: Path, title: str, plots: bool = True) -> list[Path]:
        """Plots (unless ``plots`` is false) and tables of the run, written into ``run_dir``;
        returns their paths."""
        if not plots:
            return []
        from fedlightning.tracking.plots import plot_curves

        # the loss panel stays empty unless the clients sent their loss
        history = [{"train_loss": math.nan, **h} for h in self.history]
        return [plot_curves(history, run_dir / "curves.png", title=title)]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "extra": {},  # a subclass's own state
            "completed_rounds": self.completed_rounds,
            "server": self.server.state_dict(),
            "clients": {c.client_id: c.state for c in self.clients},
            "history": self.history,
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.completed_rounds = int(state["completed_rounds"])
        self.server.load_state_dict(state["server"])
        for c in self.clients:
            c.state = state["clients"][c.client_id]
        super().load_state_dict(state)
        self.history = list(state["history"])
        set_rng_state(state["rng"])
