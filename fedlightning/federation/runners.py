"""Runners decide where a round's clients run (docs/scaling.md); same seed, same result,
whichever runner (Flower's, :mod:`fedlightning.flower`, is one too).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from fedlightning.federation.world import World, join_world, quiet_other_ranks
from fedlightning.messages import ClientUpdate
from fedlightning.utils.seeding import rng_state, set_rng_state

FitFn = Callable[[Any], ClientUpdate]


class Runner:
    """Where a round's clients run. Subclasses implement :meth:`run_round`."""

    name = "runner"
    executor: Any
    world: World
    stack_clients = False  # fit a round's clients as one stack where the method allows

    def begin(self, cfg: Any, run_dir: Any, hashes: dict[str, str]) -> None:
        """Before the first round, once the run's config, directory and protocol hashes are
        known (a Flower runner sets its nodes up here)."""

    def run_round(
        self, round: int, clients: Sequence[Any], fit: FitFn, desc: str = ""
    ) -> list[ClientUpdate]:
        """Run ``fit`` for each client; return the updates in the order given."""
        raise NotImplementedError

    def evaluate(
        self, round: int, clients: Sequence[Any], evaluate: Callable[[Any], dict[str, int]]
    ) -> dict[int, dict[str, int]]:
        """Client id -> ``evaluate(client)``, in this process (which holds every client's
        data, as every rank of a distributed run does)."""
        return {c.client_id: evaluate(c) for c in clients}


class SequentialRunner(Runner):
    """Runs the sampled clients one after another in this process.

    Args:
        executor: the local-fit executor (:mod:`~fedlightning.federation.executors`).
        progress: a progress bar over clients when the terminal is interactive.
        kill_at: fault injection for resume tests, ``"ROUND:N"``: SIGKILL this process
            after the N-th client fit of that round (mid-round, as a crash);
            ``"ROUND:N:KIND"``: only in that round's work of ``KIND`` (``stage_end``: the
            stage-end exchange that follows the stage's last round; ``task_fit``: a FedTIP
            task's round); ``"ROUND:N:KIND:TIMES"``: the TIMES-th time it matches (FedTIP's
            round numbers start again with every task and family).
        stack_clients: fit a round's clients as one stack and evaluate them in one pass
            where the method supports it (:mod:`~fedlightning.federation.stacking`).
    """

    name = "sequential"

    def __init__(
        self,
        executor: Any,
        progress: bool = True,
        kill_at: str | None = None,
        stack_clients: bool = False,
    ) -> None:
        self.executor, self.world, self.progress = executor, World(), progress
        self.stack_clients = bool(stack_clients)
        self.kill_at: tuple[int, int, str | None] | None = None
        self.kill_times, self._kill_matches = 1, 0
        if kill_at:  # "ROUND:N", "ROUND:N:KIND" or "ROUND:N:KIND:TIMES"
            round_, n, *rest = str(kill_at).split(":")
            self.kill_at = (int(round_), int(n), rest[0] if rest and rest[0] else None)
            self.kill_times = int(rest[1]) if len(rest) > 1 else 1

    def run_round(
        self, round: int, clients: Sequence[Any], fit: FitFn, desc: str = ""
    ) -> list[ClientUpdate]:
        """Fit this rank's share (:func:`contiguous_shares`: every client in a world of one)
        and, among several ranks, gather every share; all updates, in the order given."""
        share = contiguous_shares(len(clients), self.world.size)[self.world.rank]
        bar = tqdm(
            share,
            desc=desc or f"round {round}",
            unit="client",
            leave=False,
            disable=None if self.progress else True,
        )
        mine = []
        kind = getattr(fit, "kind", "fit")
        for i in bar:
            mine.append((fit(clients[i]), clients[i].state))
            if self.kill_at in ((round, i + 1, None), (round, i + 1, kind)):
                self._kill_matches += 1
                if self._kill_matches == self.kill_times:
                    os.kill(os.getpid(), signal.SIGKILL)
        if self.world.size == 1:
            return [update for update, _ in mine]
        last_rng = rng_state() if mine else None
        parts = self.world.all_gather((mine, last_rng), f"gathering round {round}")
        results = [r for part, _ in parts for r in part]
        for client, (_, state) in zip(clients, results, strict=True):
            client.state = state  # the fitting rank's state, now on every rank
        set_rng_state(next(rng for _, rng in reversed(parts) if rng is not None))
        return [update for update, _ in results]


def contiguous_shares(n: int, size: int) -> list[range]:
    """Positions ``0..n-1`` cut into ``size`` contiguous shares in rank order: rank ``r`` gets
    ``range(r n // size, (r + 1) n // size)``."""
    return [range(r * n // size, (r + 1) * n // size) for r in range(size)]


class DistributedRunner(SequentialRunner):
    """Spreads each round's clients over the processes of a ``torchrun`` job, bitwise a
    sequential run on CPU (docs/scaling.md): rank ``r`` fits its :func:`contiguous_shares`
    share, every rank gathers all updates and client states; only rank 0 logs and writes.
    Without ``torchrun`` it is a world of one process.

    Args:
        executor: the local-fit executor; its ``device`` is set to this rank's device.
        backend: ``auto`` (NCCL on GPUs, Gloo on CPU), ``gloo`` or ``nccl``.
        device: ``auto`` (``cuda:<local_rank>`` when CUDA is available, else CPU), ``cpu``
            or ``cuda``.
        timeout_s: seconds a rank waits in a collective before it fails with
            :class:`~fedlightning.federation.world.RankLost` (default ``600``).
        progress, kill_at: as :class:`SequentialRunner`'s (the bar on rank 0; the rank
            that fits the N-th client of ROUND kills itself).
        stack_clients: as :class:`SequentialRunner`'s (each rank stacks its share).
    """

    name = "distributed"

    def __init__(
        self,
        executor: Any,
        backend: str = "auto",
        device: str = "auto",
        timeout_s: float = 600.0,
        progress: bool = True,
        kill_at: str | None = None,
        stack_clients: bool = False,
    ) -> None:
        super().__init__(executor, progress, kill_at, stack_clients)
        self.world = join_world(backend, device, float(timeout_s))
        self.executor.device = self.world.device
        self.progress = progress and self.world.is_main
        if self.world.size > 1:
            quiet_other_ranks(self.world)
            self.world.stop_on_sigterm()
