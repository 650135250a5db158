"""The history graph of the pre-training segment: its edges are exactly H_pre's events, its
bank features are the snapshot's states, its raw features by hand, its hash and its cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedlightning.data.temporal import make_synthetic_stream
from fedlightning.data.temporal.manifest import PRETRAIN, PREVAL
from fedlightning.data.temporal.protocol import build_temporal_protocol
from fedlightning.methods.history.history import (
    HistoryGraph,
    build_history,
    cached_history,
    history_events,
    raw_features,
)
from fedlightning.methods.history.history_baseline import both_ways
from fedlightning.temporal.bank import BankConfig, build_snapshot, pretrain

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def setup():
    s = make_synthetic_stream(num_users=40, num_items=12, num_events=1500, seed=3)
    proto = build_temporal_protocol(s, {"seed": 5, "tasks": {"num_tasks": 2, "support": 10}})
    m = proto.manifest
    cfg = BankConfig(pretrained=False, memory_dim=16, time_dim=8, embedding_dim=16)
    torch.manual_seed(0)
    enc, _ = pretrain(s, m.indices(PRETRAIN), m.indices(PREVAL), cfg, seed=0)
    build_snapshot(enc, s, m.indices(PRETRAIN), m.indices(PREVAL), cfg, seed=0)
    enc.eval()
    return s, proto, enc


def test_edges_are_the_pretraining_events_only(setup):
    s, proto, enc = setup
    g = build_history(proto, enc)
    pre = np.flatnonzero(proto.manifest.outcome == PRETRAIN)
    assert g.num_edges == len(pre) and np.array_equal(g.events.numpy(), pre)
    assert np.array_equal(g.edge_index[0].numpy(), s.src[pre])
    assert np.array_equal(g.edge_index[1].numpy(), s.dst[pre])
    assert np.array_equal(g.t.numpy(), (s.t[pre] - s.t[0]).astype(np.float64))
    later = np.flatnonzero(proto.manifest.outcome > PREVAL)  # downstream events: never edges
    assert not np.isin(g.events.numpy(), later).any()
    both = build_history(proto, enc, segments=("pretrain", "preval"))
    assert both.num_edges == len(pre) + int((proto.manifest.outcome == PREVAL).sum())
    assert np.array_equal(g.users, np.arange(40)) and np.array_equal(g.items, np.arange(40, 52))
    with pytest.raises(ValueError, match="segments"):
        history_events(proto.manifest, ("test",))


def test_bank_features_are_the_snapshot_states(setup):
    s, proto, enc = setup
    g = build_history(proto, enc)
    assert g.x.shape == (s.num_nodes, enc.out_dim)
    t_ref = int(s.t[proto.manifest.bounds[1] - 1] - s.t[0])
    with torch.no_grad():
        for v in (0, 7, 45):  # one node at a time, independently of the batched pass
            h = enc.embed(torch.tensor([v]), torch.tensor([t_ref]))
            assert torch.allclose(g.x[v], h[0], atol=1e-6)
    assert not enc.training


def test_raw_features_by_hand():
    s = make_synthetic_stream(num_users=3, num_items=2, num_events=6, feature_dim=2, seed=0)
    events = np.array([0, 2, 3])
    x = raw_features(s, events)
    for v in range(s.num_nodes):
        mine = [e for e in events if s.src[e] == v or s.dst[e] == v]
        assert x[v, 0].item() == pytest.approx(np.log1p(len(mine)))
        want = s.msg[mine].mean(0) if mine else np.zeros(2)
        assert np.allclose(x[v, 1:].numpy(), want, atol=1e-6)


def test_graph_helpers_by_hand():
    ei = torch.tensor([[0, 0, 1, 0], [2, 3, 2, 2]])  # the pair (0, 2) twice
    g = HistoryGraph(
        np.array([0, 1]), np.array([2, 3]), ei, torch.zeros(4), torch.arange(4), torch.zeros(4, 1)
    )
    assert g.degree().tolist() == [3, 1, 3, 1]
    und = {tuple(p) for p in both_ways(g.edge_index).t().tolist()}
    assert und == {(0, 2), (2, 0), (0, 3), (3, 0), (1, 2), (2, 1)}
    assert g.edges_of(np.array([1])).tolist() == [2]


def test_hash_follows_the_content_and_the_cache_reuses_it(setup, tmp_path):
    s, proto, enc = setup
    a, path, reused = cached_history(proto, enc, tmp_path)
    assert not reused and path.exists()
    b, path_b, reused_b = cached_history(proto, enc, tmp_path)
    assert reused_b and path_b == path and b.hash == a.hash
    assert torch.equal(a.x, b.x) and torch.equal(a.edge_index, b.edge_index)
    assert build_history(proto, enc).hash == a.hash  # deterministic
    raw = build_history(proto, None, features="raw")
    assert raw.hash != a.hash
    changed = HistoryGraph(a.users, a.items, a.edge_index[:, 1:], a.t[1:], a.events[1:], a.x)
    changed.params = a.params
    assert changed.hash != a.hash
    saved = torch.load(path, weights_only=False)  # a tampered cache file is rebuilt
    saved["x"] = saved["x"] + 1
    torch.save(saved, path)
    c, _, reused_c = cached_history(proto, enc, tmp_path)
    assert not reused_c and c.hash == a.hash
    with pytest.raises(ValueError, match="features"):
        build_history(proto, enc, features="ids")
