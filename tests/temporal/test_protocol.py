"""FedTIP's protocol objects: manifest, ownership, tasks and negatives, by hand and on real
streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import (
    DOWN_VAL,
    NN_EXCL,
    OUTCOMES,
    PRETRAIN,
    SUP_POOL,
    TEST,
    boundaries,
    build_manifest,
    snap,
)
from fedlightning.data.temporal.negatives import NegativeSampler, materialize_negatives
from fedlightning.data.temporal.ownership import build_ownership
from fedlightning.data.temporal.protocol import build_temporal_protocol, materialize
from fedlightning.data.temporal.tasks import Task, TaskSet, build_tasks, prototype_counts

FL = str(Path(sys.executable).parent / "fedlightning")


def stream(t, src, dst, users, items, label=None):
    n = users + items
    return EventStream(
        "toy",
        np.asarray(src),
        np.asarray(dst),
        np.asarray(t),
        n,
        True,
        np.r_[np.zeros(users, dtype=np.int64), np.ones(items, dtype=np.int64)],
        label=None if label is None else np.asarray(label),
    )


# --- manifest ------------------------------------------------------------------------------
def test_boundaries_by_hand_and_snapping_to_equal_timestamps():
    t = np.arange(100)
    # round(70), round(80); R = 20: candidate round(2) = 2, validation 2, test 16
    assert boundaries(t) == [70, 80, 82, 84]
    ties = t.copy()
    ties[68:75] = 68  # a group of equal times straddles the 70 boundary
    assert snap(ties, 70) == 75 and snap(ties, 68) == 68  # 68 already starts the group
    assert boundaries(ties)[0] == 75
    # Wikipedia's size: the paper's Table 1 counts
    n = 157_474
    b = boundaries(np.arange(n))
    assert [b[0], b[1] - b[0], b[3] - b[2], n - b[3]] == [110_232, 15_747, 3_150, 25_195]


def test_six_outcomes_are_disjoint_and_exhaustive_and_inductive_events_excluded():
    rng = np.random.default_rng(0)
    n, users, items = 2000, 60, 20
    s = stream(
        np.sort(rng.integers(0, 500, n)),  # many equal timestamps
        rng.integers(0, users, n),
        users + rng.integers(0, items, n),
        users,
        items,
    )
    m = build_manifest(s, seed=3, inductive_fraction=0.2)
    counts = m.counts()
    assert sum(counts[o] for o in OUTCOMES) == n  # exhaustive; one int per event: disjoint
    assert set(np.unique(m.outcome)) <= set(range(6))
    b_pre, b_pv, b_cand, b_val = m.bounds
    for b in m.bounds:  # no timestamp straddles a boundary
        assert s.t[b - 1] < s.t[b]
    touches = np.isin(s.src, m.inductive_nodes) | np.isin(s.dst, m.inductive_nodes)
    cand = np.arange(n)[b_pv:b_cand]
    assert (m.outcome[cand] == np.where(touches[cand], NN_EXCL, SUP_POOL)).all()
    assert (m.inductive == ((m.outcome == TEST) & touches)).all()
    assert (m.outcome[:b_pre] == PRETRAIN).all() and (m.outcome[b_cand:b_val] == DOWN_VAL).all()
    # 20% of the users and 20% of the items seen in validation + test, per type
    seen = np.unique(np.r_[s.src[b_cand:], s.dst[b_cand:]])
    for kind in (0, 1):
        pool = seen[s.node_type[seen] == kind]
        assert (s.node_type[m.inductive_nodes] == kind).sum() == round(0.2 * len(pool))
    assert build_manifest(s, seed=3, inductive_fraction=0.2).hash == m.hash
    assert build_manifest(s, seed=4, inductive_fraction=0.2).hash != m.hash


# --- ownership ------------------------------------------------------------------------------
def test_user_iid_ownership_is_near_equal_and_events_follow_their_user():
    rng = np.random.default_rng(1)
    s = stream(np.arange(500), rng.integers(0, 23, 500), 23 + rng.integers(0, 5, 500), 23, 5)
    own = build_ownership(s, np.arange(500), clients=4, seed=7)
    sizes = Counter(own.owner[s.users].tolist())
    assert sorted(sizes.values()) == [5, 6, 6, 6]  # 23 users over 4 clients
    assert (own.owner[23:] == -1).all()  # items are owned by nobody
    assert (own.of_events(s) == own.owner[s.src]).all()
    skewed = build_ownership(s, np.arange(500), kind="activity_skew", clients=4, seed=7, skew=2.0)
    counts = np.bincount(skewed.of_events(s), minlength=4)
    assert counts.max() > 2 * np.sort(counts)[1]  # one client far more active than most


def test_label_skew_separates_positive_users():
    rng = np.random.default_rng(2)
    n, users = 4000, 200
    src = rng.integers(0, users, n)
    label = (src < 40).astype(np.int64)  # users 0..39 are the positive ones
    s = stream(np.arange(n), src, users + rng.integers(0, 10, n), users, 10, label)
    own = build_ownership(s, np.arange(n), kind="label_skew", clients=5, seed=0, alpha=0.1)
    pos = np.bincount(own.owner[:40], minlength=5) / 40
    neg = np.bincount(own.owner[40:users], minlength=5) / 160
    assert np.abs(pos - neg).sum() > 0.5  # the two groups land on different clients


# --- tasks ----------------------------------------------------------------------------------
def labelled_stream(n=6000, users=300, items=40, seed=0):
    rng = np.random.default_rng(seed)
    label = (rng.random(n) < 0.05).astype(np.int64)
    return stream(
        np.arange(n),
        rng.integers(0, users, n),
        users + rng.integers(0, items, n),
        users,
        items,
        label,
    )


def test_tasks_have_30_events_from_5_clients_with_a_positive():
    s = labelled_stream()
    m = build_manifest(s, seed=1)
    own = build_ownership(s, m.indices(SUP_POOL), clients=10, seed=1)
    ts = build_tasks(s, m, own, num_tasks=40, seed=1)
    owner = own.of_events(s)
    for t in ts.tasks:
        ev = t.events
        assert len(ev) == 30 and len(set(ev.tolist())) == 30 and len(t.clients) == 5
        assert (m.outcome[ev] == SUP_POOL).all()
        for k, events in t.support.items():
            assert (owner[events] == k).all() and 5 <= len(events) <= 7
        assert s.label[ev].sum() >= 1
    assert ts.stats(s)["tasks_with_both_labels"] == 40
    again = build_tasks(s, m, own, num_tasks=40, seed=1)
    assert again.hash == ts.hash
    assert build_tasks(s, m, own, num_tasks=40, seed=2).hash != ts.hash


def test_prototype_counts_by_hand():
    label = np.array([0, 0, 1, 0, 1, 1, 0, 0])
    tasks = [
        Task(0, {0: [0, 1, 2], 1: [3]}),  # client 0: class 0 twice, class 1 once; client 1: 0 once
        Task(1, {2: [4, 5], 3: [6, 7]}),  # class 1 twice; class 0 twice
    ]
    assert prototype_counts(tasks, label) == (5, 2)
    ts = TaskSet(tasks, {})
    s = stream(np.arange(8), [0] * 8, [1] * 8, 1, 1, label)
    stats = ts.stats(s)
    assert (stats["local_prototypes"], stats["single_event_prototypes"]) == (5, 2)


# --- negatives ------------------------------------------------------------------------------
def test_negative_rule_by_hand():
    # users 0, 1; items 2, 3, 4, 5. Pre-training (first 7 events) sees items 2, 3, 4.
    t = [0, 1, 2, 3, 4, 5, 6, 7, 8, 8]
    src = [0, 0, 1, 1, 0, 1, 0, 1, 0, 0]
    dst = [2, 3, 4, 2, 4, 3, 3, 5, 2, 3]
    s = stream(t, src, dst, 2, 4)
    m = build_manifest(s, pre=0.7, pre_val=0.1, candidate=0.5, down_val=0.25, inductive_fraction=0)
    sampler = NegativeSampler(s, m)
    assert sampler.pool.tolist() == [2, 3, 4]
    # event 8 = (0, 2, t=8); event 9 = (0, 3, t=8): at t=8 user 0 truly meets 2 and 3
    assert not sampler.valid(8, 2, "same_time") and not sampler.valid(8, 3, "same_time")
    assert sampler.valid(8, 4, "same_time")
    assert not sampler.valid(8, 4, "strict")  # (0, 4) happened at t=4
    assert sampler.sample(8, "same_time", 0) == 4  # the only valid candidate
    assert sampler.sample(8, "strict", 0) == -1  # none left: a sampling failure
    check = sampler.check(np.array([8, 8, 8, 9]), np.array([2, 3, -1, 4]))
    assert check == {"events": 4, "positive": 1, "same_time": 1, "historical": 3, "failures": 1}
    out = materialize_negatives(s, m, {0: np.array([8, 9])}, {}, seed=0)
    assert out["tasks"]["same_time"]["0"] == [4, 4]
    assert out["checks"]["support_strict"]["failures"] == 2


def test_same_protocol_seed_same_bytes_and_cache_reuse(tmp_path):
    s = labelled_stream(seed=3)
    params = {"seed": 11, "tasks": {"num_tasks": 10}}
    a = build_temporal_protocol(s, params)
    b = build_temporal_protocol(s, params)
    assert a.hashes == b.hashes
    assert (
        build_temporal_protocol(s, {**params, "seed": 12}).hashes["manifest"]
        != a.hashes["manifest"]
    )
    first, reused = materialize(s, params, tmp_path)
    assert not reused and first.hashes == a.hashes
    second, reused = materialize(s, params, tmp_path)
    assert reused and second.hashes == a.hashes
    a.write(tmp_path / "x")
    b.write(tmp_path / "y")
    for name in ("manifest", "ownership", "tasks", "negatives"):
        assert (tmp_path / "x" / f"{name}.json").read_bytes() == (
            tmp_path / "y" / f"{name}.json"
        ).read_bytes()
    for name, check in a.negatives["checks"].items():
        assert check["positive"] == check["failures"] == 0
        if name != "support_unfiltered":  # the ablation may hit a same-time true edge
            assert check["same_time"] == 0
    assert a.negatives["checks"]["support_strict"]["historical"] == 0


@pytest.mark.slow
def test_wikipedia_manifest_from_the_command_line(tmp_path, shared_data):
    env = {
        **os.environ,
        "FEDLIGHTNING_DATA": str(shared_data),
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    cmd = [FL, "data", "manifest", "experiment=temporal_wikipedia", "--out", "wiki"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "wiki" / "protocol.json").read_text())
    row = summary["table"]
    assert (row["pre_train"], row["pre_val"], row["down_val"], row["test"]) == (
        110_232,
        15_747,
        3_150,
        25_195,
    )
    assert row["sup_pool"] + row["nn_excl"] == 3_150
    assert "110,232" in r.stdout
    checks = summary["collisions"]
    assert checks["support_same_time"]["positive"] == checks["support_same_time"]["failures"] == 0
    assert (
        checks["support_strict"]["historical"] == 0 and checks["support_strict"]["events"] == 3_000
    )
    # a training seed does not enter the protocol; the second run reuses the cache
    r2 = subprocess.run(
        [*cmd[:-1], "wiki2", "seed=5"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r2.returncode == 0, r2.stderr
    assert "(reused)" in r2.stdout
    assert (
        json.loads((tmp_path / "wiki2" / "protocol.json").read_text())["hashes"]
        == summary["hashes"]
    )
    for name in ("manifest", "ownership", "tasks", "negatives"):
        a = (tmp_path / "wiki" / f"{name}.json").read_bytes()
        assert a == (tmp_path / "wiki2" / f"{name}.json").read_bytes()
