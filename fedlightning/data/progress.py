"""Progress of one set-up step (graph generation, partition, splits): a bar and log lines."""

from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

log = logging.getLogger("fedlightning.data")


class SetupStep:
    """One set-up step over ``total`` pieces of ``unit``: an INFO line when it starts, a tqdm
    bar on an interactive terminal only, and an INFO line with the count and the seconds
    when it ends (:meth:`close`). Use as a context manager, or call :meth:`close`.

    Args:
        name: the step's name, e.g. ``"graph edges"``.
        total: the number of pieces the step does.
        unit: what a piece is, e.g. ``"block"``, ``"client"``.
        quiet: a step known to be short (a small graph): its lines at DEBUG, no bar.
    """

    def __init__(self, name: str, total: int, unit: str, quiet: bool = False) -> None:
        self.name, self.total, self.unit, self.done = name, int(total), unit, 0
        self.level = logging.DEBUG if quiet else logging.INFO
        self.t0 = time.perf_counter()
        log.log(self.level, "%s: %d %ss", name, self.total, unit)
        disable = True if quiet else None  # None: a bar on an interactive terminal only
        self.bar = tqdm(total=self.total, desc=name, unit=unit, disable=disable, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()
        seconds = time.perf_counter() - self.t0
        log.log(self.level, "%s done: %d %ss in %.1fs", self.name, self.done, self.unit, seconds)

    def __enter__(self) -> SetupStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
