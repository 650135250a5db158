"""The chronological manifest of FedTIP (Sec. 3.1, 5.1.1): six outcomes, one per event, and
the inductive flags (boundaries and rules in ``docs/temporal.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlightning.data.temporal.events import EventStream
from fedlightning.utils.io import content_hash
from fedlightning.utils.seeding import derive_seed

OUTCOMES = ("pretrain", "preval", "sup_pool", "nn_excl", "down_val", "test")
PRETRAIN, PREVAL, SUP_POOL, NN_EXCL, DOWN_VAL, TEST = range(6)


def snap(t: np.ndarray, b: int) -> int:
    """Move boundary ``b`` forward past the events that share ``t[b - 1]``."""
    n = len(t)
    if 0 < b < n and t[b] == t[b - 1]:
        return int(np.searchsorted(t, t[b - 1], side="right"))
    return b


def boundaries(
    t: np.ndarray,
    pre: float = 0.7,
    pre_val: float = 0.1,
    candidate: float = 0.1,
    down_val: float = 0.1,
) -> list[int]:
    """The four segment ends ``[b_pre, b_pv, b_cand, b_val]`` (then test up to ``N``)."""
    n = len(t)
    b_pre = snap(t, round(pre * n))
    b_pv = max(b_pre, snap(t, round((pre + pre_val) * n)))
    rest = n - b_pv
    b_cand = max(b_pv, snap(t, b_pv + round(candidate * rest)))
    b_val = max(b_cand, snap(t, b_cand + round(down_val * rest)))
    return [b_pre, b_pv, b_cand, b_val]


def inductive_nodes(stream: EventStream, segment: slice, fraction: float, seed: int) -> np.ndarray:
    """A seeded ``fraction`` of the distinct nodes seen in ``segment``, per node type."""
    seen = np.unique(np.concatenate([stream.src[segment], stream.dst[segment]]))
    picked = []
    for kind in np.unique(stream.node_type[seen]):
        pool = seen[stream.node_type[seen] == kind]
        k = round(fraction * len(pool))
        rng = np.random.default_rng(derive_seed(seed, "inductive", int(kind)))
        picked.append(np.sort(rng.choice(pool, size=k, replace=False)))
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)


@dataclass
class Manifest:
    """Every event's outcome (``OUTCOMES``), the inductive flags, and how they were made.

    Attributes:
        outcome: int8 ``[E]`` index into ``OUTCOMES``.
        inductive: bool ``[E]``: test events that touch an inductive node.
        inductive_nodes: the sampled inductive node ids.
        bounds: the segment ends ``[b_pre, b_pv, b_cand, b_val]``.
        params: fractions, ``inductive_fraction``, ``seed`` and the stream fingerprint."""

    outcome: np.ndarray
    inductive: np.ndarray
    inductive_nodes: np.ndarray
    bounds: list[int]
    params: dict[str, Any]

    def counts(self) -> dict[str, int]:
        out = {name: int((self.outcome == i).sum()) for i, name in enumerate(OUTCOMES)}
        out["ind_test"] = int(self.inductive.sum())
        return out

    def indices(self, outcome: int) -> np.ndarray:
        return np.flatnonzero(self.outcome == outcome)

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "bounds": self.bounds,
            "counts": self.counts(),
            "inductive_nodes": self.inductive_nodes.tolist(),
            "outcome": self.outcome.tolist(),
            "inductive": np.flatnonzero(self.inductive).tolist(),
        }

    @property
    def hash(self) -> str:
        body = self.to_json()
        body.pop("counts")
        return content_hash(body)


def build_manifest(
    stream: EventStream,
    seed: int = 2026,
    pre: float = 0.7,
    pre_val: float = 0.1,
    candidate: float = 0.1,
    down_val: float = 0.1,
    inductive_fraction: float = 0.1,
) -> Manifest:
    """The manifest of ``stream`` (module docstring); deterministic in its arguments."""
    fractions = {"pre": pre, "pre_val": pre_val, "candidate": candidate, "down_val": down_val}
    for key, v in fractions.items():
        if not 0 < v < 1:
            raise ValueError(f"protocol.manifest.{key} must lie in (0, 1), got {v}")
    if pre + pre_val >= 1 or candidate + down_val >= 1:
        raise ValueError("protocol.manifest: pre + pre_val and candidate + down_val must be < 1")
    if not 0 <= inductive_fraction < 1:
        raise ValueError(
            f"protocol.manifest.inductive_fraction must lie in [0, 1), got {inductive_fraction}"
        )
    n = stream.num_events
    b_pre, b_pv, b_cand, b_val = bounds = boundaries(stream.t, pre, pre_val, candidate, down_val)
    outcome = np.full(n, TEST, dtype=np.int8)
    outcome[:b_pre], outcome[b_pre:b_pv] = PRETRAIN, PREVAL
    outcome[b_pv:b_cand], outcome[b_cand:b_val] = SUP_POOL, DOWN_VAL
    nodes = inductive_nodes(stream, slice(b_cand, n), inductive_fraction, seed)
    touches = np.isin(stream.src, nodes) | np.isin(stream.dst, nodes)
    cand = np.zeros(n, dtype=bool)
    cand[b_pv:b_cand] = True
    outcome[cand & touches] = NN_EXCL
    inductive = (outcome == TEST) & touches
    params = {
        "stream": stream.fingerprint,
        "seed": int(seed),
        **fractions,
        "inductive_fraction": inductive_fraction,
    }
    return Manifest(outcome, inductive, nodes, [int(b) for b in bounds], params)


def manifest_table(stream: EventStream, manifest: Manifest) -> dict[str, Any]:
    """One row of the paper's Table 1: raw statistics and the manifest counts; ``labels``
    is ``"0/1"`` (:attr:`EventStream.has_labels`), ``"none"`` without a label column or
    ``"none (all 0)"`` for a constant one (``docs/temporal.md``)."""
    users = int((stream.node_type == 0).sum()) if stream.bipartite else stream.num_nodes
    items = int((stream.node_type == 1).sum()) if stream.bipartite else stream.num_nodes
    pos = int(stream.label.sum()) if stream.label is not None else None
    if stream.label is None:
        labels = "none"
    else:
        labels = "0/1" if stream.has_labels else f"none (all {int(stream.label[0])})"
    c = manifest.counts()
    return {
        "dataset": stream.name,
        "events": stream.num_events,
        "users": users,
        "items": items,
        "feat_dim": int(stream.msg.shape[1]) if stream.msg is not None else 0,
        "labels": labels,
        "classes": int(np.unique(stream.label).size) if stream.label is not None else 0,
        "pos_labels": pos,
        "pos_rate": pos / stream.num_events if pos is not None else None,
        "pre_train": c["pretrain"],
        "pre_val": c["preval"],
        "sup_pool": c["sup_pool"],
        "down_val": c["down_val"],
        "test": c["test"],
        "nn_excl": c["nn_excl"],
        "ind_test": c["ind_test"],
    }
