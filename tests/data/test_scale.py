"""Large-graph set-up: the per-block synthetic generator, METIS partitions, in-place missing
modalities, set-up progress, and the shipped configs' graphs and partitions unchanged."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlightning.data.graphs import make_synthetic
from fedlightning.data.graphs.base import apply_missing
from fedlightning.data.graphs.synthetic import _block_pairs
from fedlightning.data.partition import LouvainPartitioner, MetisPartitioner


def graph_digest(g) -> str:
    """sha256 of the structure, labels, every feature value and the mask (first 16 hex)."""
    h = hashlib.sha256(g.fingerprint().encode())
    for m, x in g.features.items():
        h.update(m.encode())
        h.update((x.to_dense() if x.is_sparse else x).numpy().tobytes())
    h.update(g.mask.numpy().tobytes())
    return h.hexdigest()[:16]


# Recorded from the code before the large-graph paths existed (commit 3ae8fdc): the shipped
# configs must keep their graphs, partitions and streams bit for bit.
@pytest.mark.parametrize(
    "overrides, graph, hashes",
    [
        (
            ["experiment=fl_synthetic", "algorithm=fedavg"],
            "24c162d5dc4e3c0f",
            {"partition": "0bc4a143c8a92c1e"},
        ),
        (
            ["experiment=demo"],
            "7c2aea57812d64d7",
            {"partition": "0bc4a143c8a92c1e", "stream": "9aa90fd37c6fff67"},
        ),
    ],
)
def test_shipped_configs_keep_their_graph_and_protocol_hashes(
    compose, tmp_path, overrides, graph, hashes
):
    from fedlightning.programs.graph_program import build_protocol, load_graph

    cfg = compose([*overrides, "protocol.cache_dir=null"])
    g = load_graph(cfg)
    _, _, got = build_protocol(cfg, g, Path(tmp_path), False)
    assert graph_digest(g) == graph and got == hashes


def test_auto_sampler_keeps_the_per_pair_graph_up_to_the_threshold():
    kw = dict(num_nodes=800, num_classes=4, p_in=0.03, p_out=0.003, seed=3)
    auto, pairs = make_synthetic(**kw), make_synthetic(**kw, sampler="pairs")
    assert torch.equal(auto.edge_index, pairs.edge_index)
    blocks = make_synthetic(**kw, sampler="blocks")
    assert torch.equal(blocks.y, pairs.y)  # labels: the same stream
    assert not torch.equal(blocks.edge_index, pairs.edge_index)
    # features: torch's float32 draws around the same class means (other values)
    fast, slow = blocks.features["text"], pairs.features["text"]
    assert fast.dtype == slow.dtype == torch.float32 and fast.shape == slow.shape
    assert not torch.equal(fast, slow)
    for c in range(4):
        rows = blocks.y == c
        assert (fast[rows].mean(0) - slow[rows].mean(0)).abs().max() < 0.5


def test_fast_gaussian_features_follow_their_class_means_and_noise():
    g = make_synthetic(
        num_nodes=4000, num_classes=2, modalities={"a": 16}, p_in=0.0, p_out=0.0,
        signal=2.0, noise=0.5, seed=5, sampler="blocks",
    )  # fmt: skip
    again = make_synthetic(
        num_nodes=4000, num_classes=2, modalities={"a": 16}, p_in=0.0, p_out=0.0,
        signal=2.0, noise=0.5, seed=5, sampler="blocks",
    )  # fmt: skip
    x = g.features["a"]
    assert torch.equal(x, again.features["a"])  # seeded
    for c in range(2):
        rows = x[g.y == c]  # 2,000 rows: the noise's standard deviation
        centred = rows - rows.mean(0)
        assert abs(float(centred.std()) - 0.5) < 0.02
    assert (x[g.y == 0].mean(0) - x[g.y == 1].mean(0)).abs().max() > 0.1


def test_block_sampler_follows_the_block_model():
    n, c, p_in, p_out = 6000, 3, 0.01, 0.001
    g = make_synthetic(num_nodes=n, num_classes=c, p_in=p_in, p_out=p_out, seed=1, sampler="blocks")
    src, dst = g.edge_index
    assert not (src == dst).any()
    pairs = set(map(tuple, g.edge_index.t().tolist()))
    assert pairs == {(b, a) for a, b in pairs} and len(pairs) == src.numel()  # no duplicates
    within_pairs = c * math.comb(n // c, 2)  # 5,997,000 pairs, x 0.01 = 59,970 edges
    between_pairs = math.comb(n, 2) - within_pairs  # 11,997,000 pairs, x 0.001 = 11,997
    intra = int((g.y[src] == g.y[dst]).sum()) // 2
    inter = g.num_edges - intra
    for got, mean, p in ((intra, within_pairs * p_in, p_in), (inter, between_pairs * p_out, p_out)):
        assert abs(got - mean) < 5 * math.sqrt(mean * (1 - p))  # binomial: 5 standard deviations
    same = make_synthetic(
        num_nodes=n, num_classes=c, p_in=p_in, p_out=p_out, seed=1, sampler="blocks"
    )
    assert torch.equal(same.edge_index, g.edge_index)  # seeded


@pytest.mark.parametrize("cols", [None, 5])
def test_block_pairs_are_distinct_and_uniform(cols):
    rows, m, draws = 6, 4, 3000
    space = math.comb(rows, 2) if cols is None else rows * cols  # 15 or 30 pairs
    rng = np.random.default_rng(0)
    counts = np.zeros((rows, cols or rows), dtype=np.int64)
    for _ in range(draws):
        i, j = _block_pairs(rows, cols, m, rng)
        assert i.size == m and len(set(zip(i.tolist(), j.tolist(), strict=True))) == m
        if cols is None:
            assert (i < j).all()
        np.add.at(counts, (i, j), 1)
    seen = counts[np.triu_indices(rows, 1)] if cols is None else counts.ravel()
    assert seen.size == space
    # A uniform m-subset holds each pair w.p. m / space: 3000 * 4/15 = 800 or 3000 * 4/30 = 400.
    expected = draws * m / space
    assert np.abs(seen - expected).max() < 5 * math.sqrt(expected)


def test_sampler_is_checked():
    with pytest.raises(ValueError, match="sampler must be"):
        make_synthetic(sampler="fast")


def test_in_place_missing_gives_the_same_graph():
    g = make_synthetic(num_nodes=300, missing_rate=0.0, seed=4)
    copy = apply_missing(g, 0.3, seed=9)
    text = g.features["text"]
    same = apply_missing(g, 0.3, seed=9, inplace=True)
    assert same.features["text"] is text  # no second copy
    assert graph_digest(copy) == graph_digest(same)
    assert (same.features["text"][~same.mask[:, 0]] == 0).all()


def test_metis_partition_is_seeded_balanced_and_cut_along_the_blocks():
    g = make_synthetic(num_nodes=4000, num_classes=4, p_in=0.01, p_out=0.0002, seed=2)
    a, b = MetisPartitioner()(g, 4, seed=5), MetisPartitioner()(g, 4, seed=5)
    assert a.hash == b.hash and torch.equal(a.assignment, b.assignment)
    sizes = torch.bincount(a.assignment, minlength=4)
    assert int(sizes.max()) <= 1.05 * 1000  # METIS's default imbalance is 3%
    src, dst = g.edge_index
    cut = (a.assignment[src] != a.assignment[dst]).float().mean().item()
    # Expected edges: between classes 6,000,000 pairs x 0.0002 = 1,200, within 4 x C(1000, 2)
    # x 0.01 = 19,980; a cut along the classes cuts 1,200 / 21,180 = 5.7% of them.
    assert cut < 0.1
    assert a.meta["method"] == "metis"


def test_louvain_hands_large_graphs_to_metis_and_keeps_small_ones(caplog):
    g = make_synthetic(num_nodes=600, seed=0)
    small = LouvainPartitioner()(g, 3, seed=0)
    assert small.meta["method"] == "louvain" and small.meta["params"] == {"resolution": 1.0}
    with caplog.at_level(logging.INFO, logger="fedlightning.data"):
        large = LouvainPartitioner(large_above=500)(g, 3, seed=0)
    assert large.hash == MetisPartitioner()(g, 3, seed=0).hash
    assert any("METIS instead of Louvain" in r.getMessage() for r in caplog.records)
    kept = LouvainPartitioner(large_above=500, large_method="louvain")(g, 3, seed=0)
    assert kept.hash == small.hash


def test_large_set_up_steps_show_progress(caplog):
    with caplog.at_level(logging.INFO, logger="fedlightning.data"):
        make_synthetic(num_nodes=12_000, num_classes=3, p_in=0.001, p_out=0.0001, sampler="blocks")
    lines = [r.getMessage() for r in caplog.records]
    assert "graph edges (per block): 6 blocks" in lines
    assert any(m.startswith("graph edges (per block) done: 6 blocks in ") for m in lines)


@pytest.mark.slow
def test_every_run_reports_its_peak_memory_in_the_summary_and_mlflow(tmp_env, compose):
    """(A run's memory is the scaling work's third measure beside set-up and round time.)"""
    import resource

    from mlflow.tracking import MlflowClient

    from fedlightning.train import train

    small = ["federation.rounds=1", "federation.local_epochs=1", "dataset.num_nodes=300"]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB
    s = train(
        compose(["experiment=fl_synthetic", "algorithm=fedavg", *small]),
        tmp_env / "run",
        verbose=False,
    )
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert before <= s["peak_rss_mib"] <= after
    client = MlflowClient(f"sqlite:///{tmp_env / 'mlflow.db'}")
    run_id = json.loads((tmp_env / "run" / "mlflow_run.json").read_text())["run_id"]
    assert client.get_run(run_id).data.metrics["final/peak_rss_mib"] == s["peak_rss_mib"]


def test_clean_edges_is_pyg_to_undirected_and_coalesce():
    from torch_geometric.utils import coalesce, remove_self_loops, to_undirected

    from fedlightning.data.graphs.base import clean_edges

    for seed, (n, e) in enumerate([(1, 3), (2, 0), (7, 40), (300, 5000), (5000, 60000)]):
        ei = torch.randint(0, n, (2, e), generator=torch.Generator().manual_seed(seed))
        want, _ = remove_self_loops(ei)
        want = coalesce(to_undirected(want, num_nodes=n), num_nodes=n)
        assert torch.equal(clean_edges(ei, n), want)


def test_split_gives_each_parts_subgraph_in_one_pass():
    g = make_synthetic(
        num_nodes=1500, num_classes=4, modalities={"a": 8, "b": 5}, multi_hot={"w": 40},
        p_in=0.02, p_out=0.002, missing_rate=0.2, seed=1,
    )  # fmt: skip
    assignment = torch.randint(-1, 6, (1500,), generator=torch.Generator().manual_seed(0))
    parts = g.split(assignment, 5)  # part 5 and -1: nodes of no part
    assert len(parts) == 5
    for k, got in enumerate(parts):
        want = g.subgraph((assignment == k).nonzero().squeeze(1))
        assert torch.equal(got.edge_index, want.edge_index) and got.edge_index.is_contiguous()
        assert torch.equal(got.y, want.y) and torch.equal(got.mask, want.mask)
        assert torch.equal(got.features["a"], want.features["a"])
        assert torch.equal(got.features["b"], want.features["b"])
        assert torch.equal(got.features["w"].to_dense(), want.features["w"].to_dense())
    # the parts' dense rows are adjacent rows of one tensor
    base = parts[0].features["a"].untyped_storage().data_ptr()
    assert all(p.features["a"].untyped_storage().data_ptr() == base for p in parts)


def test_split_with_release_drops_the_graphs_dense_rows_and_gives_the_same_parts():
    """``release=True``: the same parts, in the same modality order; the graph keeps its
    sparse modality and no longer holds the dense ones (each freed once gathered)."""
    kw = dict(num_nodes=600, num_classes=3, modalities={"a": 8, "b": 5}, multi_hot={"w": 40},
              p_in=0.02, p_out=0.002, missing_rate=0.2, seed=2)  # fmt: skip
    g, h = make_synthetic(**kw), make_synthetic(**kw)
    assignment = torch.randint(0, 4, (600,), generator=torch.Generator().manual_seed(1))
    want, got = g.split(assignment, 4), h.split(assignment, 4, release=True)
    assert list(h.features) == ["w"] and list(g.features) == ["a", "b", "w"]
    for a, b in zip(want, got, strict=True):
        assert list(b.features) == list(a.features)
        assert torch.equal(a.features["a"], b.features["a"])
        assert torch.equal(a.features["b"], b.features["b"])
        assert torch.equal(a.features["w"].to_dense(), b.features["w"].to_dense())
