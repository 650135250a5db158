"""Runners decide where a round's clients run (docs/scaling.md); same seed, same result,
whichever runner (Flower's, :mod:`fedlightning.flower`, is one too)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from fedlightning.errors import ConfigError
from fedlightning.federation.world import World, join_world, quiet_other_ranks
from fedlightning.messages import ClientUpdate
from fedlightning.utils.seeding import rng_state, set_rng_state

FitFn = Callable[[Any], ClientUpdate]
log = logging.getLogger(__name__)
TIMEOUT_KEY = "runner.client_timeout_s"
SHARE_WAIT = 10  # a rank waits for the others up to this many client time limits


@dataclass
class ClientFailed:
    """What a runner returns in place of the update of a client whose fit raised or ran
    past the runner's time limit: the round drops it (docs/security.md)."""

    client_id: int
    reason: str


class FitTimeout(Exception):
    """A client's fit ran past ``runner.client_timeout_s``."""


def client_timeout(client_timeout_s: float | None, timeout_s: float | None = None) -> float | None:
    """The runner's time limit for one client's fit, ``runner.client_timeout_s``
    (``None``: none); ``timeout_s`` is its old name, still read (with a warning)."""
    if timeout_s is not None:
        log.warning("runner.timeout_s is the old name of %s; please use the new one", TIMEOUT_KEY)
        client_timeout_s = timeout_s
    if client_timeout_s is None:
        return None
    if isinstance(client_timeout_s, bool) or not float(client_timeout_s) > 0:
        raise ConfigError(TIMEOUT_KEY, f"must be > 0 seconds (or null), got {client_timeout_s!r}")
    return float(client_timeout_s)


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`FitTimeout` in this thread once ``seconds`` have passed (a SIGALRM
    timer, Unix main thread only; elsewhere, or with ``None``, no limit). The timer and
    handler in place before are put back afterwards."""
    usable = seconds is not None and hasattr(signal, "setitimer")
    if not usable or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise FitTimeout(f"fit exceeded {TIMEOUT_KEY}={seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    old_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, old_delay)


def guarded_fit(fit: FitFn, client: Any, seconds: float | None) -> ClientUpdate | ClientFailed:
    """``fit(client)`` within ``seconds``; a fit that raises or runs past them gives a
    :class:`ClientFailed` naming why (an interrupt or a stopped run still propagates)."""
    try:
        with time_limit(seconds):
            return fit(client)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return ClientFailed(client.client_id, f"{type(e).__name__}: {first}".rstrip(": "))


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
        kill_at: fault injection for resume tests: ``"ROUND:N"`` SIGKILLs this process after
            the N-th client fit of that round; ``"ROUND:N:KIND"`` only in that round's work
            of ``KIND`` (``stage_end``, ``task_fit``); ``"ROUND:N:KIND:TIMES"`` the TIMES-th
            time it matches (FedTIP's round numbers start again every task and family).
        stack_clients: fit a round's clients as one stack where the method supports it
            (:mod:`~fedlightning.federation.stacking`; the same results, faster).
        client_timeout_s: seconds one client's fit (or stacked share) may take (``None``: no
            limit); a fit that raises or runs longer is dropped (:class:`ClientFailed`).
        timeout_s: the old name of ``client_timeout_s`` (read, with a warning)."""

    name = "sequential"

    def __init__(
        self,
        executor: Any,
        progress: bool = True,
        kill_at: str | None = None,
        stack_clients: bool = True,
        client_timeout_s: float | None = 600.0,
        timeout_s: float | None = None,
    ) -> None:
        self.executor, self.world, self.progress = executor, World(), progress
        self.stack_clients = bool(stack_clients)
        self.client_timeout_s = client_timeout(client_timeout_s, timeout_s)
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
            mine.append((guarded_fit(fit, clients[i], self.client_timeout_s), clients[i].state))
            if self.kill_at in ((round, i + 1, None), (round, i + 1, kind)):
                self._kill_matches += 1
                if self._kill_matches == self.kill_times:
                    self._kill(round, i + 1, kind)
        if self.world.size == 1:
            return [update for update, _ in mine]
        last_rng = rng_state() if mine else None
        parts = self.world.all_gather((mine, last_rng), f"gathering round {round}")
        results = [r for part, _ in parts for r in part]
        for client, (_, state) in zip(clients, results, strict=True):
            client.state = state  # the fitting rank's state, now on every rank
        set_rng_state(next(rng for _, rng in reversed(parts) if rng is not None))
        return [update for update, _ in results]

    def _kill(self, round: int, n: int, kind: str) -> None:
        """SIGKILL this process, first saying where on stderr: another rank's log of the
        same moment may never be written, as ``torchrun`` stops it at once."""
        where = f"round {round}, client {n}, {kind}, rank {self.world.rank}"
        print(f"runner.kill_at: SIGKILL after {where}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


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
        device: ``auto`` (``cuda:<local_rank>`` with CUDA, else CPU), ``cpu`` or ``cuda``.
        client_timeout_s: as :class:`SequentialRunner`'s; a rank waits for the others in a
            collective up to :data:`SHARE_WAIT` times it before it fails with
            :class:`~fedlightning.federation.world.RankLost` (``None``: 600 s).
        timeout_s: the old name of ``client_timeout_s`` (read, with a warning).
        progress, kill_at: as :class:`SequentialRunner`'s (the bar on rank 0).
        stack_clients: as :class:`SequentialRunner`'s (each rank stacks its share)."""

    name = "distributed"

    def __init__(
        self,
        executor: Any,
        backend: str = "auto",
        device: str = "auto",
        client_timeout_s: float | None = 600.0,
        progress: bool = True,
        kill_at: str | None = None,
        stack_clients: bool = True,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(executor, progress, kill_at, stack_clients, client_timeout_s, timeout_s)
        wait = SHARE_WAIT * self.client_timeout_s if self.client_timeout_s else 600.0
        self.world = join_world(backend, device, wait)
        self.executor.device = self.world.device
        self.progress = progress and self.world.is_main
        if self.world.size > 1:
            quiet_other_ranks(self.world)
            self.world.stop_on_sigterm()
