"""This process's place among the ranks of a run: rank, world size, device, collectives.

A run under ``torchrun`` (``WORLD_SIZE`` set) joins the ``torch.distributed`` process group;
any other run is a world of one process, where every collective is the identity. Only object
collectives are used (``broadcast`` of rank 0's results, ``all_gather`` of updates): no
reduction touches a value that enters the server step."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fedlightning.errors import ConfigError, FedLightningError

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
T = TypeVar("T")


class RankLost(FedLightningError):
    """Another rank died, or did not answer a collective within the process group's timeout."""


@dataclass
class World:
    """The ranks of a run, as this process sees them: this process's global ``rank`` among
    ``size``, the ``device`` of its local fits, the process group's ``timeout_s`` (``0``:
    none) and the ``run_dir`` named in the error that tells how to resume."""

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = 0.0
    run_dir: Path | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that logs, prints and writes files."""
        return self.rank == 0

    def on_main(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on rank 0 only; every rank returns its result. When ``fn``
        raises on rank 0, every rank raises: rank 0 its own exception, the others a
        :class:`~fedlightning.errors.FedLightningError` (or ``RuntimeError``) with the same
        message, so no rank is left waiting."""
        if self.size == 1:
            return fn(*args, **kwargs)
        result, error = None, None
        if self.is_main:
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                error = e
        failure = None if error is None else (isinstance(error, FedLightningError), str(error))
        box = [(result, failure)]
        self._collective(
            f"waiting for rank 0 ({getattr(fn, '__name__', 'setup')})",
            lambda: dist.broadcast_object_list(box, src=0),
        )
        if error is not None:
            raise error
        result, failure = box[0]
        if failure is not None:
            user, message = failure
            raise FedLightningError(message) if user else RuntimeError(f"rank 0: {message}")
        return result

    def all_gather(self, obj: T, what: str) -> list[T]:
        """Every rank's ``obj``, in rank order (``what`` names the step in errors)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        self._collective(what, lambda: dist.all_gather_object(out, obj))
        return out

    def lost(self, what: str) -> RankLost:
        """The error of a rank that lost the others during ``what``, with how to resume."""
        resume = self.run_dir if self.run_dir is not None else "RUN_DIR"
        return RankLost(
            f"rank {self.rank} of {self.size}: {what}. Every finished round is checkpointed; "
            f"continue with `torchrun ... -m fedlightning train resume={resume} "
            "runner=distributed`"
        )

    def _collective(self, what: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except RuntimeError as e:  # Gloo/NCCL errors and timeouts are RuntimeErrors
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise self.lost(
                f"{what}: another rank died or did not answer within "
                f"{self.timeout_s:g} s (10 x runner.client_timeout_s) ({first})"
            ) from e

    def stop_on_sigterm(self) -> None:
        """Turn ``torchrun``'s SIGTERM (sent to every rank when one fails) into
        :class:`RankLost`: a clear error (MLflow: ``FAILED``)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def stopped(signum: int, frame: Any) -> None:
            raise self.lost("stopped by SIGTERM (torchrun stops every rank when one fails)")

        signal.signal(signal.SIGTERM, stopped)


def pick_device(device: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` for ``auto`` when CUDA is available (or for ``cuda``), else CPU."""
    if device not in DEVICES:
        raise ConfigError("runner.device", f"must be one of {DEVICES}, got {device!r}")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("runner.device", "cuda was asked for, but CUDA is not available")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ConfigError(
            "runner.device",
            f"local rank {local_rank} has no GPU of its own ({n} visible): start at most {n} "
            "processes per node (--nproc_per_node) or set runner.device=cpu",
        )
    return torch.device("cuda", local_rank)


def join_world(backend: str = "auto", device: str = "auto", timeout_s: float = 600.0) -> World:
    """Join the ``torchrun`` process group, or make a world of one process without one
    (``backend``, ``device``, ``timeout_s``: as the distributed runner's)."""
    if backend not in BACKENDS:
        raise ConfigError("runner.backend", f"must be one of {BACKENDS}, got {backend!r}")
    if timeout_s <= 0:
        raise ConfigError("runner.client_timeout_s", f"must be > 0, got {timeout_s}")
    dev = pick_device(device, int(os.environ.get("LOCAL_RANK", 0)))
    if "WORLD_SIZE" not in os.environ:  # not under torchrun: one process, no group
        return World(device=dev, timeout_s=timeout_s)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError("runner.backend", "nccl needs GPUs; use gloo (or auto) on CPU")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL's object collectives stage bytes on this GPU
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        atexit.register(_leave)
    return World(rank=dist.get_rank(), size=dist.get_world_size(), device=dev, timeout_s=timeout_s)


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def quiet_other_ranks(world: World) -> None:
    """Leave logging and files to rank 0: on ranks > 0 the package logs warnings only, and
    Hydra's log file is closed and its per-process directory (made before any of our code
    runs) removed when it holds only Hydra's own files and is not rank 0's."""
    from hydra.core.hydra_config import HydraConfig

    mine = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
    dirs = world.all_gather(mine, "sharing the run directory")
    if world.is_main:
        return
    logging.getLogger("fedlightning").setLevel(logging.WARNING)
    if mine is None:
        return
    here = Path(mine).resolve()
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler) and here in Path(h.baseFilename).resolve().parents:
            root.removeHandler(h)
            h.close()
    hydra_only = all(p.name == ".hydra" or p.suffix == ".log" for p in here.iterdir())
    if dirs[0] is not None and Path(dirs[0]).resolve() != here and hydra_only:
        shutil.rmtree(here, ignore_errors=True)
