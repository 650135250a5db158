"""Unreliable clients (``protocol.noise``; docs/temporal.md, "Unreliable clients"): a seeded
fraction of the clients whose task supports carry flipped state labels, the setting that
tests FedTIP's reliability weighting (paper 001, Eqs. (27)-(30)) directly. Only the clients'
training supports are corrupted; validation and test labels never are."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.ownership import Ownership
from fedlightning.data.temporal.tasks import TaskSet
from fedlightning.utils.io import ContentHashed
from fedlightning.utils.seeding import derive_seed

KEYS = ("clients", "flip")


@dataclass
class LabelNoise(ContentHashed):
    """The unreliable ``clients`` and the support events (stream indices) whose state label
    they train on flipped, ``flipped``; both sorted."""

    clients: list[int]
    flipped: list[int]
    params: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"params": self.params, "clients": self.clients, "flipped": self.flipped}

    def labels(self, label: np.ndarray, events: np.ndarray) -> np.ndarray:
        """The state labels a client trains on for ``events``: ``label[events]``, flipped
        (``1 - y``) on the events of :attr:`flipped`."""
        y = label[events]
        return np.where(np.isin(events, self.flipped), 1 - y, y).astype(y.dtype)

    def stats(self, tasks: TaskSet) -> dict[str, Any]:
        """What a run records: the unreliable clients and the flipped share of their supports."""
        flipped = set(self.flipped)
        noisy = [
            e for t in tasks.tasks for k, v in t.support.items() if k in self.clients for e in v
        ]
        return {
            "unreliable_clients": self.clients,
            "flipped_events": len(self.flipped),
            "unreliable_support_events": len(noisy),  # counted once per task they serve in
            "flipped_support_events": sum(e in flipped for e in noisy),
        }


def noise_settings(noise: Mapping[str, Any] | None) -> dict[str, float] | None:
    """``protocol.noise`` checked: ``None`` when off (``clients`` and ``flip`` both 0, or no
    ``noise`` at all), else the two fractions; a ``ValueError`` naming the key otherwise."""
    noise = dict(noise or {})
    unknown = sorted(set(noise) - set(KEYS))
    if unknown:
        raise ValueError(f"protocol.noise takes {list(KEYS)}, got unknown key(s) {unknown}")
    out = {}
    for k in KEYS:
        v = noise.get(k, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"protocol.noise.{k} must be a number in [0, 1], got {v!r}")
        out[k] = float(v)
    return out if any(out.values()) else None


def draw_noise(
    stream: EventStream,
    ownership: Ownership,
    tasks: TaskSet,
    clients: float = 0.0,
    flip: float = 0.0,
    seed: int = 2026,
) -> LabelNoise:
    r"""The unreliable clients and their flipped support events, seeded by ``protocol.seed``:

    - the first :math:`\lfloor \texttt{clients}\cdot K + 1/2 \rfloor` clients of a seeded
      permutation of the :math:`K` clients are unreliable;
    - each event :math:`e` gets one seeded uniform :math:`u_e`; a support event (of any
      task) owned by an unreliable client is flipped iff :math:`u_e < \texttt{flip}`, so it
      is flipped in every task it serves in, and the flipped sets are nested in both
      fractions (a higher rate flips a superset: one draw across a sweep).

    A ``ValueError`` when the stream has no state labels 0/1 to flip."""
    if not stream.has_labels:
        raise ValueError(
            f"protocol.noise flips state labels, but {stream.name} has no state labels 0/1: "
            "set protocol.noise.clients=0 and protocol.noise.flip=0"
        )
    k = ownership.clients
    order = np.random.default_rng(derive_seed(seed, "noise", "clients")).permutation(k)
    unreliable = np.sort(order[: int(np.floor(clients * k + 0.5))])
    u = np.random.default_rng(derive_seed(seed, "noise", "flip")).random(stream.num_events)
    support = np.unique(np.concatenate([t.events for t in tasks.tasks] or [np.zeros(0, int)]))
    noisy = support[np.isin(ownership.of_events(stream)[support], unreliable)]
    params = {"clients": clients, "flip": flip, "seed": int(seed), "tasks": tasks.hash}
    return LabelNoise(unreliable.tolist(), noisy[u[noisy] < flip].tolist(), params)
