r"""Event contexts from the frozen bank (FedTIP Sec. 4.2, Eq. (12); docs/readings.md, "States";
docs/temporal.md, "Event contexts"): the server's validation and test segments
and each task client's support, streamed from the bank snapshot, computed once per (bank,
protocol) on one thread."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import DOWN_VAL, TEST
from fedlightning.data.temporal.protocol import TemporalProtocol
from fedlightning.temporal.bank import (
    MSG_STORES,
    BankConfig,
    StageProgress,
    event_tensors,
    make_encoder,
    streaming_threads,
    unpack_store,
)
from fedlightning.utils.io import build_once, content_hash, save_torch

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


def set_stream_state(enc, neighbors: Tensor, e_id: Tensor, cur_e_id: int, ids: Tensor, stores):
    """Set ``enc``'s neighbour store, event ids and TGN message stores (``stores``, a
    mapping with :data:`~fedlightning.temporal.bank.MSG_STORES`, is read only with memory)."""
    loader = enc.state.loader
    loader.neighbors.copy_(neighbors)
    loader.e_id.copy_(e_id)
    loader.cur_e_id = cur_e_id
    enc.state.ids = ids.clone()
    if hasattr(enc, "memory"):
        for store in MSG_STORES:
            setattr(enc.memory, store, dict(stores[store]))


_BANK_FILES: dict[tuple[str, int, int], dict[str, Any]] = {}  # the last bank file read


def read_bank(path: str | Path) -> dict[str, Any]:
    """The bank file's contents, unpickled once per process and file version (path,
    modification time, size): a run reads the bank for its hash, its size
    (:func:`bank_size`) and its encoder, and each unpickling of its ~10^5 tensors took
    2-8 s. Readers copy what they keep (:func:`load_bank`); nothing may modify it."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_mtime_ns, st.st_size)
    if key not in _BANK_FILES:
        _BANK_FILES.clear()  # one bank at a time: the previous file is released
        _BANK_FILES[key] = torch.load(p, weights_only=False)
    return _BANK_FILES[key]


def bank_size(path: str | Path) -> int:
    r"""Values of the bank :math:`|\mathcal{B}_0|` (Eq. 11) a client is provisioned with
    (:func:`fedlightning.temporal.bank.bank_values`, from :func:`read_bank`)."""
    return tensor_values(
        {k: v for k, v in read_bank(path).items() if k not in ("meta", "hash", "version")}
    )


def tensor_values(tree: Any) -> int:
    """Values of every tensor in a nest of dicts, lists and tuples."""
    return sum(x.numel() for x in tree_leaves(tree) if isinstance(x, Tensor))


def load_bank(path: str | Path, stream: EventStream):
    """The frozen encoder with the bank's streaming state, in evaluation mode."""
    saved = read_bank(path)
    if saved["meta"]["stream"] != stream.fingerprint:
        raise ValueError(f"bank {path} was built on another stream")
    enc = make_encoder(stream, BankConfig(**saved["meta"]["config"]))
    for p in enc.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        enc.eval()  # TGN's memory flushes its (empty) message store here, before the state
    enc.load_state_dict(saved["weights"])  # buffers: TGN's memory, frequency, last time
    loader_state = ("neighbors", "neighbor_e_id", "cur_e_id", "event_ids")
    stores = {}
    if hasattr(enc, "memory"):  # packed columns (a bank of this version) or a dict (older)
        n = enc.memory.num_nodes
        stores = {
            s: unpack_store(saved[s], n) if isinstance(saved[s], tuple) else saved[s]
            for s in MSG_STORES
        }
    set_stream_state(enc, *(saved[k] for k in loader_state), stores)
    return enc


def pre_event_states(enc, src: Tensor, dst: Tensor, t: Tensor, j: Tensor) -> tuple[Tensor, Tensor]:
    """States ``[3n, d_h]`` of the sources, destinations and negatives ``j`` (stacked in
    that order) from ``enc``'s current state, and their recencies ``t - t_last`` ``[3n]``."""
    nodes, times = torch.cat([src, dst, j]), torch.cat([t, t, t])
    h = enc.embed(nodes, times)
    return h, (times.float() - enc.state.last_time[nodes]).clamp(min=0)


@torch.no_grad()
def stream_contexts(
    enc,
    stream: EventStream,
    idx: np.ndarray,
    negatives: np.ndarray,
    batch_size: int = 200,
    progress: StageProgress | None = None,
) -> dict[str, Tensor]:
    r"""States ``src``, ``dst``, ``neg`` ``[n, d_h]`` of each event's source, destination and
    negative and their recencies ``dt_*`` ``[n]``, :math:`\Delta_v(t) = t - t_{last}(v)`
    (Eq. (13)), read before the event's timestamp group is ingested (zeros for a failed
    negative, ``-1``); with ``events`` and ``t`` ``[n]`` (from the stream's start)."""
    neg_of = dict(zip(idx.tolist(), negatives.tolist(), strict=True))
    keys = ("t", "src", "dst", "neg", "dt_src", "dt_dst", "dt_neg")
    rows: list[tuple[Tensor, ...]] = []
    for b in group_batches(stream.t, idx, batch_size):
        src, dst, t, msg = event_tensors(enc, stream, b)
        j = torch.tensor([neg_of[e] for e in b.tolist()])
        failed = j < 0
        h, dt = pre_event_states(enc, src, dst, t, j.clamp(min=0))
        (h_u, h_i, h_j), (dt_u, dt_i, dt_j) = h.split(len(b)), dt.split(len(b))
        h_j, dt_j = h_j.masked_fill(failed.unsqueeze(1), 0.0), dt_j.masked_fill(failed, 0.0)
        rows.append((t.float(), h_u, h_i, h_j, dt_u, dt_i, dt_j))
        enc.ingest(src, dst, t, msg, torch.from_numpy(b))
        if progress is not None:
            progress.update(len(b))
    if not rows:  # no event: empty columns
        rows = [(torch.zeros(0), *[torch.zeros(0, enc.out_dim)] * 3, *[torch.zeros(0)] * 3)]
    cols = (torch.cat(xs) for xs in zip(*rows, strict=True))
    return {"events": torch.from_numpy(idx), **dict(zip(keys, cols, strict=True))}


def fork(enc):
    """An independent copy of an encoder's state that shares what streaming never mutates:
    the stream's event arrays and the TGN message-store entries (immutable tuples of tensors,
    replaced, not changed): each store is a dict of its own holding the same entries, where a
    deep copy was most of the cold contexts' time."""
    shared: list[Any] = [enc.state.event_t, enc.state.event_msg]
    stores = {s: getattr(enc.memory, s) for s in MSG_STORES} if hasattr(enc, "memory") else {}
    twin = copy.deepcopy(enc, {id(x): x for x in [*shared, *stores.values()]})
    for name, store in stores.items():
        setattr(twin.memory, name, dict(store))
    return twin


@streaming_threads()
def compute_contexts(
    bank_path: str | Path,
    protocol: TemporalProtocol,
    batch_size: int = 200,
    train_mode: str | None = None,
    max_tasks: int | None = None,
) -> dict[str, Any]:
    """Server contexts of the validation and test segments, and every task client's support
    contexts (module docstring; the first ``max_tasks`` tasks only, when given), with the
    supports' negatives of ``train_mode`` (default: the protocol's mode; ``"unfiltered"``
    for the ablation)."""
    stream, manifest = protocol.stream, protocol.manifest
    snapshot = load_bank(bank_path, stream)
    neg = protocol.negatives
    mode = train_mode or neg["mode"]
    server = fork(snapshot)
    out: dict[str, Any] = {"mode": mode}
    segments = {"down_val": manifest.indices(DOWN_VAL), "test": manifest.indices(TEST)}
    todo = protocol.tasks.tasks[:max_tasks]
    supports = sum(len(events) for task in todo for events in task.support.values())
    progress = StageProgress(
        f"contexts ({len(todo)} tasks)",
        sum(len(idx) for idx in segments.values()) + supports,
        logger=log,
    )
    for name, idx in segments.items():
        out[name] = stream_contexts(
            server, stream, idx, np.array(neg["eval"][name]), batch_size, progress
        )
    tasks: dict[int, dict[int, dict[str, Tensor]]] = {}
    for task in todo:
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
    max_tasks: int | None = None,
) -> tuple[Path, str, bool]:
    """The contexts' file, hash and whether they were reused: computed once per (bank,
    protocol, training negatives). With ``max_tasks`` (a run of the first tasks only) the
    contexts of every task are reused when cached, else only those tasks' are computed
    (bitwise the same either way; the hash is the whole protocol's)."""
    mode = train_mode or protocol.negatives["mode"]
    key = content_hash(
        {"version": CONTEXT_VERSION, "bank": bank_hash, "train_mode": mode, **protocol.event_hashes}
    )
    folder = Path(cache_dir) / "contexts"
    path = folder / f"{protocol.stream.name}-{key}.pt"
    if max_tasks is not None and max_tasks < len(protocol.tasks.tasks) and not path.exists():
        path = folder / f"{protocol.stream.name}-{key}-first{max_tasks}.pt"
    else:
        max_tasks = None
    reused = build_once(
        path,
        lambda: save_torch(
            path, compute_contexts(bank_path, protocol, train_mode=mode, max_tasks=max_tasks)
        ),
    )
    return path, key, reused


@torch.no_grad()
def event_batch(
    ctx: dict[str, Tensor],
    stream: EventStream,
    te: torch.nn.Module,
    negatives: np.ndarray,
    inductive: np.ndarray | None = None,
) -> dict[str, Tensor]:
    r"""The adapter's inputs for the events of one context block (Eq. (13)): states
    ``h_u``, ``h_i``, ``h_j``; ``te`` :math:`\mathrm{TE}(t - t_{last}(u))`; event features
    ``x`` (width 0 without); recencies ``r_*`` as :math:`\log(1 + \Delta)`; state labels
    ``y`` (``-1`` without); ``neg_ok``; ``inductive`` (all false when not given); the
    stream indices ``events`` and ``neg_id``."""
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
    theirs = snapshot.state.loader
    memory = getattr(snapshot, "memory", None)
    stores = {s: getattr(memory, s) for s in MSG_STORES} if memory is not None else {}
    set_stream_state(
        enc, theirs.neighbors, theirs.e_id, theirs.cur_e_id, snapshot.state.ids, stores
    )
