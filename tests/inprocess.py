"""``fedlightning ARGS`` in the test's own process: what the console script runs
(:func:`fedlightning.cli.main`), without another interpreter's start-up (about 5 s of
imports for each process that trains). Kill tests keep the killed run a real subprocess;
the uninterrupted references and the resumes they compare can run here, on the same threads
as the subprocesses (``OMP_NUM_THREADS`` of tests/conftest.py)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


def fl_here(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``fedlightning ARGS`` in ``cwd`` with ``env`` added to the environment (both restored
    after): its exit status and what it wrote to stdout and stderr."""
    from fedlightning.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setattr(sys, "argv", [str(Path(sys.executable).parent / "fedlightning"), *args])
        mp.delenv("HYDRA_FULL_ERROR", raising=False)  # main sets it while Hydra runs
        for k, v in env.items():
            mp.setenv(k, v)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(args)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def fl_ok(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """:func:`fl_here`, failing the test unless the command exits with 0."""
    r = fl_here(args, cwd, env)
    assert r.returncode == 0, (
        f"fedlightning {' '.join(args)} exited {r.returncode}: {r.stderr[-3000:]}"
    )
    return r


def runs_once(
    tmp_path_factory: pytest.TempPathFactory,
    compose: Callable[[list[str]], Any],
    overrides_of: Callable[[Any], list[str]],
) -> Callable[[Any], Path]:
    """``run(key) -> run dir``: the run of ``compose(overrides_of(key))`` in this process, made
    once per key (a list key counts as its tuple) in its own folder, cache and MLflow store,
    with torch's thread count restored after (a run sets it from ``threads``). A
    module-scoped fixture returns it, so that the tests reading one run share it: hand counts
    of its ledger, and the uninterrupted or sequential reference of a kill-and-resume or a
    two-rank run."""
    from fedlightning.train import train

    runs: dict[Any, Path] = {}

    def run(key: Any) -> Path:
        memo = tuple(key) if isinstance(key, list) else key
        if memo not in runs:
            root = tmp_path_factory.mktemp("seq")
            threads = torch.get_num_threads()
            try:
                with pytest.MonkeyPatch.context() as mp:
                    mp.chdir(root)
                    mp.setenv("FEDLIGHTNING_CACHE", str(root / "cache"))
                    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
                    train(compose(overrides_of(key)), root / "run", verbose=False)
            finally:
                torch.set_num_threads(threads)
            runs[memo] = root / "run"
        return runs[memo]

    return run


def summary_of(run_dir: Path) -> dict:
    """The ``summary.json`` a run wrote into ``run_dir``."""
    return json.loads((run_dir / "summary.json").read_text())
