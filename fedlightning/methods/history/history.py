"""The graph view of the pre-training history (paper 001, Sec. 5.1.2): the stream's nodes, one
edge per event of ``segments``, node features the frozen bank states at the snapshot's end
(``bank``) or degree and mean edge features (``raw``); cached and hashed like every protocol
object (a resume refuses a changed one)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning.data.temporal.manifest import OUTCOMES
from fedlightning.utils.io import content_hash, save_torch

HISTORY_VERSION = 1
FEATURES = ("bank", "raw")
SEGMENTS = ("pretrain", "preval")  # the segments a history may take its edges from
EMBED_BATCH = 2048  # nodes embedded at once


def tensor_digest(*tensors: Tensor | np.ndarray) -> str:
    """sha256 (16 hex) of the dtypes, shapes and bytes of ``tensors``, in order."""
    h = hashlib.sha256()
    for v in tensors:
        a = v.detach().cpu().numpy() if isinstance(v, Tensor) else np.asarray(v)
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode() + a.tobytes())
    return h.hexdigest()[:16]


def encoder_digest(enc: torch.nn.Module) -> str:
    """The digest of a bank encoder's weights and streaming buffers (memory, statistics)."""
    state = enc.state_dict()
    return tensor_digest(*(state[k] for k in sorted(state)))


@dataclass
class HistoryGraph:
    """The history graph: node ids by side, each event's ``edge_index`` [2, E], time ``t``
    (from the stream's start) and stream index, node features ``x`` and ``params``."""

    users: np.ndarray
    items: np.ndarray
    edge_index: Tensor
    t: Tensor
    events: Tensor
    x: Tensor
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return int(self.x.size(0))

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.size(1))

    @property
    def hash(self) -> str:
        """Content hash of every array and the parameters."""
        arrays = (self.users, self.items, self.edge_index, self.t, self.events, self.x)
        return content_hash({"params": self.params, "arrays": tensor_digest(*arrays)})

    def degree(self) -> Tensor:
        """Undirected degree ``[N]`` (an event counts once for each endpoint)."""
        ei = self.edge_index
        return torch.bincount(torch.cat([ei[0], ei[1]]), minlength=self.num_nodes)

    def edges_of(self, nodes: np.ndarray | Tensor) -> Tensor:
        """Positions of the events whose source is in ``nodes`` (a client's users)."""
        keep = torch.isin(self.edge_index[0], torch.as_tensor(np.asarray(nodes), dtype=torch.long))
        return torch.nonzero(keep).flatten()

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": HISTORY_VERSION,
            "hash": self.hash,
            "users": torch.from_numpy(self.users),
            "items": torch.from_numpy(self.items),
            "edge_index": self.edge_index,
            "t": self.t,
            "events": self.events,
            "x": self.x,
            "params": self.params,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HistoryGraph:
        return cls(
            d["users"].numpy(), d["items"].numpy(), d["edge_index"], d["t"], d["events"],
            d["x"], d["params"],
        )  # fmt: skip


def history_events(manifest: Any, segments: tuple[str, ...] = ("pretrain",)) -> np.ndarray:
    """Stream indices of the events of ``segments`` (a subset of :data:`SEGMENTS`), in order."""
    bad = [s for s in segments if s not in SEGMENTS]
    if not segments or bad:
        raise ValueError(
            f"history segments must be a non-empty subset of {SEGMENTS}, got {segments}"
        )
    codes = [OUTCOMES.index(s) for s in segments]
    return np.flatnonzero(np.isin(manifest.outcome, codes))


@torch.no_grad()
def bank_features(enc: torch.nn.Module, stream: Any, t_ref: float) -> Tensor:
    """Every node's state [N, d_h] from the frozen snapshot ``enc`` at ``t_ref``."""
    was = enc.training
    enc.eval()
    out = []
    for start in range(0, stream.num_nodes, EMBED_BATCH):
        n_id = torch.arange(start, min(start + EMBED_BATCH, stream.num_nodes))
        out.append(enc.embed(n_id, torch.full((len(n_id),), int(t_ref), dtype=torch.long)))
    enc.train(was)
    return torch.cat(out).float()


def raw_features(stream: Any, events: np.ndarray) -> Tensor:
    """``[log(1 + degree) | mean edge feature]`` [N, 1 + d_e] of each node over ``events``."""
    n = stream.num_nodes
    ends = np.concatenate([stream.src[events], stream.dst[events]])
    deg = np.bincount(ends, minlength=n).astype(np.float64)
    cols = [np.log1p(deg)[:, None]]
    if stream.msg is not None and stream.msg.shape[1] > 0:
        msg = np.concatenate([stream.msg[events], stream.msg[events]]).astype(np.float64)
        total = np.zeros((n, msg.shape[1]))
        np.add.at(total, ends, msg)
        cols.append(total / np.maximum(deg, 1)[:, None])
    return torch.from_numpy(np.concatenate(cols, 1)).float()


def build_history(
    protocol: Any,
    snapshot: torch.nn.Module | None,
    segments: tuple[str, ...] = ("pretrain",),
    features: str = "bank",
) -> HistoryGraph:
    """The history graph of ``protocol`` (``snapshot``: the bank's encoder, for ``bank``)."""
    if features not in FEATURES:
        raise ValueError(f"history features must be one of {FEATURES}, got {features!r}")
    stream, manifest = protocol.stream, protocol.manifest
    events = history_events(manifest, tuple(segments))
    edge_index = torch.from_numpy(
        np.stack([stream.src[events], stream.dst[events]]).astype(np.int64)
    )
    t = torch.from_numpy((stream.t[events] - stream.t[0]).astype(np.float64))
    if features == "bank":
        if snapshot is None:
            raise ValueError("history features='bank' needs the bank's snapshot encoder")
        b_pv = manifest.bounds[1]  # the snapshot holds pre-training and pre-validation
        x = bank_features(snapshot, stream, float(stream.t[b_pv - 1] - stream.t[0]))
    else:
        x = raw_features(stream, events)
    users = np.flatnonzero(stream.node_type == 0).astype(np.int64)
    items = np.flatnonzero(stream.node_type == 1).astype(np.int64)
    params = {
        "version": HISTORY_VERSION,
        "segments": list(segments),
        "features": features,
        "stream": stream.fingerprint,
        "protocol": protocol.event_hashes,
        "bank": encoder_digest(snapshot) if features == "bank" else None,
    }
    return HistoryGraph(users, items, edge_index, t, torch.from_numpy(events), x, params)


def cached_history(
    protocol: Any,
    snapshot: torch.nn.Module | None,
    cache_dir: str | Path | None,
    segments: tuple[str, ...] = ("pretrain",),
    features: str = "bank",
) -> tuple[HistoryGraph, Path | None, bool]:
    """``(graph, path, reused)``: the history graph, cached under ``cache_dir/history/``
    (rebuilt when the file no longer matches its hash)."""
    if cache_dir is None:
        return build_history(protocol, snapshot, segments, features), None, False
    key = content_hash(
        {
            "version": HISTORY_VERSION,
            "protocol": protocol.event_hashes,
            "bank": encoder_digest(snapshot) if features == "bank" else None,
            "segments": list(segments),
            "features": features,
        }
    )
    path = Path(cache_dir) / "history" / f"{protocol.stream.name}-{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=False)
        graph = HistoryGraph.from_dict(saved)
        if saved.get("version") == HISTORY_VERSION and graph.hash == saved.get("hash"):
            return graph, path, True
    graph = build_history(protocol, snapshot, segments, features)
    save_torch(path, graph.to_dict())
    return graph, path, False
