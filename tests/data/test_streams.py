import pytest
import torch

from fedlightning.data.graphs import make_synthetic
from fedlightning.data.partition import RandomPartitioner
from fedlightning.data.streams import ClassIncrementalStream, ClassStream
from fedlightning.errors import ConfigError


@pytest.fixture(scope="module")
def setting():
    g = make_synthetic(num_nodes=400, num_classes=6, seed=0)
    return g, RandomPartitioner()(g, 4, seed=0)


def test_stages_known_unknown_and_observed(setting):
    g, part = setting
    s = ClassIncrementalStream([2, 1, 1, 1], client_fraction=0.5)(g, part, seed=3)
    assert [len(x) for x in s.stages] == [2, 1, 1, 1] and len(s.never) == 1
    assert sorted([c for st in s.stages for c in st] + s.never) == list(range(6))
    assert s.known(0) == sorted(s.stages[0])
    assert s.known(3) == sorted(set(range(6)) - set(s.never))
    cs = s.class_stage(6)
    assert cs[s.never[0]] == -1 and all(cs[c] == t for t, st in enumerate(s.stages) for c in st)
    for t, new in enumerate(s.stages):
        for c in new:  # every new class is observed by at least one client
            assert any(c in s.observed[k][t] for k in range(4))
        for k in range(4):  # a client observes only new classes; ceil(0.5 * 2) = 1 at stage 0
            assert set(s.observed[k][t]) <= set(new)
            if t == 0:
                assert len(s.observed[k][t]) >= 1


def test_same_seed_same_hash_other_seed_other_order(setting, tmp_path):
    g, part = setting
    a = ClassIncrementalStream([2, 1, 1])(g, part, seed=1)
    b = ClassIncrementalStream([2, 1, 1])(g, part, seed=1)
    assert a.hash == b.hash
    orders = {
        tuple(map(tuple, ClassIncrementalStream([2, 1, 1])(g, part, seed=s).stages))
        for s in range(6)
    }
    assert len(orders) > 1
    a.save(tmp_path / "s.json")
    assert ClassStream.load(tmp_path / "s.json").hash == a.hash


def test_fraction_one_observes_all_present_classes(setting):
    g, part = setting
    s = ClassIncrementalStream([3, 2], client_fraction=1.0)(g, part, seed=0)
    for k in range(4):
        nodes = (part.assignment == k) & (part.split == 0)
        present = set(g.y[nodes].tolist())
        for t, new in enumerate(s.stages):
            assert set(s.observed[k][t]) == present & set(new)


@pytest.mark.parametrize(
    ("stages", "fraction", "key"),
    [
        ([1, 1], 1.0, "stages"),
        ([2, 2, 2], 1.0, "stages"),
        ([2, 1], 0.0, "client_fraction"),
        ([], 1.0, "stages"),
    ],
)
def test_bad_streams_name_the_key(setting, stages, fraction, key):
    g, part = setting
    with pytest.raises(ConfigError, match=f"protocol.stream.{key}"):
        ClassIncrementalStream(stages, client_fraction=fraction)(g, part, seed=0)


def test_known_mask(setting):
    g, part = setting
    s = ClassIncrementalStream([2, 2])(g, part, seed=0)
    m = s.known_mask(0, 6)
    assert m.sum() == 2 and torch.equal(m.nonzero().squeeze(1), torch.tensor(s.known(0)))
