"""Unreliable clients (``protocol.noise``): who is unreliable, which support labels flip, that
nothing else changes, and a tiny FedTIP run with noisy labels."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from fedlightning.data.temporal.manifest import DOWN_VAL, SUP_POOL, TEST, build_manifest
from fedlightning.data.temporal.negatives import materialize_negatives
from fedlightning.data.temporal.noise import draw_noise, noise_settings
from fedlightning.data.temporal.ownership import Ownership, build_ownership
from fedlightning.data.temporal.protocol import (
    build_temporal_protocol,
    cached_protocol,
    materialize,
    materialize_checked,
)
from fedlightning.data.temporal.tasks import Task, TaskSet, build_tasks
from fedlightning.errors import ConfigError
from fedlightning.programs.temporal_program import check_noise, eval_batches, task_batches
from fedlightning.utils.io import content_hash
from tests.temporal.test_protocol import labelled_stream, stream

NOISY = {"seed": 11, "tasks": {"num_tasks": 20}, "noise": {"clients": 0.4, "flip": 0.5}}


def owned_by(s, own, events, clients):
    return [e for e in events if int(own.owner[s.src[e]]) in clients]


# --- settings -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "noise, key",
    [
        ({"clients": -0.1}, "protocol.noise.clients"),
        ({"clients": 1.5}, "protocol.noise.clients"),
        ({"flip": 1.01}, "protocol.noise.flip"),
        ({"flip": "half"}, "protocol.noise.flip"),
        ({"flip": True}, "protocol.noise.flip"),
        ({"rate": 0.1}, "protocol.noise takes"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(noise, key):
    with pytest.raises(ValueError, match=key):
        noise_settings(noise)
    with pytest.raises(ConfigError, match=key) as e:  # as the CLI sees it, before training
        materialize_checked(labelled_stream(), OmegaConf.create({"cache_dir": "x", "noise": noise}))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=key):
        check_noise(OmegaConf.create({"noise": noise}), ["nc"])


def test_off_settings_and_link_prediction_refused():
    assert noise_settings(None) is None and noise_settings({"clients": 0, "flip": 0.0}) is None
    assert noise_settings({"clients": 1, "flip": 0.25}) == {"clients": 1.0, "flip": 0.25}
    on = OmegaConf.create({"noise": {"clients": 0.4, "flip": 0.2}})
    check_noise(on, ["nc"])
    for families in (["nc", "lp"], ["lp"]):
        with pytest.raises(ConfigError, match="`families`.*families=\\[nc\\]"):
            check_noise(on, families)
    check_noise(OmegaConf.create({"noise": {"clients": 0.0, "flip": 0.0}}), ["nc", "lp"])


def test_a_stream_without_labels_is_refused():
    s = labelled_stream()
    s.label = None
    with pytest.raises(ValueError, match="protocol.noise flips state labels.*no state labels"):
        build_temporal_protocol(s, NOISY)
    with pytest.raises(ConfigError, match="protocol.noise"):
        materialize_checked(s, OmegaConf.create({**NOISY, "cache_dir": "x"}))


# --- the draw -------------------------------------------------------------------------------
def test_noise_off_keeps_every_hash_and_the_cache_folder(tmp_path):
    s = labelled_stream(seed=3)
    params = {"seed": 11, "tasks": {"num_tasks": 10}}
    # the four objects as built before the option existed, by their own functions
    m = build_manifest(s, seed=11)
    own = build_ownership(s, m.indices(SUP_POOL), seed=11)
    ts = build_tasks(s, m, own, seed=11, num_tasks=10)
    neg = materialize_negatives(
        s,
        m,
        {t.task: t.events for t in ts.tasks},
        {"down_val": m.indices(DOWN_VAL), "test": m.indices(TEST)},
        seed=11,
    )
    before = {"manifest": m.hash, "ownership": own.hash, "tasks": ts.hash}
    before["negatives"] = content_hash(neg)
    for off in ({}, {"noise": {"clients": 0.0, "flip": 0.0}}, {"noise": None}):
        p = build_temporal_protocol(s, {**params, **off})
        assert p.noise is None and p.hashes == p.event_hashes == before
        assert (
            cached_protocol(s, {**params, **off}, tmp_path)[1]
            == (cached_protocol(s, params, tmp_path)[1])
        )
    p.write(tmp_path / "run")
    assert not (tmp_path / "run" / "noise.json").exists()
    assert "noise" not in json.loads((tmp_path / "run" / "protocol.json").read_text())


def test_unreliable_clients_and_flips_are_seeded_nested_and_hashed(tmp_path):
    s = labelled_stream(seed=3)
    a = build_temporal_protocol(s, NOISY)
    b = build_temporal_protocol(s, NOISY)
    assert a.noise.to_json() == b.noise.to_json() and a.hashes == b.hashes
    assert a.hashes["noise"] == content_hash(a.noise.to_json())
    assert {k: v for k, v in a.hashes.items() if k != "noise"} == a.event_hashes
    assert a.event_hashes == build_temporal_protocol(s, {**NOISY, "noise": None}).hashes
    assert len(a.noise.clients) == 4 and set(a.noise.clients) <= set(range(10))  # 0.4 x 10
    support = set(np.concatenate([t.events for t in a.tasks.tasks]).tolist())
    assert set(a.noise.flipped) <= set(owned_by(s, a.ownership, support, a.noise.clients))
    assert a.noise.flipped  # 20 tasks x 30 events: some of the unreliable ones flip
    other = build_temporal_protocol(s, {**NOISY, "seed": 12}).noise
    assert (other.clients, other.flipped) != (a.noise.clients, a.noise.flipped)
    # a lower rate flips a subset (one draw across a sweep); fewer clients, a subset of them
    low = build_temporal_protocol(s, {**NOISY, "noise": {"clients": 0.4, "flip": 0.2}}).noise
    assert low.clients == a.noise.clients and set(low.flipped) < set(a.noise.flipped)
    few = build_temporal_protocol(s, {**NOISY, "noise": {"clients": 0.2, "flip": 0.5}}).noise
    assert len(few.clients) == 2 and set(few.clients) < set(a.noise.clients)
    everyone = build_temporal_protocol(s, {**NOISY, "noise": {"clients": 1, "flip": 1}}).noise
    assert everyone.flipped == sorted(support)
    # materialized: written with its hash, reused from the cache byte for byte
    first, reused = materialize(s, NOISY, tmp_path / "cache")
    assert not reused and first.hashes == a.hashes
    again, reused = materialize(s, NOISY, tmp_path / "cache")
    assert reused and again.hashes == a.hashes and again.noise.to_json() == a.noise.to_json()
    a.write(tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "noise.json").read_text())
    assert saved["hash"] == a.hashes["noise"] and saved["clients"] == a.noise.clients
    summary = json.loads((tmp_path / "run" / "protocol.json").read_text())
    assert summary["hashes"]["noise"] == a.hashes["noise"]
    assert summary["noise"]["unreliable_clients"] == a.noise.clients


def test_flip_rate_among_unreliable_supports_within_a_binomial_bound():
    # 10 clients (user u -> client u % 10), 200 tasks each holding 100 events of every client
    n, users, items = 20_000, 100, 10
    rng = np.random.default_rng(0)
    s = stream(
        np.arange(n),
        rng.integers(0, users, n),
        users + rng.integers(0, items, n),
        users,
        items,
        (rng.random(n) < 0.3).astype(np.int64),
    )
    owner = np.full(s.num_nodes, -1)
    owner[:users] = np.arange(users) % 10
    own = Ownership(owner, 10, {})
    by_client = {k: np.flatnonzero(owner[s.src] == k) for k in range(10)}
    tasks = TaskSet(
        [Task(t, {k: by_client[k][t::200].tolist() for k in range(10)}) for t in range(200)],
        {},
    )
    flip = 0.3
    noise = draw_noise(s, own, tasks, clients=0.5, flip=flip, seed=5)
    assert len(noise.clients) == 5
    noisy = owned_by(s, own, range(n), noise.clients)
    frac = len(noise.flipped) / len(noisy)  # every event serves in exactly one task here
    assert abs(frac - flip) < 5 * math.sqrt(flip * (1 - flip) / len(noisy))
    y = noise.labels(s.label, np.arange(n))
    changed = np.flatnonzero(y != s.label)
    assert changed.tolist() == noise.flipped  # exactly the flipped events, each 1 - y
    assert (y[changed] == 1 - s.label[changed]).all() and y.dtype == s.label.dtype
    stats = noise.stats(tasks)
    assert stats["unreliable_support_events"] == len(noisy)
    assert stats["flipped_support_events"] == len(noise.flipped)


def test_clients_train_on_noisy_labels_and_evaluation_labels_are_clean():
    s = labelled_stream(seed=3)
    clean = s.label.copy()
    p = build_temporal_protocol(s, {**NOISY, "noise": {"clients": 0.6, "flip": 0.7}})

    def ctx(idx):  # the fields event_batch reads; states are irrelevant to the labels
        n = len(idx)
        z = torch.zeros(n, 2)
        d = torch.ones(n)
        return dict(events=torch.from_numpy(np.asarray(idx)), src=z, dst=z, neg=z,
                    dt_src=d, dt_dst=d, dt_neg=d)  # fmt: skip

    neg = p.negatives
    contexts = {
        "mode": neg["mode"],
        "tasks": {t.task: {k: ctx(v) for k, v in t.support.items()} for t in p.tasks.tasks},
        "down_val": ctx(p.manifest.indices(DOWN_VAL)),
        "test": ctx(p.manifest.indices(TEST)),
    }
    te = torch.nn.Identity()
    flipped, seen_flip = set(p.noise.flipped), 0
    for batch in task_batches(contexts, p, lambda d: te(d)[:, None], None):
        for k, b in batch.clients.items():
            events = b["events"].numpy()
            want = np.array([1 - clean[e] if e in flipped else clean[e] for e in events])
            assert b["y"].tolist() == want.tolist()
            if k not in p.noise.clients:  # a reliable client's labels are untouched
                assert b["y"].tolist() == clean[events].tolist()
            seen_flip += int((b["y"].numpy() != clean[events]).sum())
    assert seen_flip > 0
    evals = eval_batches(contexts, p, lambda d: te(d)[:, None])
    for split, outcome in (("val", DOWN_VAL), ("test", TEST)):
        assert evals[split]["y"].reshape(-1).tolist() == clean[p.manifest.indices(outcome)].tolist()
    assert (s.label == clean).all()  # the stream itself is never modified


# --- end to end -----------------------------------------------------------------------------
SMALL = [
    "experiment=temporal_synthetic",
    "algorithm=fedtip",
    "protocol.tasks.num_tasks=2",
    "max_tasks=1",
    "federation.rounds=1",
    "federation.local_epochs=1",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
    "protocol.noise.clients=0.4",
    "protocol.noise.flip=0.5",
]


def test_noise_with_link_prediction_fails_before_a_run_directory(env, compose):
    from fedlightning.train import train

    with pytest.raises(ConfigError, match="families"):
        train(compose(SMALL), env / "r", verbose=False)  # families=auto: nc and lp
    assert not (env / "r").exists()


def test_a_tiny_fedtip_run_with_unreliable_clients(env, compose):
    from fedlightning.train import train

    s = train(compose([*SMALL, "families=[nc]"]), env / "r", verbose=False)
    assert s["tasks_done"] == 1 and s["families"] == ["nc"]
    assert 0.0 <= s["metrics"]["auc_nc"] <= 1.0
    noise = json.loads((env / "r" / "noise.json").read_text())
    assert s["hashes"]["noise"] == noise["hash"]
    assert s["noise"]["unreliable_clients"] == noise["clients"] and len(noise["clients"]) == 4
    assert json.loads((env / "r" / "protocol.json").read_text())["noise"] == s["noise"]
    # the clean run: same events, contexts reused (they hold no label), other labels trained on
    clean = train(compose([*SMALL[:-2], "families=[nc]"]), env / "c", verbose=False)
    assert "noise" not in clean and "noise" not in clean["hashes"]
    assert clean["hashes"] == {k: v for k, v in s["hashes"].items() if k != "noise"}
    task0 = json.loads((env / "r" / "tasks.json").read_text())["tasks"][0]["support"]
    served = [e for k, v in task0.items() if int(k) in noise["clients"] for e in v]
    assert s["noise"]["flipped_support_events"] > 0
    assert set(served) & set(noise["flipped"])  # task 0 trains on flipped labels (seed 2026)
    assert clean["metrics"]["auc_nc"] != s["metrics"]["auc_nc"]
    # unreliable clients that flip nothing: recorded, and the clean run's numbers
    zero = train(
        compose([*SMALL[:-1], "protocol.noise.flip=0", "families=[nc]"]), env / "z", verbose=False
    )
    assert zero["noise"]["unreliable_clients"] == noise["clients"]
    assert zero["noise"]["flipped_support_events"] == 0 and "noise" in zero["hashes"]
    assert zero["metrics"] == clean["metrics"]
