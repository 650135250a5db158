import re

import pytest
import torch

from fedlightning.data.graphs import make_synthetic
from fedlightning.data.partition import RandomPartitioner
from fedlightning.data.streams import (
    ClassIncrementalStream,
    ClassStream,
    check_stages,
    config_num_classes,
)
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


# ------------------------------------------------------------------------------------------
# the stage rules, from the config alone


@pytest.mark.parametrize(
    ("stages", "num_classes", "expected"),
    [
        ([2, 1, 1], 5, [2, 1, 1]),
        ([2, 1], 4, [2, 1]),  # with 4 classes the only two-stage layout
        ([3], 4, [3]),
        ((2.0, 1), None, [2, 1]),  # integral floats are counts
        ([5, 1, 1, 1, 1], None, [5, 1, 1, 1, 1]),  # without C, only the layout is checked
    ],
)
def test_check_stages_accepts(stages, num_classes, expected):
    assert check_stages(stages, num_classes) == expected


@pytest.mark.parametrize(
    ("stages", "num_classes", "text"),
    [
        ([1, 1, 1], 4, "first stage of >= 2"),  # the case of the issue: refused before loading
        ([2, 0, 1], None, ">= 1 class per later stage"),
        ([], None, "first stage"),
        ([2, 2], 4, "at most 3 in all, e.g. [2, 1]"),  # one class must stay unknown
        ([2, 1, 1, 1], 5, "at least one must stay unknown"),
        ([2], 2, "needs >= 3"),
        ("2,1", None, "a list"),
        (3, None, "a list"),
        ([2, "a"], None, "integer class counts"),
        ([2, 1.5], None, "integer class counts"),
        ([True, 1], None, "integer class counts"),
    ],
)
def test_check_stages_refuses_with_one_line_naming_the_key(stages, num_classes, text):
    with pytest.raises(ConfigError, match=re.escape(text)) as e:
        check_stages(stages, num_classes)
    assert str(e.value).startswith("config `protocol.stream.stages`: ")
    assert "\n" not in str(e.value)


def test_check_stages_takes_a_listconfig_and_the_stream_keeps_the_rule(setting):
    from omegaconf import OmegaConf

    assert check_stages(OmegaConf.create({"s": [2, 1]}).s, 4) == [2, 1]
    g, part = setting  # 6 classes: the graph's name appears once the classes are read
    with pytest.raises(ConfigError, match=f"{g.name!r} has 6"):
        ClassIncrementalStream([3, 3])(g, part, seed=0)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["dataset=synthetic"], 5),
        (["dataset=synthetic", "dataset.num_classes=4"], 4),
        (["dataset=cora"], 7),
        (["dataset=citeseer"], 6),
        (["dataset=citeseer_mm"], 6),
        (["dataset=folder"], None),
        (["dataset=magb"], None),
    ],
)
def test_config_num_classes(compose, overrides, expected):
    assert config_num_classes(compose(overrides).dataset) == expected
