"""Hashing and atomic writes for protocol objects and checkpoints."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def content_hash(obj: Any) -> str:
    """sha256 (first 16 hex chars) of ``obj``'s canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ContentHashed:
    """A protocol object whose ``hash`` is the :func:`content_hash` of its :meth:`to_json`:
    same inputs, same JSON, same hash."""

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def hash(self) -> str:
        return content_hash(self.to_json())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once at import: os.umask can only be read by setting it


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 -> what open() gives (0644 usually)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    """Write JSON atomically (a reader never sees a half-written file)."""
    _atomic(Path(path), lambda f: f.write(json.dumps(obj, indent=indent, sort_keys=True).encode()))


def save_torch(path: str | Path, obj: Any) -> None:
    """``torch.save`` atomically: a kill during the write leaves the previous file intact."""
    _atomic(Path(path), lambda f: torch.save(obj, f))


def build_once(path: str | Path, build: Callable[[], Any]) -> bool:
    """Make the cached file ``path`` with ``build()`` (which writes it) unless it exists;
    whether it was there already. Concurrent callers for the same ``path`` (parallel runs
    of one stream, test workers) build it once: the first holds an exclusive lock on
    ``<path>.lock`` while it builds, the others wait on it and then find the file. The OS
    releases the lock of a process that dies. Without ``fcntl`` (Windows), no lock."""
    path = Path(path)
    if path.exists():
        return True
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        build()
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("fedlightning").info("waiting for another process: %s", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return True
        build()
    return False
