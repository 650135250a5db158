"""What a user tries first at the command line: ``--version``, the ``data`` subcommands,
a pipe closed early, and ``data manifest`` leaving no tracking store behind."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """``command`` in bash, ``fedlightning`` there being this checkout's, no tracking URI set."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env |= {"PYTHONPATH": str(REPO), "FEDLIGHTNING_CACHE": str(cwd / "cache")}
    fl = f"{sys.executable} -m fedlightning"
    return subprocess.run(
        ["bash", "-c", command.replace("fedlightning", fl, 1)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_version(tmp_path):
    r = run("fedlightning --version", tmp_path)
    assert (r.returncode, r.stdout) == (0, f"fedlightning {version('fedlightning')}\n")


def test_data_help_lists_every_subcommand(tmp_path):
    r = run("fedlightning data --help", tmp_path)
    assert r.returncode == 0
    lines = r.stdout.split("subcommands:")[1].splitlines()
    listed = [ln.split()[0] for ln in lines if ln.startswith("  ") and ln[2] != " "]
    assert listed == ["features", "manifest"]
    r = run("fedlightning data featurs", tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'featurs'" in r.stderr


def test_a_pipe_closed_early_ends_without_a_traceback(tmp_path):
    """``true`` closes the pipe before the command writes (completion takes about a
    second), so every write meets a closed pipe; ``head -1`` as a user types it."""
    r = run("fedlightning completion query 'fedlightning train experiment=' | true", tmp_path)
    assert r.stderr == "", r.stderr
    r = run("fedlightning completion query 'fedlightning train experiment=' | head -1", tmp_path)
    assert r.stderr == "" and r.stdout.startswith("experiment=")


def test_data_manifest_touches_no_tracking_store(tmp_path):
    r = run(
        "fedlightning data manifest experiment=temporal_synthetic dataset.num_events=3000 "
        "--out proto",
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "proto" / "protocol.json").exists()
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


def test_log_lines_go_through_tqdm_while_a_run_trains(tmp_path, monkeypatch):
    """While ``train`` runs, the console's log handler writes with ``tqdm.write``, so a line
    never lands inside a progress bar (``logging_redirect_tqdm``)."""
    import logging

    import fedlightning.train
    from tests.inprocess import fl_ok

    seen = []

    def train(cfg, run_dir):
        seen.extend(type(h).__name__ for h in logging.getLogger().handlers)
        return {"metrics": {}}

    monkeypatch.setattr(fedlightning.train, "train", train)
    fl_ok(["train", "logger=none", "hydra.run.dir=run"], tmp_path, {})
    assert "_TqdmLoggingHandler" in seen
    assert "_TqdmLoggingHandler" not in [type(h).__name__ for h in logging.getLogger().handlers]
