"""``-m "not realdata"`` is a data-free run: every test that reads the real data directory
(through the ``shared_data`` fixture, directly or via another fixture) carries the marker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# files that mix real-data tests with data-free ones, each reaching shared_data differently:
# directly, through a module fixture (cli_env), and through a plain helper's argument
FILES = [
    "tests/integration/test_fedtip.py",
    "tests/integration/test_cli.py",
    "tests/data/test_features.py",
]


def collect(marker: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", marker, *FILES],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return {line for line in r.stdout.splitlines() if "::" in line}


def test_every_test_of_the_real_data_is_marked_and_no_other():
    free = collect("not realdata")
    # taking shared_data directly, through a module fixture (cli_env), or to pass it to a
    # plain helper: deselected
    assert "tests/integration/test_fedtip.py::test_fedtip_on_bitcoin_alpha" not in free
    assert "tests/integration/test_cli.py::test_killed_run_resumes_to_identical_metrics" not in free
    assert not any("test_citeseer_texts_rebuild" in t for t in free)
    # the data-free tests of the same files: kept
    assert "tests/integration/test_fedtip.py::test_comparators_and_ablation_switches_run" in free
    assert any(t.startswith("tests/data/test_features.py::") for t in free)
