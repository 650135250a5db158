r"""Event contexts from the frozen bank (FedTIP Sec. 4.2, Eq. (12); methods.md, state
construction).

The bank's parameters stay frozen and only its memory streams. The server starts from the
bank snapshot (pre-training and pre-validation ingested) and goes through the downstream
validation and then the test segment in time order, in batches that never split a group of
equal timestamps: each batch is scored (source, destination and its materialized negative)
from the state before it, then ingested. The candidate window is never ingested by the
server. A client's states (Eq. (12)) add only its own preceding support events to the
snapshot: each client of each task streams its support the same way from its own copy.

None of this depends on an adapter, so the contexts of a (bank, protocol) pair are computed
once, saved, and read by every task and round. Like the bank's streaming, they are computed
on one thread and report their progress (:mod:`fedlightning.temporal.bank`).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import DOWN_VAL, TEST
from fedlightning.data.temporal.protocol import TemporalProtocol
from fedlightning.temporal.bank import (
    BankConfig,
    StageProgress,
    event_tensors,
    make_encoder,
    single_threaded,
)
from fedlightning.utils.io import content_hash, save_torch

log = logging.getLogger(__name__)

CONTEXT_VERSION = 2  # 2: recencies and times


def group_batches(t: np.ndarray, idx: np.ndarray, size: int) -> list[np.ndarray]:
    """Consecutive slices of ``idx`` (time order) of about ``size`` events that never split
    a group of equal timestamps."""
    out, start = [], 0
    while start < len(idx):
        end = min(start + size, len(idx))
        while end < len(idx) and t[idx[end]] == t[idx[end - 1]]:
            end += 1
        out.append(idx[start:end])
        start = end
    return out


def load_bank(path: str | Path, stream: EventStream):
    """The frozen encoder with the bank's streaming state, in evaluation mode."""
    saved = torch.load(path, weights_only=False)
    if saved["meta"]["stream"] != stream.fingerprint:
        raise ValueError(f"bank {path} was built on another stream")
    enc = make_encoder(stream, BankConfig(**saved["meta"]["config"]))
    for p in enc.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        enc.eval()  # TGN's memory flushes its (empty) message store here, before the state
    enc.load_state_dict(saved["weights"])
    loader = enc.state.loader
    loader.neighbors.copy_(saved["neighbors"])
    loader.e_id.copy_(saved["neighbor_e_id"])
    loader.cur_e_id = saved["cur_e_id"]
    enc.state.ids = saved["event_ids"].clone()
    enc.state.frequency.copy_(saved["frequency"])
    enc.state.last_time.copy_(saved["last_time"])
    if hasattr(enc, "memory"):
        enc.memory.msg_s_store = dict(saved["msg_s_store"])
        enc.memory.msg_d_store = dict(saved["msg_d_store"])
    return enc


@torch.no_grad()
def stream_contexts(
    enc,
    stream: EventStream,
    idx: np.ndarray,
    negatives: np.ndarray,
    batch_size: int = 200,
    progress: StageProgress | None = None,
) -> dict[str, Tensor]:
    r"""States of each event's source, destination and negative destination, and their
    recencies :math:`\Delta_v(t) = t - t_{last}(v)` (Eq. (13)), all read from the state
    before the event's timestamp group is ingested; a failed negative (``-1``) gets zeros.

    Returns ``events`` ``[n]``, ``t`` ``[n]`` (from the stream's start), ``src``, ``dst``,
    ``neg`` ``[n, d_h]`` and ``dt_src``, ``dt_dst``, ``dt_neg`` ``[n]``.
    """
    neg_of = dict(zip(idx.tolist(), negatives.tolist(), strict=True))
    parts: dict[str, list[Tensor]] = {
        k: [] for k in ("t", "src", "dst", "neg", "dt_src", "dt_dst", "dt_neg")
    }
    for b in group_batches(stream.t, idx, batch_size):
        src, dst, t, msg = event_tensors(enc, stream, b)
        j = torch.tensor([neg_of[e] for e in b.tolist()])
        failed = j < 0
        nodes = torch.cat([src, dst, j.clamp(min=0)])
        h = enc.embed(nodes, torch.cat([t, t, t]))
        dt = (torch.cat([t, t, t]).float() - enc.state.last_time[nodes]).clamp(min=0)
        for key, part in zip(("src", "dst", "neg"), h.split(len(b)), strict=True):
            parts[key].append(part.masked_fill(failed.unsqueeze(1), 0.0) if key == "neg" else part)
        for key, part in zip(("dt_src", "dt_dst", "dt_neg"), dt.split(len(b)), strict=True):
            parts[key].append(part.masked_fill(failed, 0.0) if key == "dt_neg" else part)
        parts["t"].append(t.float())
        enc.ingest(src, dst, t, msg, torch.from_numpy(b))
        if progress is not None:
            progress.update(len(b))
    out = {"events": torch.from_numpy(idx)}
    for key, xs in parts.items():
        empty = torch.zeros(0, enc.out_dim) if key in ("src", "dst", "neg") else torch.zeros(0)
        out[key] = torch.cat(xs) if xs else empty
    return out


def fork(enc):
    """An independent copy of an encoder's state that shares what streaming never mutates:
    the stream's event arrays and the TGN message-store entries (replaced, not changed)."""
    t, m = enc.state.event_t, enc.state.event_msg
    memory = getattr(enc, "memory", None)
    stores = (memory.msg_s_store, memory.msg_d_store) if memory is not None else None
    enc.state.event_t = enc.state.event_msg = None
    if memory is not None:
        memory.msg_s_store, memory.msg_d_store = {}, {}
    try:
        twin = copy.deepcopy(enc)
    finally:
        enc.state.attach(t, m)
        if memory is not None:
            memory.msg_s_store, memory.msg_d_store = stores
    twin.state.attach(t, m)
    if memory is not None:
        twin.memory.msg_s_store, twin.memory.msg_d_store = dict(stores[0]), dict(stores[1])
    return twin


@single_threaded
def compute_contexts(
    bank_path: str | Path,
    protocol: TemporalProtocol,
    batch_size: int = 200,
    train_mode: str | None = None,
) -> dict[str, Any]:
    """Server contexts of the validation and test segments, and every task client's support
    contexts (module docstring), with the supports' negatives of ``train_mode`` (default:
    the protocol's mode; ``"unfiltered"`` for the ablation)."""
    stream, manifest = protocol.stream, protocol.manifest
    snapshot = load_bank(bank_path, stream)
    neg = protocol.negatives
    mode = train_mode or neg["mode"]
    server = fork(snapshot)
    out: dict[str, Any] = {"mode": mode}
    segments = {
        name: manifest.indices(outcome)
        for name, outcome in (("down_val", DOWN_VAL), ("test", TEST))
    }
    supports = sum(len(events) for task in protocol.tasks.tasks for events in task.support.values())
    progress = StageProgress(
        f"contexts ({len(protocol.tasks.tasks)} tasks)",
        sum(len(idx) for idx in segments.values()) + supports,
        logger=log,
    )
    for name, idx in segments.items():
        out[name] = stream_contexts(
            server, stream, idx, np.array(neg["eval"][name]), batch_size, progress
        )
    tasks: dict[int, dict[int, dict[str, Tensor]]] = {}
    for task in protocol.tasks.tasks:
        negs = dict(zip(task.events.tolist(), neg["tasks"][mode][str(task.task)], strict=True))
        tasks[task.task] = {}
        for k, events in task.support.items():
            idx = np.asarray(events, dtype=np.int64)
            local = fork(snapshot)
            j = np.array([negs[e] for e in events])
            tasks[task.task][k] = stream_contexts(local, stream, idx, j, batch_size, progress)
    progress.close()
    out["tasks"] = tasks
    return out


def cached_contexts(
    bank_path: str | Path,
    bank_hash: str,
    protocol: TemporalProtocol,
    cache_dir: str | Path,
    train_mode: str | None = None,
) -> tuple[Path, str, bool]:
    """Compute the contexts once per (bank, protocol, training negatives); return their
    file, hash and whether they were reused."""
    mode = train_mode or protocol.negatives["mode"]
    key = content_hash(
        {"version": CONTEXT_VERSION, "bank": bank_hash, "train_mode": mode, **protocol.hashes}
    )
    path = Path(cache_dir) / "contexts" / f"{protocol.stream.name}-{key}.pt"
    if path.exists():
        return path, key, True
    save_torch(path, compute_contexts(bank_path, protocol, train_mode=mode))
    return path, key, False


@torch.no_grad()
def event_batch(
    ctx: dict[str, Tensor],
    stream: EventStream,
    te: torch.nn.Module,
    negatives: np.ndarray,
    inductive: np.ndarray | None = None,
) -> dict[str, Tensor]:
    r"""The adapter's inputs for the events of one context block (Eq. (13)).

    ``h_u``, ``h_i``, ``h_j``: the source's, destination's and negative's states;
    ``te``: :math:`\mathrm{TE}(t - t_{last}(u))` from the frozen bank; ``x``: the event
    features (width 0 when the stream has none, Bitcoin's label-encoding rating excluded);
    ``r_u``, ``r_i``, ``r_j``: recencies as :math:`\log(1 + \Delta)` (raw seconds would
    swamp the context); ``y``: state labels (``-1`` without); ``neg_ok``: a negative exists;
    ``inductive``: the test event touches an inductive node (all false when not given);
    ``events``, ``neg_id``: the stream indices of the events and their negatives.
    """
    idx = ctx["events"].numpy()
    n = len(idx)
    msg = stream.msg
    return {
        "h_u": ctx["src"],
        "h_i": ctx["dst"],
        "h_j": ctx["neg"],
        "te": te(ctx["dt_src"]).float(),
        "x": torch.from_numpy(msg[idx]) if msg is not None else torch.zeros(n, 0),
        "r_u": ctx["dt_src"].log1p(),
        "r_i": ctx["dt_dst"].log1p(),
        "r_j": ctx["dt_neg"].log1p(),
        "y": torch.from_numpy(stream.label[idx])
        if stream.label is not None
        else torch.full((n,), -1),
        "neg_ok": torch.from_numpy(np.asarray(negatives) >= 0),
        "events": torch.from_numpy(idx),
        "neg_id": torch.from_numpy(np.asarray(negatives, dtype=np.int64)),
        "inductive": torch.from_numpy(inductive[idx])
        if inductive is not None
        else torch.zeros(n, dtype=torch.bool),
    }


@torch.no_grad()
def restore_state(enc, snapshot) -> None:
    """Reset ``enc``'s streaming state (memory, neighbours, statistics) to ``snapshot``'s,
    keeping ``enc``'s own parameters (a fine-tuned encoder restarting from the bank)."""
    enc.detach()
    for buf, ref in zip(enc.buffers(), snapshot.buffers(), strict=True):
        buf.copy_(ref)
    mine, theirs = enc.state.loader, snapshot.state.loader
    mine.neighbors.copy_(theirs.neighbors)
    mine.e_id.copy_(theirs.e_id)
    mine.cur_e_id = theirs.cur_e_id
    enc.state.ids = snapshot.state.ids.clone()
    if hasattr(enc, "memory"):
        enc.memory.msg_s_store = dict(snapshot.memory.msg_s_store)
        enc.memory.msg_d_store = dict(snapshot.memory.msg_d_store)
