"""The pieces behind one-line refusals, fast: protocols with nothing to learn, Hydra's and
YAML's errors as one line, and the stage-end fault injection."""

from __future__ import annotations

import pytest
import torch
import yaml

from fedlightning.cli import hydra_error_line, yaml_error_line
from fedlightning.data.partition import TEST, TRAIN, VAL, Partition, check_trainable
from fedlightning.errors import ConfigError


def partition(assignment: list[int], split: list[int]) -> Partition:
    meta = {"num_clients": max(assignment) + 1, "split_fractions": [0.5, 0.25, 0.25]}
    return Partition(torch.tensor(assignment), torch.tensor(split), meta)


def test_a_client_without_training_nodes_is_named():
    # client 0: nodes 0-1 (one training node); client 1: nodes 2-4, none of them training
    part = partition([0, 0, 1, 1, 1], [TRAIN, VAL, VAL, TEST, TEST])
    with pytest.raises(ConfigError, match=r"partition\.split.*client 1 of 2.*\(3 nodes"):
        check_trainable(part, torch.tensor([0, 1, 0, 1, 0]), "g")


def test_one_class_among_training_nodes_is_refused():
    part = partition([0, 0, 1, 1], [TRAIN, TEST, TRAIN, TEST])
    # two classes in the graph, but the training nodes (0 and 2) are all of class 1
    with pytest.raises(ConfigError, match=r"`dataset`.*'g' has 1 class.*\[1\]"):
        check_trainable(part, torch.tensor([1, 0, 1, 0]), "g")
    check_trainable(part, torch.tensor([1, 0, 0, 0]), "g")  # classes 1 and 0: trainable


def test_hydra_composition_errors_are_one_line_with_close_names(compose):
    from hydra.errors import HydraException

    with pytest.raises(HydraException) as e:
        compose(["experiment=fl_cra"])
    line = hydra_error_line(e.value)
    assert line.startswith("config `experiment`: no option 'fl_cra'")
    assert "did you mean fl_cora" in line and "\n" not in line
    with pytest.raises(HydraException) as e:
        compose(["federation.rounds=["])
    line = hydra_error_line(e.value)
    assert line.startswith("override 'federation.rounds=['") and "\n" not in line


def test_yaml_errors_name_file_line_and_column(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("experiment: x\nspace: [a, b\nseeds: 1\n")
    with pytest.raises(yaml.YAMLError) as e, bad.open() as f:
        yaml.safe_load(f)
    line = yaml_error_line(e.value)
    # the flow sequence opened on line 2 meets `:` at line 3, column 6
    assert line.startswith(f"{bad}: not valid YAML (line 3, column 6:"), line


def test_kill_at_reads_round_client_and_kind():
    from fedlightning.federation.executors import LeanExecutor
    from fedlightning.federation.runners import SequentialRunner

    assert SequentialRunner(LeanExecutor(), kill_at="3:2").kill_at == (3, 2, None)
    runner = SequentialRunner(LeanExecutor(), kill_at="2:1:stage_end")
    assert (runner.kill_at, runner.kill_times) == ((2, 1, "stage_end"), 1)
    runner = SequentialRunner(LeanExecutor(), kill_at="1:2:task_fit:3")
    assert (runner.kill_at, runner.kill_times) == ((1, 2, "task_fit"), 3)
