"""A user's own data, as issue 21 brings it: a temporal protocol composed without an
experiment, and a label-free interaction stream through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedlightning.data.temporal import make_synthetic_stream

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
