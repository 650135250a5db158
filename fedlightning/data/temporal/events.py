"""One typed stream of timestamped interactions: what every temporal loader returns."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class EventStream:
    """Interactions ``(src_n, dst_n, t_n, y_n, x_n)`` in chronological order (FedTIP Sec. 3):
    int64 ``src``, ``dst`` ``[E]`` among nodes ``0..num_nodes-1``; ``t`` int64 or float64
    ``[E]``, non-decreasing; optional int64 ``label`` ``[E]``, the source's 0/1 state at
    ``t``; optional float32 edge features ``msg`` ``[E, d]``. A ``bipartite`` stream has users
    as sources and items as destinations (``node_type`` ``0``/``1``; all zeros otherwise).
    ``source`` is the file read, ``node_names`` each node's original id (optional)."""

    name: str
    src: np.ndarray
    dst: np.ndarray
    t: np.ndarray
    num_nodes: int
    bipartite: bool
    node_type: np.ndarray
    label: np.ndarray | None = None
    msg: np.ndarray | None = None
    source: str = ""
    node_names: list[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        n = len(self.src)
        for key in ("dst", "t", "label"):
            v = getattr(self, key)
            if v is not None and len(v) != n:
                raise ValueError(f"EventStream.{key} has {len(v)} rows, src {n}")
        if self.msg is not None and (self.msg.ndim != 2 or len(self.msg) != n):
            raise ValueError(f"EventStream.msg must be [E, d] with E = {n}, got {self.msg.shape}")
        if n and np.any(np.diff(self.t) < 0):
            raise ValueError("EventStream timestamps must be non-decreasing")

    @property
    def num_events(self) -> int:
        return len(self.src)

    @property
    def has_labels(self) -> bool:
        """Whether the label column holds both 0 and 1; without, node classification can be
        neither trained nor scored, only link prediction."""
        return self.label is not None and np.unique(self.label).size > 1

    @property
    def users(self) -> np.ndarray:
        """The source-side node ids (sorted, distinct)."""
        return np.unique(self.src)

    @property
    def fingerprint(self) -> str:
        """Content hash of the events (ids, times, labels, features): the manifest's input."""
        h = hashlib.sha256(f"{self.name}|{self.num_nodes}|{self.bipartite}".encode())
        for part in (self.src, self.dst, self.t, self.label, self.msg):
            arr = np.zeros(0) if part is None else np.ascontiguousarray(part)
            h.update(str(arr.dtype).encode() + str(arr.shape).encode() + arr.tobytes())
        return h.hexdigest()[:16]

    def to_temporal_data(self):
        """The stream as PyG :class:`~torch_geometric.data.TemporalData`."""
        from torch_geometric.data import TemporalData

        kw = {}
        if self.msg is not None:
            kw["msg"] = torch.from_numpy(self.msg.astype(np.float32))
        if self.label is not None:
            kw["y"] = torch.from_numpy(self.label.astype(np.int64))
        return TemporalData(
            src=torch.from_numpy(self.src.astype(np.int64)),
            dst=torch.from_numpy(self.dst.astype(np.int64)),
            t=torch.from_numpy(self.t.astype(np.int64)),
            **kw,
        )

    def __repr__(self) -> str:
        kind = "bipartite" if self.bipartite else "one node type"
        extra = f", labels {int(self.label.sum())}+" if self.label is not None else ""
        feats = f", features {self.msg.shape[1]}" if self.msg is not None else ""
        return (
            f"EventStream({self.name}, events={self.num_events}, nodes={self.num_nodes}, "
            f"{kind}{extra}{feats})"
        )
