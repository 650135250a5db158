"""The temporal knowledge bank: Eq. (10) by hand, Eq. (9)'s filter, pre-training that learns,
the frozen state it keeps, and reuse of a built bank."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlightning.data.temporal import make_synthetic_stream
from fedlightning.data.temporal.manifest import PRETRAIN, PREVAL, build_manifest
from fedlightning.temporal.bank import (
    BankConfig,
    PretrainNegatives,
    bank_state,
    build_snapshot,
    link_metrics,
    pretrain,
    pretraining_loss,
)
from fedlightning.train import train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
# A bank of one epoch on the synthetic stream at a quarter of its events, in two tasks: its
# runs build a few clients' contexts (each a fork of the snapshot), not the default's 500.
SHORT_BANK = [
    "experiment=bank_synthetic",
    "bank=tgn",
    "dataset.num_events=5000",
    "protocol.tasks.num_tasks=2",
    "bank.epochs=1",
]


def test_pretraining_loss_by_hand():
    hu = torch.tensor([[1.0, 0.0]])
    hi = torch.tensor([[1.0, 0.0]])  # cos = 1
    hj = torch.tensor([[0.0, 1.0]])  # cos = 0
    # -log(e^{1/tau} / (e^{1/tau} + e^{0})) at tau = 0.5
    expected = -math.log(math.exp(2) / (math.exp(2) + 1))
    assert pretraining_loss(hu, hi, hj, 0.5).item() == pytest.approx(expected)
    assert pretraining_loss(hu, hi, hi, 1.0).item() == pytest.approx(math.log(2))


def test_link_metrics_by_hand():
    m = link_metrics(torch.tensor([0.9, 0.4]), torch.tensor([0.5, 0.1]))
    assert m["auc"] == pytest.approx(0.75)  # 3 of the 4 (pos, neg) pairs ordered right
    assert m["ap"] == pytest.approx((1 + 2 / 3) / 2)


def test_filtered_negatives_avoid_every_seen_pair():
    s = make_synthetic_stream(num_users=20, num_items=6, num_events=600, seed=1)
    neg = PretrainNegatives(s, filtered=True)
    rng = np.random.default_rng(0)
    idx = np.arange(600)
    for start in range(0, 600, 50):
        b = idx[start : start + 50]
        j = neg.sample(b, rng)
        assert (s.node_type[j] == 1).all()  # destination-side nodes only
        for e, jj in zip(b.tolist(), j.tolist(), strict=True):
            later = (s.src[b] == s.src[e]) & (s.dst[b] == jj) & (s.t[b] <= s.t[e])
            if (int(s.src[e]), jj) not in neg.seen and not later.any():
                continue
            # a collision is only possible when every item was already seen with that user
            seen_items = {d for (u, d) in neg.seen if u == s.src[e]}
            assert len(seen_items | set(s.dst[b][s.src[b] == s.src[e]].tolist())) == 6
        neg.observe(b)
    unfiltered = PretrainNegatives(s, filtered=False)
    unfiltered.observe(idx)
    drawn = unfiltered.sample(idx[:200], np.random.default_rng(0))
    hits = sum((int(u), int(j)) in unfiltered.seen for u, j in zip(s.src[:200], drawn, strict=True))
    assert hits > 0  # without the filter, seen pairs come back as negatives


@pytest.fixture(scope="module")
def small():
    s = make_synthetic_stream(num_users=80, num_items=20, num_events=4000, seed=0)
    m = build_manifest(s, seed=1)
    return s, m.indices(PRETRAIN), m.indices(PREVAL)


@pytest.mark.parametrize("encoder", ["tgn", "tgat"])
def test_pretraining_learns_and_the_frozen_state_is_the_stream_history(small, encoder):
    s, pre, val = small
    cfg = BankConfig(
        encoder=encoder, epochs=3, patience=3, lr=3e-3, memory_dim=32, time_dim=16, embedding_dim=32
    )
    torch.set_num_threads(1)
    enc, history = pretrain(s, pre, val, cfg, seed=0)
    assert len(history) == 3 and history[-1]["loss"] < history[0]["loss"]
    trained, negatives = build_snapshot(enc, s, pre, val, cfg, seed=0)
    untrained_enc, _ = pretrain(
        s, pre, val, BankConfig(**{**cfg.key(), "pretrained": False}), seed=0
    )
    untrained, _ = build_snapshot(untrained_enc, s, pre, val, cfg, seed=0)
    assert trained["auc"] > untrained["auc"] + 0.05  # pre-training is what the bank adds
    assert not any(p.requires_grad for p in enc.parameters())  # frozen
    state = bank_state(enc, negatives)
    seen = np.r_[pre, val]
    freq = np.bincount(np.r_[s.src[seen], s.dst[seen]], minlength=s.num_nodes)
    assert np.array_equal(state["frequency"].numpy(), freq)
    last = np.zeros(s.num_nodes)  # times count from the stream's first event
    np.maximum.at(last, s.src[seen], s.t[seen] - s.t[0])
    np.maximum.at(last, s.dst[seen], s.t[seen] - s.t[0])
    assert np.array_equal(state["last_time"].numpy(), last)
    assert state["cur_e_id"] == len(seen)  # every pre-training and pre-validation event ingested
    assert int(state["neighbor_e_id"].max()) == len(seen) - 1
    assert len(state["historical_pairs"]) == len(
        {(int(u), int(v)) for u, v in zip(s.src[seen], s.dst[seen], strict=True)}
    )


@torch.no_grad()
def test_a_fork_streams_as_a_deep_copy_and_leaves_its_snapshot_alone(small):
    """``fork`` shares the message stores' entries (immutable tuples) instead of copying
    them: streaming into a fork gives bitwise what a full deep copy gives, and neither the
    snapshot's stores nor its states change."""
    import copy

    from fedlightning.temporal.bank import MSG_STORES, make_encoder
    from fedlightning.temporal.contexts import fork, stream_contexts

    s, pre, val = small
    torch.manual_seed(0)
    enc = make_encoder(s, BankConfig(encoder="tgn", memory_dim=16, time_dim=8, embedding_dim=16))
    enc.eval()
    stream_contexts(enc, s, pre[:600], np.full(600, -1))  # a snapshot with pending messages
    before = copy.deepcopy(enc)
    twin, full = fork(enc), copy.deepcopy(enc)
    for name in MSG_STORES:
        store, own = getattr(enc.memory, name), getattr(twin.memory, name)
        assert own is not store and own.keys() == store.keys()
        assert all(own[k] is store[k] for k in store)  # the same entries, not copies
    later = pre[600:1200]
    a = stream_contexts(twin, s, later, np.full(600, -1))
    b = stream_contexts(full, s, later, np.full(600, -1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    nodes = torch.arange(s.num_nodes)
    times = torch.zeros(s.num_nodes, dtype=torch.long)
    assert torch.equal(enc.embed(nodes, times), before.embed(nodes, times))  # untouched
    for name in MSG_STORES:
        store, old = getattr(enc.memory, name), getattr(before.memory, name)
        assert store.keys() == old.keys()
        assert all(torch.equal(x, y) for k in store for x, y in zip(store[k], old[k], strict=True))


@torch.no_grad()
def test_a_message_store_packs_into_four_columns_and_back(small):
    """The bank saves each TGN message store as four columns: nothing added (the bank's
    value count stays), every entry back with its values, dtype and shape."""
    from fedlightning.temporal.bank import MSG_STORES, make_encoder, pack_store, unpack_store
    from fedlightning.temporal.contexts import stream_contexts

    s, pre, _ = small
    torch.manual_seed(0)
    enc = make_encoder(s, BankConfig(encoder="tgn", memory_dim=16, time_dim=8, embedding_dim=16))
    enc.eval()
    stream_contexts(enc, s, pre[:600], np.full(600, -1))
    for name in MSG_STORES:
        store = getattr(enc.memory, name)
        assert sum(len(v[0]) > 0 for v in store.values()) > 10  # pending messages to pack
        cols = pack_store(store, s.num_nodes)
        assert len(cols) == 4
        assert sum(c.numel() for c in cols) == sum(x.numel() for v in store.values() for x in v)
        back = unpack_store(cols, s.num_nodes)
        assert back.keys() == store.keys()
        for k, entry in store.items():
            for x, y in zip(back[k], entry, strict=True):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    with pytest.raises(ValueError, match="every node"):
        pack_store({0: store[0]}, s.num_nodes)
    swapped = {**store, 0: store[1], 1: store[0]}
    if len(store[0][0]) or len(store[1][0]):
        with pytest.raises(ValueError, match="another node"):
            pack_store(swapped, s.num_nodes)


def test_bank_runs_from_the_config_and_are_reused(tmp_env, compose):
    over = [*SHORT_BANK, "bank.max_events=2000", "logger=none"]
    a = train(compose(over), tmp_env / "a", verbose=False)
    assert not a["bank"]["reused"] and set(a["hashes"]) == {
        "manifest",
        "ownership",
        "tasks",
        "negatives",
        "bank",
        "contexts",
    }
    assert 0.0 <= a["metrics"]["bank_val_auc"] <= 1.0 and 0.0 <= a["metrics"]["bank_val_ap"] <= 1.0
    b = train(compose(over), tmp_env / "b", verbose=False)
    assert b["bank"]["reused"] and b["hashes"] == a["hashes"] and b["metrics"] == a["metrics"]
    c = train(compose([*over, "seed=1"]), tmp_env / "c", verbose=False)
    assert c["hashes"]["bank"] != a["hashes"]["bank"]
    assert {k: c["hashes"][k] for k in ("manifest", "ownership", "tasks", "negatives")} == {
        k: a["hashes"][k] for k in ("manifest", "ownership", "tasks", "negatives")
    }  # the training seed changes the bank, never a protocol object
    d = train(compose([*over, "bank.pretrained=false"]), tmp_env / "d", verbose=False)
    assert d["tags"]["variant"] == "untrained" and d["bank"]["history"] == []
    saved = torch.load(a["bank"]["path"], weights_only=False)
    assert saved["hash"] == a["hashes"]["bank"] and saved["meta"]["encoder"] == "tgn"


@pytest.mark.slow
def test_bitcoin_prefix_bank_from_real_data(tmp_env, compose, shared_data, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    over = [
        "experiment=bank_bitcoin_alpha",
        "bank=tgat",
        "bank.epochs=1",
        "bank.max_events=3000",
        "logger=none",
    ]
    s = train(compose(over), tmp_env / "btc", verbose=False)
    assert s["table"]["events"] == 24_186 and s["tags"]["method"] == "tgat"
    # round(0.7 N) = 16,930 falls inside a day of equal timestamps: snapped to its end
    assert s["table"]["pre_train"] == 16_940
    assert (
        sum(
            s["table"][k]
            for k in ("pre_train", "pre_val", "sup_pool", "nn_excl", "down_val", "test")
        )
        == 24_186
    )
    assert 0.0 <= s["metrics"]["bank_val_auc"] <= 1.0


def test_cosine_score_is_what_eq10_uses():
    torch.manual_seed(0)
    hu, hi, hj = torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 4)
    pos = F.cosine_similarity(hu, hi, dim=-1) / 0.1
    neg = F.cosine_similarity(hu, hj, dim=-1) / 0.1
    ref = F.cross_entropy(torch.stack([pos, neg], 1), torch.zeros(5, dtype=torch.long))
    assert pretraining_loss(hu, hi, hj, 0.1).item() == pytest.approx(ref.item(), rel=1e-6)


def test_contexts_score_each_group_before_ingesting_it(tmp_env, compose):
    """Server contexts: the first batch of validation is scored from the bank snapshot itself;
    a client's first support event sees only the snapshot, its later ones its own support."""
    from fedlightning.data.temporal.manifest import DOWN_VAL
    from fedlightning.temporal.contexts import group_batches, load_bank, stream_contexts

    assert [b.tolist() for b in group_batches(np.array([0, 1, 1, 1, 2, 3]), np.arange(6), 2)] == [
        [0, 1, 2, 3],
        [4, 5],
    ]  # never splits the three events at t=1
    over = [*SHORT_BANK, "bank.max_events=2000", "logger=none"]
    summary = train(compose(over), tmp_env / "a", verbose=False)
    ctx = torch.load(summary["contexts"]["path"], weights_only=False)
    s = make_synthetic_stream(num_users=200, num_items=50, num_events=5000, seed=2026)
    m = build_manifest(s, seed=2026)
    val = m.indices(DOWN_VAL)
    assert torch.equal(ctx["down_val"]["events"], torch.from_numpy(val))
    enc = load_bank(summary["bank"]["path"], s)
    first = group_batches(s.t, val, 200)[0]
    with torch.no_grad():
        h = enc.embed(torch.from_numpy(s.src[first]), torch.from_numpy(s.t[first] - s.t[0]))
    assert torch.allclose(ctx["down_val"]["src"][: len(first)], h, atol=1e-6)
    assert ctx["test"]["src"].shape == (len(m.indices(5)), enc.out_dim)
    tau, clients = next(iter(ctx["tasks"].items()))
    k, c = next(iter(clients.items()))
    e0 = int(c["events"][0])
    with torch.no_grad():  # a fresh snapshot scores the client's first event alike
        h0 = load_bank(summary["bank"]["path"], s).embed(
            torch.tensor([s.src[e0]]), torch.tensor([s.t[e0] - s.t[0]])
        )
    assert torch.allclose(c["src"][0], h0[0], atol=1e-6)
    # a bank saved before its message stores were packed (a dict each) loads the same state
    from fedlightning.temporal.bank import MSG_STORES, unpack_store

    saved = torch.load(summary["bank"]["path"], weights_only=False)
    assert all(isinstance(saved[k], tuple) for k in MSG_STORES)  # packed: four columns
    old = {k: unpack_store(saved[k], s.num_nodes) for k in MSG_STORES}
    old = {k: {n: tuple(x.clone() for x in v) for n, v in d.items()} for k, d in old.items()}
    torch.save({**saved, **old}, tmp_env / "dict_stores.pt")
    nodes, times = torch.arange(s.num_nodes), torch.zeros(s.num_nodes, dtype=torch.long)
    states = []
    with torch.no_grad():
        for path in (summary["bank"]["path"], tmp_env / "dict_stores.pt"):
            bank = load_bank(path, s)
            stream_contexts(bank, s, val[:400], np.full(len(val[:400]), -1))  # pending messages
            states.append(bank.embed(nodes, times))
    assert torch.equal(*states)
    # recency at scoring time: the time since the node's last event in the bank's history
    e = int(ctx["down_val"]["events"][0])
    last = s.t[: m.bounds[1]][
        (s.src[: m.bounds[1]] == s.src[e]) | (s.dst[: m.bounds[1]] == s.src[e])
    ]
    expected = (s.t[e] - last.max()) if len(last) else s.t[e] - s.t[0]
    assert ctx["down_val"]["dt_src"][0].item() == pytest.approx(float(expected))
    assert ctx["down_val"]["t"][0].item() == pytest.approx(float(s.t[e] - s.t[0]))


def test_bank_run_logs_metrics_hashes_and_the_bank_to_mlflow(tmp_env, compose):
    from mlflow.tracking import MlflowClient

    over = [*SHORT_BANK, "bank.max_events=1500"]
    s = train(compose([*over, "bank.encoder=tgat"]), tmp_env / "run", verbose=False)
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([client.get_experiment_by_name("fedlightning/bank").experiment_id])
    assert run.data.tags["method"] == "tgat" and run.data.tags["hash_bank"] == s["hashes"]["bank"]
    assert run.data.tags["hash_manifest"] == s["hashes"]["manifest"]
    assert run.data.metrics["final/bank_val_auc"] == pytest.approx(s["metrics"]["bank_val_auc"])
    assert "curves/bank_val_ap" in run.data.metrics  # the per-epoch curve
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"manifest.json", "protocol.json", "summary.json"} <= arts
    assert any(a.endswith(".pt") for a in arts)
