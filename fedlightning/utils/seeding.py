"""Seeds derived from keys, so every random draw is addressable and runner-independent."""

from __future__ import annotations

import random
import zlib
from typing import Any

import numpy as np
import torch


def _key_int(key: Any) -> int:
    if isinstance(key, (int, np.integer)):
        if key < 0:
            raise ValueError(f"seed keys must be non-negative, got {key}")
        return int(key)
    return zlib.crc32(str(key).encode())


def derive_seed(*keys: Any) -> int:
    """A 63-bit seed determined by ``keys`` (ints or strings), e.g. ``(seed, round, client)``:
    the same in any process, runner and order, so runs resume and runners agree."""
    ss = np.random.SeedSequence([_key_int(k) for k in keys])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def torch_generator(*keys: Any) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed`."""
    return torch.Generator().manual_seed(derive_seed(*keys))


def manual_seed(seed: int) -> None:
    """``torch.manual_seed(seed)`` for the generators a run can draw from: on a machine
    without CUDA only the CPU generator, whose state is the same, without the CUDA seed
    ``torch.manual_seed`` queues at a cost on every call (docs/architecture.md)."""
    if torch.cuda.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch global generators (for code we do not control).
    Not Lightning's ``seed_everything``: it refuses seeds above ``2**32 - 1``, and
    :func:`derive_seed` gives 63-bit ones, which torch takes whole."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """The global generators' states, for a checkpoint."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
