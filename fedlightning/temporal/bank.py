r"""Building the frozen temporal knowledge bank of FedTIP (paper 001, Sec. 4.2, Eqs. (8)-(11);
docs/temporal.md).

The encoder streams the pre-training segment in time order, in batches: each batch is embedded
from the state before it, a step is taken on Eq. (10) with one negative of Eq. (9) per event
(``negatives="filtered"``: a destination-side node :math:`j` with :math:`(u, j)` not seen up to
:math:`t`; ``"unfiltered"``: any, an ablation), then the batch is ingested. Early stopping on
the pre-validation AP. Every streaming stage runs on one thread (:func:`streaming_threads`;
docs/fedtip.md, "Cold start") and reports its progress (:class:`StageProgress`)."""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_leaves
from torchmetrics.functional.classification import binary_auroc, binary_average_precision
from tqdm.auto import tqdm

from fedlightning.data.temporal.events import EventStream
from fedlightning.temporal.encoders import ENCODERS
from fedlightning.utils.io import content_hash, save_torch
from fedlightning.utils.seeding import derive_seed

log = logging.getLogger(__name__)

# 2: loader event numbers map to stream indices. 3: one seed, one hash (no measured rate in
# it, unused neighbour slots saved as zeros).
BANK_VERSION = 3
STREAMING_THREADS = 1  # torch intra-op threads while streaming (module docstring)
PROGRESS_LOG_EVERY_S = 60.0  # a streaming stage's INFO progress line, at most this often
MSG_STORES = ("msg_s_store", "msg_d_store")  # TGN memory's pending messages, in the bank


@contextmanager
def streaming_threads(n: int = STREAMING_THREADS) -> Iterator[None]:
    """Run the block (or, as ``@streaming_threads()``, the function) with ``n`` torch intra-op
    threads, then restore the caller's number: about 10x faster than two threads, and
    bitwise reproducible (docs/fedtip.md, "Cold start")."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class StageProgress:
    """Progress of one streaming stage over ``total`` events: a tqdm bar on an interactive
    terminal only, an INFO line when the stage starts and at most every
    :data:`PROGRESS_LOG_EVERY_S` while it runs, and a summary line when it ends (DEBUG with
    ``summarized``: a bank epoch, whose caller logs its own line)."""

    def __init__(
        self, stage: str, total: int, logger: logging.Logger | None = None, summarized: bool = False
    ) -> None:
        self.stage, self.total, self.done = stage, int(total), 0
        self.log = logger or log
        self.level = logging.DEBUG if summarized else logging.INFO
        self.t0 = self.last = time.perf_counter()
        threads = torch.get_num_threads()
        self.log.log(
            self.level, "%s: %d events (%d thread%s)", stage, self.total, threads,
            "" if threads == 1 else "s",
        )  # fmt: skip
        self.bar = tqdm(total=self.total, desc=stage, unit="event", disable=None, leave=False)

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        now = time.perf_counter()
        if now - self.last >= PROGRESS_LOG_EVERY_S and self.done < self.total:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / max(rate, 1e-9)
            line = "%s: %d/%d events  %.0fs  %.0f events/s  eta %.0fs"
            self.log.log(
                self.level, line, self.stage, self.done, self.total, now - self.t0, rate, eta
            )

    def close(self) -> None:
        """End the stage (summary line)."""
        self.bar.close()
        seconds = time.perf_counter() - self.t0
        self.log.log(
            self.level,
            "%s done: %d events in %.1fs (%.0f events/s)",
            self.stage,
            self.done,
            seconds,
            self.done / max(seconds, 1e-9),
        )


def pretraining_loss(hu: Tensor, hi: Tensor, hj: Tensor, tau: float) -> Tensor:
    r"""Eq. (10): :math:`-\log \frac{e^{s(h_u, h_i)/\tau}}{e^{s(h_u, h_i)/\tau} +
    e^{s(h_u, h_j)/\tau}}`, :math:`s = \cos`, averaged over the events."""
    pos = F.cosine_similarity(hu, hi, dim=-1) / tau
    neg = F.cosine_similarity(hu, hj, dim=-1) / tau
    return -(pos - torch.logaddexp(pos, neg)).mean()


class PretrainNegatives:
    """Eq. (9): a destination-side node not paired with the source up to the event's time."""

    def __init__(self, stream: EventStream, filtered: bool = True) -> None:
        self.stream, self.filtered = stream, filtered
        kinds = stream.node_type
        self.pool = np.flatnonzero(kinds == 1) if stream.bipartite else np.arange(stream.num_nodes)
        self.seen: set[tuple[int, int]] = set()

    def reset(self) -> None:
        self.seen.clear()

    def sample(self, idx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One negative per event ``idx`` (history: events already :meth:`observe`-d plus
        the batch's own events at or before each event's time)."""
        s = self.stream
        neg = rng.choice(self.pool, size=len(idx))
        if not self.filtered:
            return neg
        batch: dict[tuple[int, int], Any] = {}  # each pair's first time in the batch
        for e in idx.tolist():
            batch.setdefault((int(s.src[e]), int(s.dst[e])), s.t[e])
        for n, e in enumerate(idx.tolist()):
            u, t = int(s.src[e]), s.t[e]
            for _ in range(32):
                j = int(neg[n])
                bt = batch.get((u, j))
                if (u, j) not in self.seen and (bt is None or bt > t):
                    break
                neg[n] = rng.choice(self.pool)
        return neg

    def observe(self, idx: np.ndarray) -> None:
        s = self.stream
        self.seen.update(zip(s.src[idx].tolist(), s.dst[idx].tolist(), strict=True))


@dataclass
class BankConfig:
    """How the bank is built (``conf/bank/*.yaml``)."""

    encoder: str = "tgn"
    memory_dim: int = 64
    time_dim: int = 64
    embedding_dim: int = 64
    neighbors: int = 10
    epochs: int = 3
    patience: int = 1
    batch_size: int = 200
    lr: float = 1e-4
    tau: float = 0.1
    negatives: str = "filtered"
    pretrained: bool = True
    max_events: int | None = None  # pre-train on the first events only (tests, quick looks)
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "extra"}


def make_encoder(stream: EventStream, cfg: BankConfig):
    """The encoder of ``cfg`` on ``stream``, initial weights and empty state."""
    if cfg.encoder not in ENCODERS:
        raise ValueError(f"bank.encoder must be one of {sorted(ENCODERS)}, got {cfg.encoder!r}")
    if stream.msg is None or stream.msg.shape[1] == 0:  # PyG's memory needs a message
        msg = torch.zeros(stream.num_events, 1)
    else:
        msg = torch.from_numpy(stream.msg.astype(np.float32))
    enc = ENCODERS[cfg.encoder](
        stream.num_nodes,
        msg.shape[1],
        memory_dim=cfg.memory_dim,
        time_dim=cfg.time_dim,
        embedding_dim=cfg.embedding_dim,
        neighbors=cfg.neighbors,
    )
    # Times from the stream's start: unix seconds do not fit float32 to the second.
    enc.state.attach(torch.from_numpy((stream.t - stream.t[0]).astype(np.float64)), msg)
    return enc


def event_tensors(enc, stream: EventStream, idx: np.ndarray):
    """Sources, destinations, times (from the stream start) and features of events ``idx``."""
    return (
        torch.from_numpy(stream.src[idx]),
        torch.from_numpy(stream.dst[idx]),
        enc.state.event_t[torch.from_numpy(idx)].long(),
        enc.state.event_msg[torch.from_numpy(idx)],
    )


def link_metrics(pos: Tensor, neg: Tensor) -> dict[str, float]:
    """AUC-ROC and average precision of positives (1) against negatives (0)."""
    scores = torch.cat([pos, neg])
    target = torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))]).long()
    return {
        "auc": float(binary_auroc(scores, target)),
        "ap": float(binary_average_precision(scores, target)),
    }


def stream_and_validate(
    enc,
    stream: EventStream,
    pre_idx: np.ndarray,
    val_idx: np.ndarray,
    cfg: BankConfig,
    seed: int,
    negatives: PretrainNegatives,
    rng: np.random.Generator,
    stage: str,
    step: Callable[[Tensor], None] | None = None,
) -> tuple[float, float, dict[str, float], float]:
    """Stream ``pre_idx`` in ``enc``'s mode, then ``val_idx`` in evaluation mode (negatives
    drawn by ``(seed, "bank", "val")``), as one :class:`StageProgress`, in batches: each
    scored (on ``pre_idx`` with ``step``, also trained), then ingested. Returns the
    pre-training loss and seconds, the validation metrics and loss."""
    # an epoch (trained: ``step``) has its own summary line; the snapshot has not
    progress = StageProgress(stage, len(pre_idx) + len(val_idx), summarized=step is not None)
    val_rng = np.random.default_rng(derive_seed(seed, "bank", "val"))
    segments = []
    for idx, draw, fit in ((pre_idx, rng, step), (val_idx, val_rng, None)):
        if segments:
            enc.eval()
        t0 = time.perf_counter()
        pos, neg, losses = [], [], []
        for start in range(0, len(idx), cfg.batch_size):
            b = idx[start : start + cfg.batch_size]
            j = torch.from_numpy(negatives.sample(b, draw))
            src, dst, t, msg = event_tensors(enc, stream, b)
            with torch.set_grad_enabled(fit is not None):
                h = enc.embed(torch.cat([src, dst, j]), torch.cat([t, t, t]))
                hu, hi, hj = h.split(len(b))
                loss = pretraining_loss(hu, hi, hj, cfg.tau)
            if fit is not None:
                fit(loss)
            pos.append(F.cosine_similarity(hu, hi, dim=-1).detach())
            neg.append(F.cosine_similarity(hu, hj, dim=-1).detach())
            losses.append(float(loss.detach()))
            enc.ingest(src, dst, t, msg, torch.from_numpy(b))
            negatives.observe(b)
            enc.detach()
            progress.update(len(b))
        mean = float(np.mean(losses)) if losses else math.nan
        segments.append((pos, neg, mean, time.perf_counter() - t0))
    progress.close()
    (_, _, loss, seconds), (pos, neg, val_loss, _) = segments
    return loss, seconds, link_metrics(torch.cat(pos), torch.cat(neg)), val_loss


@streaming_threads()
def pretrain(
    stream: EventStream,
    pre_idx: np.ndarray,
    val_idx: np.ndarray,
    cfg: BankConfig,
    seed: int,
    on_epoch: Callable[[int, dict[str, float]], None] | None = None,
):
    """Train the encoder (Eq. (10)) with early stopping on pre-validation AP; return the
    encoder with the best weights and the per-epoch history."""
    torch.manual_seed(derive_seed(seed, "bank", "init"))
    enc = make_encoder(stream, cfg)
    if cfg.max_events:
        pre_idx = pre_idx[: cfg.max_events]
    negatives = PretrainNegatives(stream, cfg.negatives == "filtered")
    history: list[dict[str, float]] = []
    if not cfg.pretrained:
        return enc, history
    opt = torch.optim.Adam(enc.parameters(), lr=cfg.lr)

    def step(loss: Tensor) -> None:
        opt.zero_grad()
        loss.backward()
        opt.step()

    best, best_state, waited = -math.inf, copy.deepcopy(enc.state_dict()), 0
    for epoch in range(1, cfg.epochs + 1):
        enc.train()
        enc.reset_state()
        negatives.reset()
        rng = np.random.default_rng(derive_seed(seed, "bank", "neg", epoch))
        stage = f"bank epoch {epoch}/{cfg.epochs}"
        loss, seconds, metrics, val_loss = stream_and_validate(
            enc, stream, pre_idx, val_idx, cfg, seed, negatives, rng, stage, step
        )
        row = {
            "epoch": epoch,
            "loss": loss,
            "val_loss": val_loss,
            **{f"val_{k}": v for k, v in metrics.items()},
            "events_per_s": len(pre_idx) / seconds,
        }
        history.append(row)
        log.info(
            "bank epoch %d/%d  loss %.4f  val_auc %.4f  val_ap %.4f  %.0f events/s  (%.1fs)",
            epoch,
            cfg.epochs,
            loss,
            row["val_auc"],
            row["val_ap"],
            row["events_per_s"],
            seconds,
        )
        if on_epoch:
            on_epoch(epoch, row)
        if row["val_ap"] > best:
            best, best_state, waited = row["val_ap"], copy.deepcopy(enc.state_dict()), 0
        else:
            waited += 1
            if waited > cfg.patience:
                break
    enc.load_state_dict(best_state)
    return enc, history


@streaming_threads()
@torch.no_grad()
def build_snapshot(
    enc, stream: EventStream, pre_idx: np.ndarray, val_idx: np.ndarray, cfg: BankConfig, seed: int
):
    """Freeze the encoder, stream pre-training then pre-validation (filtered negatives);
    return the pre-validation metrics and the negative index."""
    for p in enc.parameters():
        p.requires_grad_(False)
    # The state is built as during pre-training (TGN's memory applies a node's messages
    # lazily in training mode), so the reported metrics are the selected epoch's.
    enc.train()
    enc.reset_state()
    negatives = PretrainNegatives(stream, filtered=True)
    rng = np.random.default_rng(derive_seed(seed, "bank", "snapshot"))
    _, _, metrics, _ = stream_and_validate(
        enc, stream, pre_idx, val_idx, cfg, seed, negatives, rng, "bank snapshot"
    )
    return metrics, negatives


def bank_state(enc, negatives: PretrainNegatives) -> dict[str, Any]:
    """Everything of Eq. (11) as tensors: weights, streaming state, negative index."""
    loader = enc.state.loader
    state: dict[str, Any] = {
        "weights": {k: v.clone() for k, v in enc.state_dict().items()},
        # unused slots (e_id < 0) hold uninitialised memory: saved as zeros, never read
        "neighbors": loader.neighbors.masked_fill(loader.e_id < 0, 0),
        "neighbor_e_id": loader.e_id.clone(),
        "cur_e_id": int(loader.cur_e_id),
        "event_ids": enc.state.ids.clone(),
        "frequency": enc.state.frequency.clone(),
        "last_time": enc.state.last_time.clone(),
        "negative_pool": torch.from_numpy(negatives.pool.copy()),
        "historical_pairs": torch.tensor(sorted(negatives.seen), dtype=torch.long).view(-1, 2),
    }
    if hasattr(enc, "memory"):
        for store in MSG_STORES:
            state[store] = pack_store(getattr(enc.memory, store), enc.memory.num_nodes)
    return state


def pack_store(store: dict[int, tuple[Tensor, ...]], num_nodes: int) -> tuple[Tensor, ...]:
    """A TGN message store (node ``i`` -> ``(src, dst, t, msg)`` of its pending messages,
    every node a key) as its four columns concatenated in node order (milliseconds to save
    and load, where a dict of ~10^5 small tensors took seconds: docs/fedtip.md). Node ``i``'s
    messages all have ``src == i``, so the first column alone splits the columns again
    (:func:`unpack_store`)."""
    if sorted(store) != list(range(num_nodes)):
        raise ValueError(f"a message store must hold every node 0..{num_nodes - 1}")
    cols = tuple(torch.cat(col) for col in zip(*(store[i] for i in range(num_nodes)), strict=True))
    counts = torch.tensor([len(store[i][0]) for i in range(num_nodes)])
    if not torch.equal(cols[0], torch.repeat_interleave(torch.arange(num_nodes), counts)):
        raise ValueError("a message store holds a message under another node than its source")
    return cols


def unpack_store(cols: tuple[Tensor, ...], num_nodes: int) -> dict[int, tuple[Tensor, ...]]:
    """:func:`pack_store` undone: node -> its ``(src, dst, t, msg)`` (views of the columns)."""
    counts = torch.bincount(cols[0], minlength=num_nodes).tolist()
    return dict(enumerate(zip(*(col.split(counts) for col in cols), strict=True)))


def save_bank(path: Path, state: dict[str, Any], meta: dict[str, Any]) -> str:
    """Write the bank file; return its hash (of the metadata and every tensor's bytes)."""

    def tensor_hash(v: Tensor) -> str:
        return content_hash(v.numpy().tobytes().hex())

    # the measured rate is not a result: left out of the hash
    history = [{k: v for k, v in row.items() if k != "events_per_s"} for row in meta["history"]]
    digest = content_hash(
        {
            "meta": {**meta, "history": history},
            "tensors": {
                k: tensor_hash(v) if isinstance(v, Tensor) else str(v)
                for k, v in sorted(state.items())
                if k not in (*MSG_STORES, "weights")
            },
            "weights": {k: tensor_hash(v) for k, v in sorted(state["weights"].items())},
        }
    )
    save_torch(path, {"version": BANK_VERSION, "hash": digest, "meta": meta, **state})
    return digest


def bank_values(path: str | Path) -> int:
    r"""Values of the bank :math:`|\mathcal{B}_0|` (Eq. 11) a client is provisioned with:
    the encoder with its time encoding and memory, the neighbour store, the recency and
    frequency statistics and the negative index (every tensor of the bank file)."""
    saved = torch.load(path, weights_only=False)
    bank = [v for k, v in saved.items() if k not in ("meta", "hash", "version")]
    return sum(x.numel() for x in tree_leaves(bank) if isinstance(x, Tensor))
