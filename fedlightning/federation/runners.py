"""Runners decide where clients run. Same seed, same result, whichever runner."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from fedlightning.federation.messages import ClientUpdate

FitFn = Callable[[Any], ClientUpdate]


class SequentialRunner:
    """Runs the sampled clients one after another in this process.

    Args:
        executor: the local-fit executor (:class:`~fedlightning.federation.executors.LeanExecutor`
            or :class:`~fedlightning.federation.executors.TrainerExecutor`).
        progress: show a progress bar over clients when the terminal is interactive.
        kill_at: fault injection for resume tests, ``"ROUND:N"``: the process kills itself
            with SIGKILL after the N-th client fit of that round (mid-round, as a crash).
    """

    name = "sequential"

    def __init__(self, executor: Any, progress: bool = True, kill_at: str | None = None) -> None:
        self.executor = executor
        self.progress = progress
        self.kill_at = tuple(int(x) for x in str(kill_at).split(":")) if kill_at else None

    def run_round(
        self, round: int, clients: Sequence[Any], fit: FitFn, desc: str = ""
    ) -> list[ClientUpdate]:
        """Fit each client and return their updates in the order given."""
        updates = []
        bar = tqdm(
            clients,
            desc=desc or f"round {round}",
            unit="client",
            leave=False,
            disable=None if self.progress else True,
        )
        for n, client in enumerate(bar, start=1):
            updates.append(fit(client))
            if self.kill_at == (round, n):
                os.kill(os.getpid(), signal.SIGKILL)
        return updates
