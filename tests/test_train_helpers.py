import json
import math

import pytest
from omegaconf import OmegaConf

from fedlightning.algorithms.continual import ContinualFedAvg
from fedlightning.data.graphs import make_synthetic
from fedlightning.data.partition import RandomPartitioner
from fedlightning.errors import ConfigError, FedLightningError
from fedlightning.train import json_safe, prepare_run_dir, save_protocol


def test_resume_refuses_a_finished_run_and_a_non_run(tmp_path):
    cfg = OmegaConf.create({"resume": str(tmp_path), "runner": {}, "logger": {}})
    with pytest.raises(ConfigError, match="resume"):
        prepare_run_dir(cfg, tmp_path / "new")  # no config.yaml there
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="already finished"):
        prepare_run_dir(cfg, tmp_path / "new")


def test_resume_refuses_a_changed_protocol(tmp_path):
    g = make_synthetic(num_nodes=100, num_classes=3, seed=0)
    part = RandomPartitioner()(g, 2, seed=0)
    path = tmp_path / "partition.json"
    save_protocol(part, path, resuming=False)
    save_protocol(part, path, resuming=True)  # same hash: accepted, file untouched
    other = RandomPartitioner()(g, 2, seed=1)
    with pytest.raises(FedLightningError, match="refusing to resume"):
        save_protocol(other, path, resuming=True)
    assert json.loads(path.read_text())["hash"] == part.hash


def test_json_safe_turns_non_finite_into_null():
    out = json_safe({"a": math.nan, "b": [1.0, math.inf], "c": {"d": 2}})
    assert out == {"a": None, "b": [1.0, None], "c": {"d": 2}}
    json.dumps(out, allow_nan=False)


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"distill_on": "all"}, "algorithm.distill_on"),
        ({"lambda_dis": -1}, "algorithm.lambda_dis"),
        ({"tau": 0}, "algorithm.tau"),
        ({"replay_budget": -1}, "algorithm.replay_budget"),
    ],
)
def test_continual_algorithm_errors_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        ContinualFedAvg(**kw)
