"""The cold FedTIP path reports its progress (bank pre-training, snapshot, contexts) in the
log, streams on one thread whatever the caller's thread count, and computes the same bank
and contexts with the progress lines on or off."""

from __future__ import annotations

import logging

import pytest
import torch

from fedlightning.data.temporal import make_synthetic_stream
from fedlightning.data.temporal.protocol import build_temporal_protocol
from fedlightning.programs.temporal_setup import ensure_bank
from fedlightning.temporal import bank as bank_module
from fedlightning.temporal.bank import BankConfig, streaming_threads
from fedlightning.temporal.contexts import compute_contexts
from fedlightning.tracking.mlflow_tracker import NullTracker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CFG = BankConfig(epochs=2, patience=2, memory_dim=16, time_dim=8, embedding_dim=16, neighbors=5)


def tensors(x, prefix=""):
    """Every tensor of a nested dict/tuple, by path."""
    if isinstance(x, torch.Tensor):
        yield prefix, x
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from tensors(x[k], f"{prefix}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from tensors(v, f"{prefix}/{i}")


def assert_bitwise_equal(a, b):
    a, b = dict(tensors(a)), dict(tensors(b))
    assert a.keys() == b.keys() and a
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def build(tmp_path, caller_threads):
    """The bank (via the cache function a run uses) and the contexts of a tiny stream."""
    s = make_synthetic_stream(num_users=40, num_items=10, num_events=3000, seed=3)
    params = {"seed": 5, "tasks": {"num_tasks": 2, "support": 12, "active": 3}}
    proto = build_temporal_protocol(s, params)
    torch.set_num_threads(caller_threads)
    bank = ensure_bank(s, proto, CFG, 0, tmp_path, NullTracker())
    assert torch.get_num_threads() == caller_threads  # the caller's threads are restored
    saved = torch.load(bank["path"], weights_only=False)
    contexts = compute_contexts(bank["path"], proto)
    assert torch.get_num_threads() == caller_threads
    return saved, contexts, proto


def test_cold_path_logs_progress_and_computes_the_same_bank_and_contexts(
    tmp_path, caplog, monkeypatch, threads
):
    monkeypatch.setattr(bank_module, "PROGRESS_LOG_EVERY_S", 0.0)  # a line after every batch
    with caplog.at_level(logging.INFO, logger="fedlightning"):
        loud, loud_ctx, proto = build(tmp_path / "loud", caller_threads=2)
    lines = [r.getMessage() for r in caplog.records]
    for stage in ("bank snapshot", "contexts (2 tasks)"):
        started = [m for m in lines if m.startswith(f"{stage}: ") and "(1 thread)" in m]
        running = [m for m in lines if m.startswith(f"{stage}: ") and "eta" in m]
        done = [m for m in lines if m.startswith(f"{stage} done: ") and "events/s" in m]
        assert len(started) == 1 and running and len(done) == 1, stage
    for stage in ("bank epoch 1/2", "bank epoch 2/2"):  # one line with the loss and the rate
        summary = [m for m in lines if m.startswith(f"{stage}  loss ") and "events/s" in m]
        assert len(summary) == 1, stage
        assert not [m for m in lines if m.startswith((f"{stage}: ", f"{stage} done"))], stage
    assert any(m.startswith("bank built in ") for m in lines)
    supports = sum(len(v) for t in proto.tasks.tasks for v in t.support.values())
    total = len(loud_ctx["down_val"]["events"]) + len(loud_ctx["test"]["events"]) + supports
    assert any(m.startswith(f"contexts (2 tasks) done: {total} events in ") for m in lines)

    caplog.clear()
    monkeypatch.setattr(bank_module, "PROGRESS_LOG_EVERY_S", 1e9)
    with caplog.at_level(logging.WARNING):
        quiet, quiet_ctx, _ = build(tmp_path / "quiet", caller_threads=1)
    assert not caplog.records
    # progress and the caller's thread count change no value: bitwise the same bank, and
    # so the same hash (no measured rate, no uninitialised neighbour slot in it)
    assert_bitwise_equal(
        {k: v for k, v in loud.items() if k not in ("hash", "meta")},
        {k: v for k, v in quiet.items() if k not in ("hash", "meta")},
    )
    assert loud["hash"] == quiet["hash"]
    assert loud["meta"]["metrics"] == quiet["meta"]["metrics"]
    timing = "events_per_s"  # the only value that differs: a measured rate
    assert [{k: v for k, v in r.items() if k != timing} for r in loud["meta"]["history"]] == [
        {k: v for k, v in r.items() if k != timing} for r in quiet["meta"]["history"]
    ]
    assert_bitwise_equal(loud_ctx, quiet_ctx)


def test_streaming_threads_restores_the_callers_count(threads):
    torch.set_num_threads(2)
    with streaming_threads():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), streaming_threads():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
