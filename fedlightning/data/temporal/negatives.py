"""Stage-valid negative destinations and their collision checks (FedTIP Sec. 3, 5.1.2; the
rules of ``same_time``, ``strict`` and the supports' ``unfiltered`` in ``docs/temporal.md``).
Draws are deterministic per seed, mode, set (a task, or an evaluation segment) and event."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import PRETRAIN, Manifest
from fedlightning.utils.seeding import derive_seed

MODES = ("same_time", "strict")
TASK_MODES = (*MODES, "unfiltered")
TRIES = 64


class NegativeSampler:
    """The stage-valid rule over one stream and manifest (module docstring)."""

    def __init__(self, stream: EventStream, manifest: Manifest) -> None:
        self.stream = stream
        self.pool = np.unique(stream.dst[manifest.indices(PRETRAIN)])
        self.same_time: dict[tuple[int, Any], set[int]] = defaultdict(set)
        self.first: dict[tuple[int, int], Any] = {}
        for u, j, t in zip(
            stream.src.tolist(), stream.dst.tolist(), stream.t.tolist(), strict=True
        ):
            self.same_time[(u, t)].add(j)
            self.first.setdefault((u, j), t)

    def valid(self, e: int, j: int, mode: str) -> bool:
        if mode == "unfiltered":
            return j != int(self.stream.dst[e])
        u, t = int(self.stream.src[e]), self.stream.t[e].item()
        if j in self.same_time[(u, t)]:  # includes the positive destination itself
            return False
        return mode != "strict" or not self.first.get((u, j), t) < t

    def sample(self, e: int, mode: str, *keys: Any) -> int:
        """The negative destination of event ``e`` (``-1`` when none is valid)."""
        rng = np.random.default_rng(derive_seed(*keys, mode, e))
        for j in rng.choice(self.pool, size=min(TRIES, len(self.pool))).tolist():
            if self.valid(e, j, mode):
                return int(j)
        for j in rng.permutation(self.pool).tolist():
            if self.valid(e, j, mode):
                return int(j)
        return -1

    def check(self, events: np.ndarray, negatives: np.ndarray) -> dict[str, int]:
        """Collision counts of a materialized set (all zero when the rule held)."""
        out = {"events": len(events), "positive": 0, "same_time": 0, "historical": 0, "failures": 0}
        for e, j in zip(events.tolist(), negatives.tolist(), strict=True):
            if j < 0:
                out["failures"] += 1
                continue
            u, i, t = int(self.stream.src[e]), int(self.stream.dst[e]), self.stream.t[e].item()
            out["positive"] += j == i
            out["same_time"] += j != i and j in self.same_time[(u, t)]
            out["historical"] += self.first.get((u, j), t) < t
        return out


def materialize_negatives(
    stream: EventStream,
    manifest: Manifest,
    task_events: dict[int, np.ndarray],
    eval_sets: dict[str, np.ndarray],
    seed: int = 2026,
    mode: str = "same_time",
) -> dict[str, Any]:
    """Negatives of every task support in every mode of ``TASK_MODES``, and of the evaluation segments in
    ``mode``, with the collision check of each set."""
    if mode not in MODES:
        raise ValueError(f"protocol.negatives.mode must be one of {MODES}, got {mode!r}")
    sampler = NegativeSampler(stream, manifest)
    out: dict[str, Any] = {"mode": mode, "pool": len(sampler.pool), "tasks": {}, "eval": {}}
    checks: dict[str, dict[str, int]] = {}
    for m in TASK_MODES:
        per_task, total = {}, defaultdict(int)
        for tau, events in task_events.items():
            neg = np.array(
                [sampler.sample(e, m, seed, "neg", "task", tau) for e in events.tolist()]
            )
            per_task[str(tau)] = neg.tolist()
            for k, v in sampler.check(events, neg).items():
                total[k] += v
        out["tasks"][m] = per_task
        checks[f"support_{m}"] = dict(total)
    for name, events in eval_sets.items():
        neg = np.array([sampler.sample(e, mode, seed, "neg", name) for e in events.tolist()])
        out["eval"][name] = neg.tolist()
        checks[f"{name}_{mode}"] = sampler.check(events, neg)
    out["checks"] = checks
    return out
