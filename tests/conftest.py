"""Shared fixtures: the real data directory and a composed, shrunk config.

Every test that reads real data does so through the ``shared_data`` fixture (directly or
through another fixture); :func:`pytest_collection_modifyitems` marks each such test
``realdata``, so ``pytest -m "not realdata"`` is a run that needs no data file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

import fedlightning.config  # noqa: F401  (registers the configs' resolvers, e.g. fl.data_name)
from fedlightning.resources import conf_dir

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = str(conf_dir())  # the imported package's configs
SHARED_DATA = Path(os.environ.get("FEDLIGHTNING_TEST_DATA", REPO.parent / "shared" / "data"))


def _absl_writes_to_the_real_stderr() -> None:
    """absl (imported by dp-accounting) makes its log handler on whatever ``sys.stderr`` is
    at import: in a test, pytest's capture file. Its ``close`` closes any stream that is not
    the current ``sys.stderr``, so when a later in-process run has Hydra reset logging
    (``logging.config.dictConfig`` closes every handler) while the test redirects
    ``sys.stderr``, pytest's capture file is closed and every later test of the worker
    errors. Pointed at ``sys.__stderr__``, the handler never closes a stream it does not own."""
    try:
        import absl.logging
    except ImportError:
        return
    absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__


_absl_writes_to_the_real_stderr()
# No run draws its PNG plots (`plots`, docs/experiments.md) unless a test asks with
# `plots=true`: matplotlib's import and the drawing cost about a second per run. Set in the
# environment, so the runs in subprocesses (CLI, ranks, Flower nodes) inherit it too.
os.environ.setdefault("FEDLIGHTNING_PLOTS", "false")


def _cores_per_worker() -> None:
    """Under pytest-xdist, each worker and every process it starts (CLI runs, ranks, Flower
    nodes) computes on its share of the cores (``OMP_NUM_THREADS``, unless set): with one
    worker per core, torch's default of a thread per core put two spinning OpenMP teams on
    each core, and the workers' heavy tests took 1.7x the time (docs/scaling.md, "The test
    suite computes on its share of the cores")."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ["OMP_NUM_THREADS"] = str(max(1, (cores or 1) // workers))
    if "torch" in sys.modules:  # already imported: its thread pool follows the variable
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_cores_per_worker()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real data of ``../shared/data`` (or ``FEDLIGHTNING_TEST_DATA``); under CI a
    missing directory fails the test. A test using it is marked ``realdata``."""
    if not (SHARED_DATA / "README.md").exists():
        msg = f"real data not found at {SHARED_DATA} (set FEDLIGHTNING_TEST_DATA)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return SHARED_DATA


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``realdata`` every test whose fixtures include ``shared_data``."""
    for item in items:
        if "shared_data" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.realdata)


def compose_cfg(overrides: list[str] | None = None):
    """The real ``conf/train.yaml`` composed with ``overrides`` (no Hydra run)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(
            config_name="train", overrides=overrides or [], return_hydra_config=False
        )


@pytest.fixture
def tmp_env(tmp_path, monkeypatch):
    """Run inside a temporary directory with its own cache and MLflow store."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache for the whole test session, shared by the pytest-xdist workers: protocol
    objects, banks, contexts and history graphs are keyed by their content and written
    atomically, so runs of the same stream share them across modules and processes, as a
    user's concurrent runs do (the real streams' bank and contexts are built about once)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # workers' common
    path = root / "shared-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
def env(tmp_env, shared_cache, monkeypatch):
    """:func:`tmp_env` with the module's :func:`shared_cache` (the temporal runs' bank and
    contexts built once per module)."""
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(shared_cache))
    return tmp_env


@pytest.fixture(scope="session")
def compose():
    """``compose(overrides) -> DictConfig``: the real config as the CLI composes it."""
    return compose_cfg


@pytest.fixture(scope="session")
def grads_on_two_threads():
    """``grads(x0, loss, runs=4)``: the gradient of ``loss(x)`` at ``x0``, once per run, on two
    torch threads (the caller's number restored after), to compare runs for determinism."""
    import torch

    def grads(x0, loss, runs: int = 4) -> list:
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            out = []
            for _ in range(runs):
                x = x0.clone().requires_grad_()
                loss(x).backward()
                out.append(x.grad)
            return out
        finally:
            torch.set_num_threads(threads)

    return grads
