"""The snapshot view of the bank's history for Feddy, STFL and FedDGL (docs/fedtip.md): ``W``
equal windows re-streamed by the frozen encoder; per window every node's state, degree and
neighbour-mean state; each node's ``L`` most recent neighbours; hashed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import PRETRAIN, PREVAL, Manifest
from fedlightning.temporal.bank import event_tensors, streaming_threads
from fedlightning.temporal.contexts import fork, group_batches

EMBED_CHUNK = 4096  # nodes embedded at once at a window's end


def history_events(manifest: Manifest) -> np.ndarray:
    """The events the bank ingested: ``pretrain`` and ``preval``, in time order."""
    return np.flatnonzero((manifest.outcome == PRETRAIN) | (manifest.outcome == PREVAL))


def neighbour_means(src: np.ndarray, dst: np.ndarray, states: Tensor) -> tuple[Tensor, Tensor]:
    """One window's neighbour-mean states [N, d] and degrees [N] (undirected)."""
    a = torch.from_numpy(np.concatenate([src, dst]))
    b = torch.from_numpy(np.concatenate([dst, src]))
    deg = torch.zeros(states.size(0)).index_add_(0, a, torch.ones(len(a)))
    sums = torch.zeros_like(states).index_add_(0, a, states[b])
    return sums / deg.clamp(min=1).unsqueeze(1), deg


def recent_neighbours(src: np.ndarray, dst: np.ndarray, num_nodes: int, size: int) -> Tensor:
    """[N, size]: each node's most recent distinct neighbours, newest first, ``-1`` padded."""
    out = np.full((num_nodes, size), -1, dtype=np.int64)
    fill = np.zeros(num_nodes, dtype=np.int64)
    order_a = np.stack([src, dst], 1)[::-1].reshape(-1)  # newest event first, src then dst side
    order_b = np.stack([dst, src], 1)[::-1].reshape(-1)
    for a, b in zip(order_a.tolist(), order_b.tolist(), strict=True):
        k = fill[a]
        if k < size and b not in out[a, :k]:
            out[a, k] = b
            fill[a] = k + 1
    return torch.from_numpy(out)


@dataclass
class SnapshotView:
    """``states``, ``means`` [W, N, d], ``degree`` [W, N], ``recent`` [N, L], window ``bounds``."""

    states: Tensor
    means: Tensor
    degree: Tensor
    recent: Tensor
    bounds: list[tuple[int, int]]

    @property
    def windows(self) -> int:
        return self.states.size(0)

    @property
    def hash(self) -> str:
        h = hashlib.sha256(repr(self.bounds).encode())
        for t in (self.states, self.means, self.degree, self.recent):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


@streaming_threads()
@torch.no_grad()
def snapshot_view(
    snapshot, stream: EventStream, manifest: Manifest, windows: int = 10, recent: int = 5,
    batch_size: int = 200,
) -> SnapshotView:  # fmt: skip
    """The view, re-streamed by a reset fork of ``snapshot`` (the bank is not changed)."""
    idx = history_events(manifest)
    if windows < 2 or len(idx) < windows:
        raise ValueError(f"snapshot_view needs 2 <= windows <= {len(idx)} history events")
    enc = fork(snapshot)
    enc.reset_state()
    nodes = torch.arange(stream.num_nodes)
    states, means, degree, bounds = [], [], [], []
    for part in np.array_split(np.arange(len(idx)), windows):
        ev = idx[part]
        for b in group_batches(stream.t, ev, batch_size):
            src, dst, t, msg = event_tensors(enc, stream, b)
            enc.ingest(src, dst, t, msg, torch.from_numpy(b))
        t_end = torch.full((stream.num_nodes,), int(enc.state.event_t[ev[-1]]))
        s = torch.cat([enc.embed(n, t_end[: len(n)]) for n in nodes.split(EMBED_CHUNK)]).float()
        m, d = neighbour_means(stream.src[ev], stream.dst[ev], s)
        states.append(s)
        means.append(m)
        degree.append(d)
        bounds.append((int(part[0]), int(part[-1]) + 1))
    near = recent_neighbours(stream.src[idx], stream.dst[idx], stream.num_nodes, recent)
    return SnapshotView(torch.stack(states), torch.stack(means), torch.stack(degree), near, bounds)
