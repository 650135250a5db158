"""A run of the first tasks (``max_tasks``) computes the contexts of those tasks only, bitwise
the full protocol's, and reuses the full contexts when they are cached."""

from __future__ import annotations

import pytest
import torch

from fedlightning.data.temporal import make_synthetic_stream
from fedlightning.data.temporal.protocol import build_temporal_protocol
from fedlightning.programs.temporal_setup import ensure_bank
from fedlightning.temporal.bank import BankConfig
from fedlightning.temporal.contexts import cached_contexts, compute_contexts
from fedlightning.tracking.mlflow_tracker import NullTracker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CFG = BankConfig(epochs=1, patience=1, memory_dim=16, time_dim=8, embedding_dim=16, neighbors=5)


def leaves(x, prefix=""):
    if isinstance(x, torch.Tensor):
        yield prefix, x
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from leaves(x[k], f"{prefix}/{k}")


def test_the_first_tasks_contexts_are_the_full_ones(tmp_path):
    s = make_synthetic_stream(num_users=40, num_items=10, num_events=3000, seed=3)
    proto = build_temporal_protocol(
        s, {"seed": 5, "tasks": {"num_tasks": 3, "support": 12, "active": 3}}
    )
    bank = ensure_bank(s, proto, CFG, 0, tmp_path, NullTracker())
    first = [t.task for t in proto.tasks.tasks[:2]]

    path, key, _ = cached_contexts(bank["path"], bank["hash"], proto, tmp_path, max_tasks=2)
    assert path.name.endswith("-first2.pt")
    part = torch.load(path, weights_only=False)
    assert list(part["tasks"]) == first
    full = compute_contexts(bank["path"], proto)
    assert len(full["tasks"]) == 3
    want = dict(leaves({k: v for k, v in full.items() if k != "tasks"}))
    want |= dict(leaves({t: full["tasks"][t] for t in first}, "/tasks"))
    got = dict(leaves({k: v for k, v in part.items() if k != "tasks"}))
    got |= dict(leaves(part["tasks"], "/tasks"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    whole, whole_key, _ = cached_contexts(bank["path"], bank["hash"], proto, tmp_path)
    assert whole_key == key and not whole.name.endswith("-first2.pt")
    again, again_key, reused = cached_contexts(
        bank["path"], bank["hash"], proto, tmp_path, max_tasks=2
    )
    assert (again, again_key, reused) == (whole, key, True)  # the whole protocol's, cached
