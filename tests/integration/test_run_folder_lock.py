"""A run folder is owned by one run (docs/security.md, "Run folders"): a lock held for the
run's life, a second run into a held folder refused in one line (exit 2), and a refused
fresh run leaves no stub folder behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedlightning.errors import FedLightningError
from fedlightning.runs import LOCK_FILE, drop_stub_run_dir, lock_run_dir, release_run_dirs

REPO = Path(__file__).resolve().parents[2]
FAST = ["experiment=fl_synthetic", "algorithm=fedavg", "federation.rounds=2", "logger=none"]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "FEDLIGHTNING_CACHE": str(cwd / "cache"), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "fedlightning", "train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_a_second_lock_on_a_held_folder_is_refused_in_one_line(tmp_path):
    """flock: another process holding the folder's lock refuses this one; released, it is
    free again; one process taking it twice is one hold."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from fedlightning.runs import "
            "lock_run_dir; lock_run_dir(Path(sys.argv[1])); print('held', flush=True); "
            "time.sleep(60)",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FedLightningError, match="in use by another run") as e:
            lock_run_dir(run_dir)
        assert "\n" not in str(e.value) and str(holder.pid) in str(e.value)
        assert not drop_stub_run_dir(run_dir)  # another run's folder: left alone
    finally:
        holder.kill()
        holder.wait()
    lock_run_dir(run_dir)  # the holder died: the system released its lock
    lock_run_dir(run_dir)  # twice in one process: one hold
    # the dead holder's file is taken as it is and left there (a folder is not rewritten)
    assert (run_dir / LOCK_FILE).read_text().strip() == str(holder.pid)
    release_run_dirs()
    assert (run_dir / LOCK_FILE).exists()
    fresh = tmp_path / "fresh"
    lock_run_dir(fresh)  # a file this process makes holds its id, and goes on release
    assert (fresh / LOCK_FILE).read_text().strip() == str(os.getpid())
    release_run_dirs()
    assert list(fresh.iterdir()) == []


@pytest.mark.slow
def test_two_fresh_runs_into_one_folder_exactly_one_runs(tmp_path):
    """Started together with the same ``hydra.run.dir``: one finishes (exit 0), the other
    is refused in one line (exit 2), and the folder holds the finished run's files only
    (its config is the one that ran)."""
    run_dir = tmp_path / "shared"
    args = [*FAST, f"hydra.run.dir={run_dir}"]
    procs = [start([*args, f"seed={s}"], tmp_path) for s in (1, 2)]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [o[1][-2000:] for o in outs]
    loser = next(o for p, o in zip(procs, outs, strict=True) if p.returncode == 2)
    (line,) = errors(loser[1])
    assert f"run directory {run_dir}" in line
    assert "in use by another run" in line or "already holds a run" in line
    winner = next(i for i, p in enumerate(procs) if p.returncode == 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["seed"] == (1, 2)[winner]
    assert f"seed: {(1, 2)[winner]}" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_a_run_into_a_held_folder_is_refused_before_hydra_writes_there(tmp_path):
    """A folder held by a run in progress (here: this test holds its lock) refuses a fresh
    run in one line, exit 2, and nothing is written into it (no `.hydra`, no log)."""
    run_dir = tmp_path / "busy"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from fedlightning.runs import "
            "lock_run_dir; lock_run_dir(Path(sys.argv[1])); print('held', flush=True); "
            "time.sleep(120)",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        p = start([*FAST, f"hydra.run.dir={run_dir}"], tmp_path)
        _, err = p.communicate(timeout=600)
        assert p.returncode == 2, err[-2000:]
        (line,) = errors(err)
        assert "in use by another run" in line and f"process {holder.pid}" in line
        assert sorted(x.name for x in run_dir.iterdir()) == [LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_refused_fresh_run_leaves_no_stub_folder(tmp_path):
    """A config refused inside the run (after Hydra made the folder and wrote `.hydra` and
    its log) removes that folder: nothing is left of the refused run."""
    run_dir = tmp_path / "refused"
    p = start(
        [*FAST, "federation.rounds=0", f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    _, err = p.communicate(timeout=600)
    assert p.returncode == 2, err[-2000:]
    assert len(errors(err)) == 1 and "federation.rounds" in err
    assert not run_dir.exists()
