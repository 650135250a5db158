"""Lightning DDP from the command line: ``runner=sequential_trainer`` with
``runner.executor.devices=2 strategy=ddp``, ranks started by Lightning's own launcher."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from omegaconf import OmegaConf

from fedlightning.cli import check_lightning_ddp, lightning_ranks
from fedlightning.errors import ConfigError
from fedlightning.train import train

TRAINER = "fedlightning.federation.executors.TrainerExecutor"
RUN = ["experiment=fl_cora", "algorithm=fedavg", "federation.rounds=1", "federation.local_epochs=2"]
DDP = ["runner=sequential_trainer", "runner.executor.devices=2", "runner.executor.strategy=ddp"]
# Only against a hang: far above the normal time (about 20 s idle), so that a loaded machine
# never fails the test; the time taken is printed, not asserted (benchmarks/ hold timings).
HANG_GUARD_S = 1800


def executor(**kw):
    return OmegaConf.create({"runner": {"executor": {"_target_": TRAINER, **kw}}})


@pytest.mark.parametrize(
    ("kw", "ranks"),
    [
        ({}, 1),
        ({"devices": 2}, 2),
        ({"devices": "3"}, 3),
        ({"devices": [0, 1]}, 2),
        ({"devices": "0,1"}, 2),
        ({"devices": 2, "strategy": "ddp_spawn"}, 1),  # multiprocessing: nothing re-executed
        ({"devices": "auto", "accelerator": "cpu"}, 1),
    ],
)
def test_lightning_ranks(kw, ranks):
    assert lightning_ranks(executor(**kw)) == ranks


def test_lean_executor_never_starts_ranks(compose):
    assert lightning_ranks(compose(["runner=sequential"])) == 1
    assert lightning_ranks(compose(DDP)) == 2


@pytest.mark.parametrize(
    ("overrides", "context", "needle"),
    [
        (["runner=distributed", f"runner.executor._target_={TRAINER}"], None, "distributed"),
        (DDP, "multirun (-m)", "multirun"),
        (DDP, "fedlightning sweep", "sweep"),
    ],
)
def test_refused_combinations_name_the_field(compose, overrides, context, needle):
    cfg = compose(overrides)
    if "runner=distributed" in overrides:
        OmegaConf.update(cfg, "runner.executor.devices", 2, force_add=True)
    with pytest.raises(ConfigError, match=rf"runner\.executor\.devices.*{needle}"):
        check_lightning_ddp(cfg, context)
    check_lightning_ddp(compose(["runner=sequential_trainer"]), context)  # one device: fine


@pytest.mark.slow
def test_two_ranks_write_one_run_with_the_single_device_metrics(
    tmp_env, shared_data, compose, monkeypatch
):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    cli = str(Path(sys.executable).parent / "fedlightning")
    t0 = time.perf_counter()
    r = subprocess.run(
        [cli, "train", *RUN, *DDP, "logger=none", "hydra.run.dir=run"],
        cwd=tmp_env,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in r.stderr  # Lightning started the second rank
    assert r.stdout.count("test_acc_at_best_val") == 1  # rank 0 alone prints the summary
    (summary,) = tmp_env.rglob("summary.json")  # rank 1 ran in a scratch directory
    assert summary.parent == tmp_env / "run"
    assert not list(tmp_env.rglob("train_ddp_process_*.log"))
    left = [
        p
        for p in psutil.process_iter(["cmdline", "cwd"])
        if p.info["cwd"] == str(tmp_env) and "train" in (p.info["cmdline"] or [])
    ]
    assert not left  # the command waited for its rank
    metrics = json.loads(summary.read_text())["metrics"]
    assert math.isfinite(metrics["test_acc"]) and metrics["test_acc"] > 0.2
    # both ranks fit the same full batch: DDP averages equal gradients, bitwise the same run
    cfg = compose([*RUN, "runner=sequential_trainer", "logger=none"])
    assert metrics == train(cfg, tmp_env / "ref", verbose=False)["metrics"]
    print(f"2-rank Lightning DDP run: {seconds:.1f} s")
