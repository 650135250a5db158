import json

import networkx as nx
import numpy as np
import pytest
import torch

from fedlightning.data.graphs.base import MultimodalGraph, clean_edges, full_mask
from fedlightning.data.partition import (
    TEST,
    TRAIN,
    VAL,
    DirichletPartitioner,
    LouvainPartitioner,
    Partition,
    RandomPartitioner,
    client_splits,
    fill_small_clients,
    merge_communities,
)
from fedlightning.errors import ConfigError, DataError


def _caveman(cliques=6, size=20):
    g = nx.connected_caveman_graph(cliques, size)
    ei = clean_edges(torch.tensor(list(g.edges())).t(), g.number_of_nodes())
    n = g.number_of_nodes()
    y = torch.arange(n) // size % 3
    return MultimodalGraph(
        "caveman", {"x": torch.randn(n, 4)}, full_mask(n, 1), ei, y, ["a", "b", "c"]
    )


def test_merge_communities_hand_case():
    comms = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9], [10]]
    # 5 -> c0, 3 -> c1, 2 -> c1 (c1 has 3 < 5), 1 -> c0? sizes c0=5, c1=5 -> tie -> c0
    assert merge_communities(comms, 2) == [0] * 5 + [1] * 5 + [0]


def test_louvain_recovers_cliques_and_is_deterministic(tmp_path):
    g = _caveman()
    p1 = LouvainPartitioner()(g, 3, seed=7)
    p2 = LouvainPartitioner()(g, 3, seed=7)
    assert torch.equal(p1.assignment, p2.assignment) and p1.hash == p2.hash
    # each 20-node clique lies inside one client; 6 cliques over 3 clients -> 40 each
    for c in range(6):
        assert p1.assignment[c * 20 : (c + 1) * 20].unique().numel() == 1
    assert torch.bincount(p1.assignment).tolist() == [40, 40, 40]


def test_hash_changes_with_inputs_but_not_with_nothing():
    g = _caveman()
    h = RandomPartitioner()(g, 3, seed=0).hash
    assert RandomPartitioner()(g, 3, seed=0).hash == h
    assert RandomPartitioner()(g, 3, seed=1).hash != h
    assert RandomPartitioner()(g, 4, seed=0).hash != h


def test_splits_are_60_20_20_per_client_and_disjoint():
    assignment = torch.tensor([0] * 50 + [1] * 30)
    split = client_splits(assignment, (0.6, 0.2, 0.2), seed=3)
    for k, n in ((0, 50), (1, 30)):
        s = split[assignment == k]
        assert [(s == x).sum().item() for x in (TRAIN, VAL, TEST)] == [
            round(0.6 * n),
            round(0.2 * n),
            n - round(0.6 * n) - round(0.2 * n),
        ]
    assert torch.equal(split, client_splits(assignment, (0.6, 0.2, 0.2), seed=3))
    assert not torch.equal(split, client_splits(assignment, (0.6, 0.2, 0.2), seed=4))


def test_cache_reuse_and_tamper_detection(tmp_path):
    g = _caveman()
    part = LouvainPartitioner(cache_dir=str(tmp_path))(g, 3, seed=1)
    files = list(tmp_path.glob("partition-*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    again = LouvainPartitioner(cache_dir=str(tmp_path))(g, 3, seed=1)
    assert again.hash == part.hash and files[0].stat().st_mtime_ns == mtime  # reused, not rewritten
    obj = json.loads(files[0].read_text())
    obj["assignment"][0] = 2 if obj["assignment"][0] != 2 else 1
    files[0].write_text(json.dumps(obj))
    with pytest.raises(DataError, match="hash"):
        Partition.load(files[0])


def test_saved_manifest_roundtrip(tmp_path):
    part = RandomPartitioner()(_caveman(), 4, seed=5)
    part.save(tmp_path / "p.json")
    back = Partition.load(tmp_path / "p.json")
    assert back.hash == part.hash and torch.equal(back.split, part.split)


def test_too_many_clients_names_the_key():
    g = _caveman()
    with pytest.raises(ConfigError, match="federation.clients"):
        LouvainPartitioner()(g, 7, seed=0)  # 6 communities only
    with pytest.raises(ConfigError, match="federation.clients"):
        RandomPartitioner()(g, 13, seed=0)  # 120 nodes < 13 * 10
    with pytest.raises(ConfigError, match="federation.clients"):
        RandomPartitioner()(g, 0, seed=0)


def test_bad_split_fractions():
    with pytest.raises(ConfigError, match="partition.split"):
        RandomPartitioner(split=(0.5, 0.2, 0.2))


def test_real_cora_louvain(shared_data):
    from fedlightning.data.graphs import load_planetoid

    g = load_planetoid("cora", root=shared_data)
    part = LouvainPartitioner()(g, 5, seed=0)
    sizes = torch.bincount(part.assignment, minlength=5)
    assert sizes.sum() == 2708 and sizes.min() > 300  # merged communities are near balanced
    assert LouvainPartitioner()(g, 5, seed=0).hash == part.hash


# ------------------------------------------------------------------------------------------
# Dirichlet label skew


def _labelled(n=1200, classes=4):
    """A graph without edges whose labels cycle 0..C-1 (balanced classes)."""
    y = torch.arange(n) % classes
    return MultimodalGraph(
        "labelled",
        {"x": torch.zeros(n, 1)},
        full_mask(n, 1),
        torch.zeros(2, 0, dtype=torch.long),
        y,
        [f"c{i}" for i in range(classes)],
    )


def _proportions(g, part):
    """Label proportions per client, ``[K, C]``."""
    counts = torch.zeros(part.num_clients, g.num_classes)
    counts.index_put_((part.assignment, g.y), torch.ones(g.num_nodes), accumulate=True)
    return counts / counts.sum(1, keepdim=True)


def test_dirichlet_large_alpha_is_near_uniform_small_alpha_is_skewed():
    g = _labelled()
    flat = _proportions(g, DirichletPartitioner(alpha=1e4)(g, 5, seed=0))
    assert (flat - 0.25).abs().max() < 0.05  # every client about the global 1/4 per class
    skew = _proportions(g, DirichletPartitioner(alpha=0.05)(g, 5, seed=0))
    assert skew.max(1).values.mean() > 0.8  # a client is mostly one class
    assert (skew - 0.25).abs().max() > 0.5


def test_dirichlet_is_seeded_materialized_and_hashed(tmp_path):
    g = _labelled()
    a = DirichletPartitioner(alpha=0.5, cache_dir=str(tmp_path))(g, 4, seed=3)
    b = DirichletPartitioner(alpha=0.5)(g, 4, seed=3)
    assert torch.equal(a.assignment, b.assignment) and a.hash == b.hash
    assert a.meta["method"] == "dirichlet" and a.meta["params"] == {"alpha": 0.5}
    assert len(list(tmp_path.glob("partition-*.json"))) == 1  # cached like the others
    assert Partition.load(next(tmp_path.glob("partition-*.json"))).hash == a.hash
    assert DirichletPartitioner(alpha=0.5)(g, 4, seed=4).hash != a.hash  # protocol seed
    assert DirichletPartitioner(alpha=0.3)(g, 4, seed=3).hash != a.hash  # alpha
    assert RandomPartitioner()(g, 4, seed=3).hash != a.hash


def test_dirichlet_every_client_keeps_ten_nodes():
    g = _labelled(n=200, classes=2)
    for seed in range(5):  # tiny alpha: most clients draw no node at all before the repair
        part = DirichletPartitioner(alpha=0.001)(g, 10, seed=seed)
        sizes = torch.bincount(part.assignment, minlength=10)
        assert sizes.min() >= 10 and sizes.sum() == 200
        for k in range(10):  # and every client splits into train/val/test as usual
            n_k = int(sizes[k])
            assert (part.split[part.assignment == k] == TRAIN).sum() == round(0.6 * n_k)


def test_fill_small_clients_by_hand():
    # Client 0 holds nodes 0-5 (labels 0,0,0,1,1,0), client 1 holds nothing; minimum 2.
    owner = np.zeros(6, dtype=np.int64)
    y = np.array([0, 0, 0, 1, 1, 0])
    fill_small_clients(owner, y, 2, 2)
    # Twice: the donor's most frequent class is 0, its highest-numbered node 5, then 2.
    assert owner.tolist() == [0, 0, 1, 0, 0, 1]


@pytest.mark.parametrize("alpha", [0, -1.0, float("inf"), "a", True])
def test_dirichlet_bad_alpha_names_the_key(alpha):
    with pytest.raises(ConfigError, match="partition.alpha"):
        DirichletPartitioner(alpha=alpha)


def test_dirichlet_config(compose):
    from hydra.utils import instantiate

    part = instantiate(compose(["partition=dirichlet", "partition.alpha=2"]).partition)
    assert isinstance(part, DirichletPartitioner) and part.alpha == 2.0
