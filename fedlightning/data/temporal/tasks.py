"""Few-shot task supports (FedTIP Sec. 3.2, 5.1.1): who adapts on which events (the rule in
``docs/temporal.md``); deterministic in ``protocol.seed`` and the task number."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import SUP_POOL, Manifest
from fedlightning.data.temporal.ownership import Ownership
from fedlightning.utils.io import ContentHashed
from fedlightning.utils.seeding import derive_seed


@dataclass
class Task:
    """One task: its active clients and each one's support events (indices, time order)."""

    task: int
    support: dict[int, list[int]]

    @property
    def clients(self) -> list[int]:
        return sorted(self.support)

    @property
    def events(self) -> np.ndarray:
        return np.sort(
            np.concatenate([np.asarray(v, dtype=np.int64) for v in self.support.values()])
        )


@dataclass
class TaskSet(ContentHashed):
    tasks: list[Task]
    params: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "tasks": [
                {"task": t.task, "support": {str(k): v for k, v in sorted(t.support.items())}}
                for t in self.tasks
            ],
        }

    def stats(self, stream: EventStream) -> dict[str, float]:
        """Support sizes per client, positives per task, tasks and clients with both labels."""
        sizes = [len(v) for t in self.tasks for v in t.support.values()]
        out: dict[str, float] = {"min_per_client": min(sizes), "max_per_client": max(sizes)}
        if stream.label is not None:
            pos = [int(stream.label[t.events].sum()) for t in self.tasks]
            both = [len(set(stream.label[t.events].tolist())) == 2 for t in self.tasks]
            clients_both = [
                sum(len(set(stream.label[v].tolist())) == 2 for v in t.support.values())
                for t in self.tasks
            ]
            protos, single = prototype_counts(self.tasks, stream.label)
            out.update(
                mean_positives=float(np.mean(pos)),
                tasks_with_both_labels=int(sum(both)),
                mean_clients_with_both_labels=float(np.mean(clients_both)),
                local_prototypes=protos,
                single_event_prototypes=single,
            )
        return out


def prototype_counts(tasks: list[Task], label: np.ndarray) -> tuple[int, int]:
    """The local class prototypes (Eq. 18) the supports form, one per (task, client, state
    label) with at least one event, and how many of them average a single event (the
    highest-exposure case of FedTIP Sec. 3.5): ``(prototypes, single-event prototypes)``."""
    counts = [
        n
        for t in tasks
        for v in t.support.values()
        for n in np.bincount(label[np.asarray(v, dtype=np.int64)].astype(np.int64))
        if n > 0
    ]
    return len(counts), int(sum(n == 1 for n in counts))


def _allocate(rng: np.random.Generator, total: int, clients: list[int]) -> dict[int, int]:
    base, extra = divmod(total, len(clients))
    lucky = set(rng.choice(clients, size=extra, replace=False).tolist()) if extra else set()
    return {k: base + (k in lucky) for k in clients}


def build_tasks(
    stream: EventStream,
    manifest: Manifest,
    ownership: Ownership,
    num_tasks: int = 100,
    support: int = 30,
    active: int = 5,
    seed: int = 2026,
    force_positive: bool = True,
) -> TaskSet:
    """``num_tasks`` task supports from the supervised pool (module docstring)."""
    owner = ownership.of_events(stream)
    pool = manifest.indices(SUP_POOL)
    pools = {int(k): pool[owner[pool] == k] for k in np.unique(owner[pool])}
    eligible = sorted(k for k, v in pools.items() if len(v) >= max(1, support // active - 1))
    if len(eligible) < active:  # too few well-stocked clients: any client with events
        eligible = sorted(k for k, v in pools.items() if len(v))
    if len(eligible) < active:
        raise ValueError(
            f"protocol.tasks.active_clients={active}, but only {len(eligible)} clients own "
            "supervised-pool events"
        )
    if sum(len(v) for v in pools.values()) < support:
        raise ValueError(f"protocol.tasks.support={support} exceeds the supervised pool")
    labels = stream.label if force_positive else None
    positive_clients = [] if labels is None else [k for k in eligible if labels[pools[k]].any()]
    tasks = []
    for tau in range(num_tasks):
        rng = np.random.default_rng(derive_seed(seed, "task", tau))
        chosen = sorted(rng.choice(eligible, size=active, replace=False).tolist())
        forced = None
        if positive_clients:
            if not set(chosen) & set(positive_clients):
                chosen[int(rng.integers(active))] = int(rng.choice(positive_clients))
                chosen = sorted(set(chosen))
            holders = [k for k in chosen if k in positive_clients]
            k = int(rng.choice(holders))
            forced = (k, int(rng.choice(pools[k][labels[pools[k]] == 1])))
        want = _allocate(rng, support - (forced is not None), chosen)
        if forced:
            want[forced[0]] += 1
        picked: dict[int, list[int]] = {}
        short = 0
        for k in chosen:
            free = pools[k] if forced is None or forced[0] != k else pools[k][pools[k] != forced[1]]
            need = want[k] - (forced is not None and forced[0] == k)
            take = rng.choice(free, size=min(need, len(free)), replace=False)
            short += need - len(take)
            picked[k] = sorted(take.tolist() + ([forced[1]] if forced and forced[0] == k else []))
        for k in chosen:  # a client short of events gives its share to the others
            if short == 0:
                break
            spare = np.setdiff1d(pools[k], picked[k])
            extra = rng.choice(spare, size=min(short, len(spare)), replace=False).tolist()
            picked[k] = sorted(picked[k] + extra)
            short -= len(extra)
        if short:
            raise ValueError(
                f"task {tau}: its {active} active clients own fewer than protocol.tasks."
                f"support={support} supervised events; lower the support or the active clients"
            )
        tasks.append(Task(tau, picked))
    params = {
        "num_tasks": num_tasks,
        "support": support,
        "active": active,
        "seed": int(seed),
        "force_positive": force_positive,
        "manifest": manifest.hash,
        "ownership": ownership.hash,
    }
    return TaskSet(tasks, params)
