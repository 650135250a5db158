"""A user's own data, as issue 21 brings it: a temporal protocol composed without an
experiment, and a label-free interaction stream through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedlightning.data.temporal import make_synthetic_stream
from fedlightning.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
FL = str(Path(sys.executable).parent / "fedlightning")


def write_label_free(path: Path, num_events: int = 20000) -> Path:
    """A `src dst time` file (no labels, no features) from the synthetic stream, users and
    items in one id space (items numbered after the users): a who-rates-whom list."""
    s = make_synthetic_stream(num_events=num_events, seed=0)
    users = int(s.src.max()) + 1
    rows = np.c_[s.src, s.dst - s.dst.min() + users, s.t]
    np.savetxt(path, rows, fmt="%d", delimiter=" ")
    return path


def fl(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``fedlightning ARGS`` in ``cwd`` with this checkout's package, its own cache and
    MLflow store."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FEDLIGHTNING_CACHE": str(cwd / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}",
    }
    return subprocess.run([FL, *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_manifest_without_an_experiment_from_the_command_line(tmp_path):
    """`data manifest dataset=... protocol=temporal`: the default experiment's graph keys
    (`dataset.missing_rate`) stay out of the stream's loader, on a built-in stream and on a
    label-free `src dst time` file read by the generic loader."""
    small = ["dataset.num_events=3000", "logger=none"]
    r = fl(["data", "manifest", "dataset=synthetic_stream", "protocol=temporal", *small,
            "--out", "plain"], tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "written" in r.stdout and "missing_rate" not in r.stderr
    plain = json.loads((tmp_path / "plain" / "protocol.json").read_text())
    # the same objects as through the protocol's experiment
    r = fl(["data", "manifest", "experiment=temporal_synthetic", *small, "--out", "exp"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "exp" / "protocol.json").read_text())["hashes"] == plain["hashes"]

    path = write_label_free(tmp_path / "ratings.txt")
    r = fl(["data", "manifest", "dataset=interactions", f"dataset.path={path}",
            "dataset.bipartite=false", "protocol=temporal", "logger=none", "--out", "own"],
           tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    table = json.loads((tmp_path / "own" / "protocol.json").read_text())["table"]
    assert table["events"] == 20000 and table["labels"] == "none" and table["classes"] == 0


# --- rules the config alone decides: checked before any data is read ---------------------
# (overrides, the key the one-line error names, text it holds); cora's files are never found
# (data_root points nowhere) and the loader is replaced by one that fails if called.
BEFORE_DATA = [
    (["protocol.stream.stages=[2,2,2,2]"], "protocol.stream.stages", "'cora' has 7"),
    (["protocol.stream.stages=[1,1,1]"], "protocol.stream.stages", "first stage of >= 2"),
    (["dataset=synthetic", "dataset.num_classes=4", "protocol.stream.stages=[2,2]"],
     "protocol.stream.stages", "at most 3 in all, e.g. [2, 1]"),
    (["protocol.stream.client_fraction=0"], "protocol.stream.client_fraction", "(0, 1]"),
    (["partition.split=[0.8,0.0,0.2]"], "partition.split", "validation fraction must be > 0"),
    (["partition=dirichlet", "partition.alpha=0"], "partition.alpha", "> 0"),
    (["algorithm=fedavg"], "algorithm", "not a class-incremental algorithm"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, key, text", BEFORE_DATA)
def test_config_only_rules_fail_before_any_data_is_read(
    overrides, key, text, tmp_env, compose, monkeypatch
):
    import fedlightning.experiments.graph as graph_program
    from fedlightning.train import train

    def no_data(cfg):
        raise AssertionError("data was read before the config was checked")

    monkeypatch.setattr(graph_program, "load_graph", no_data)
    base = ["experiment=cil_fedavg_cora", f"data_root={tmp_env / 'nowhere'}", "logger=none"]
    with pytest.raises(ConfigError) as err:
        train(compose([*base, *overrides]), tmp_env / "run", verbose=False)
    assert err.value.key == key and text in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_env / "run").exists()  # no run began


def test_bad_stages_of_a_folder_not_yet_written_name_the_stages(tmp_env, compose):
    """A folder's classes are known only once its labels are read, but the layout rules
    hold for any dataset: the stages error comes first, before the folder is looked at."""
    from fedlightning.config import validate

    over = ["experiment=cil_fedavg_cora", "dataset=folder", f"dataset.path={tmp_env / 'later'}"]
    with pytest.raises(ConfigError, match="protocol.stream.stages"):
        validate(compose([*over, "protocol.stream.stages=[1,1,1]"]))
    # C unknown: any good layout passes, and then the missing folder is named
    with pytest.raises(ConfigError, match="dataset.path"):
        validate(compose([*over, "protocol.stream.stages=[2,2,2,2,2]"]))


def test_bad_stages_from_the_command_line_is_one_line(tmp_path):
    r = fl(["train", "experiment=cil_fedavg_cora", "protocol.stream.stages=[1,1,1]",
            f"data_root={tmp_path / 'nowhere'}", "logger=none"], tmp_path)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: config `protocol.stream.stages`: need a first stage of >= 2 classes and >= 1 "
        "class per later stage, got [1, 1, 1]"
    ]
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.json"))


# --- a label-free stream runs link prediction only -----------------------------------------
FEDTIP_SMALL = [  # as tests/integration/test_fedtip.py: a few tasks, a small bank
    "protocol.tasks.num_tasks=3",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
]


def test_a_label_free_stream_runs_link_prediction_only(tmp_env, compose, caplog):
    """`families: auto` (the synthetic recipe's) resolves to `lp` on a `src dst time` file:
    the summary, the tag and the metrics say so; `families=[nc, lp]` is refused."""
    import logging

    from fedlightning.train import train

    path = write_label_free(tmp_env / "ratings.txt")
    over = ["experiment=fedtip_synthetic", "dataset=interactions", f"dataset.path={path}",
            "dataset.bipartite=false", *FEDTIP_SMALL]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="fedlightning.experiments.temporal"):
        s = train(compose(over), tmp_env / "run", verbose=False)
    assert "families=auto: lp on ratings (no usable state labels)" in caplog.messages
    assert s["families"] == ["lp"] and s["tags"]["families"] == "lp"
    assert s["tags"]["dataset"] == "ratings" and s["tasks_done"] == 3
    assert 0.0 <= s["metrics"]["auc_tlp"] <= 1.0 and "auc_nc" not in s["metrics"]
    assert set(s["comm"]["message_values"]) == {"lp"}
    with pytest.raises(ConfigError, match="families") as err:
        train(compose([*over, "families=[nc,lp]"]), tmp_env / "nc", verbose=False)
    assert "ratings has none" in str(err.value) and "\n" not in str(err.value)
