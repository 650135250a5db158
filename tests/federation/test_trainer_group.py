"""The ``trainer`` config group (conf/trainer) reaches the local fits: the Lightning Trainer
takes every key, the lean executor honours what it can (checked against the Trainer) and
refuses the rest in one line, and an absent GPU is refused before any data is read."""

from __future__ import annotations

import copy
import json
from functools import partial

import lightning.pytorch as pl
import pytest
import torch

import fedlightning.config
from fedlightning.clients import NodeClassifier
from fedlightning.config import build, check_trainer
from fedlightning.data.graphs import make_synthetic
from fedlightning.errors import ConfigError
from fedlightning.federation.executors import LeanExecutor, TrainerExecutor
from fedlightning.models import MultimodalGNN
from tests.inprocess import fl_here, fl_ok


class Seen(pl.Callback):
    """The gradient norm each step applies, and the Trainer's precision."""

    def __init__(self):
        self.norms, self.precision = [], None

    def on_fit_start(self, trainer, pl_module):
        self.precision = getattr(trainer, "precision", None)

    def on_train_epoch_end(self, trainer, pl_module):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def fit(executor, epochs: int = 3):
    g = make_synthetic(num_nodes=120, num_classes=3, seed=1)
    data = g.to_data()
    data.train_mask = torch.arange(120) % 2 == 0
    torch.manual_seed(0)
    net = MultimodalGNN({m: x.size(1) for m, x in g.features.items()}, 3, hidden=16)
    module = NodeClassifier(copy.deepcopy(net), partial(torch.optim.SGD, lr=0.5))
    seen = Seen()
    torch.manual_seed(123)
    executor.fit(module, data, epochs, [seen])
    return module.net.state_dict(), seen


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lean_gradient_clipping_is_the_trainers(algorithm):
    clip = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": algorithm}
    lean, seen = fit(LeanExecutor(trainer=clip))
    full, _ = fit(TrainerExecutor(trainer=clip))
    plain, _ = fit(LeanExecutor())
    for k in lean:
        assert torch.allclose(lean[k], full[k], atol=1e-6), k
    assert any(not torch.equal(lean[k], plain[k]) for k in lean)  # the clip did something
    if algorithm == "norm":
        assert max(seen.norms) <= 0.05 + 1e-6


def test_trainer_takes_bf16_mixed_precision():
    state, seen = fit(TrainerExecutor(trainer={"precision": "bf16-mixed"}, precision="bf16-mixed"))
    assert seen.precision == "bf16-mixed"
    assert all(torch.isfinite(v).all() for v in state.values())


def test_lean_refuses_what_it_cannot_honour_in_one_line():
    with pytest.raises(
        ConfigError, match=r"^config `trainer.precision`: 'bf16-mixed'.*sequential_trainer"
    ):
        LeanExecutor(trainer={"precision": "bf16-mixed"})
    with pytest.raises(ConfigError, match="trainer.devices"):
        LeanExecutor(trainer={"devices": 2})
    with pytest.raises(ConfigError, match="trainer.benchmark"):
        LeanExecutor(trainer={"benchmark": True})


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["trainer.precision=bf16-mixed"], "trainer.precision"),
        (["trainer=ddp"], "trainer.devices"),
        (["+trainer.max_epochs=3", "runner=sequential_trainer"], "trainer.max_epochs"),
        (["+trainer.benchmarc=true", "runner=sequential_trainer"], "trainer.benchmarc"),
        (["trainer.accelerator=gpu"], "trainer.accelerator"),
        (["trainer=gpu", "runner=sequential_trainer"], "trainer.accelerator"),
        (["runner=sequential_trainer", "runner.executor.accelerator=gpu"], "trainer.accelerator"),
    ],
)
def test_config_refusals_name_the_key(compose, monkeypatch, overrides, key):
    monkeypatch.setattr(fedlightning.config, "_cuda_available", lambda: False)
    with pytest.raises(ConfigError, match=f"^config `{key}`"):
        check_trainer(compose(overrides))


def test_every_trainer_key_reaches_the_trainer(compose):
    cfg = compose(
        ["runner=sequential_trainer", "trainer.precision=bf16-mixed", "+trainer.benchmark=true",
         "trainer.gradient_clip_val=0.5", "trainer.deterministic=warn"]
    )  # fmt: skip
    check_trainer(cfg)
    executor = build(cfg.runner.executor, "runner.executor")
    assert executor.precision == "bf16-mixed" and executor.settings == {
        "deterministic": "warn",
        "gradient_clip_val": 0.5,
        "gradient_clip_algorithm": "norm",
        "benchmark": True,
    }
    lean = build(compose(["trainer.gradient_clip_val=0.5"]).runner.executor, "runner.executor")
    assert (lean.clip_val, lean.clip_algorithm) == (0.5, "norm")


def test_an_absent_gpu_is_one_line_before_the_data(tmp_path, monkeypatch):
    monkeypatch.setattr(fedlightning.config, "_cuda_available", lambda: False)
    env = {"FEDLIGHTNING_CACHE": str(tmp_path / "cache"), "FEDLIGHTNING_DATA": str(tmp_path)}
    r = fl_here(["train", "trainer.accelerator=gpu", "logger=none"], tmp_path, env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: config `trainer.accelerator`: gpu: this machine has no")
    assert not list(tmp_path.glob("outputs/*/*/*/partition.json"))  # no data was read


def test_bf16_mixed_runs_on_the_sequential_trainer(tmp_path):
    env = {"FEDLIGHTNING_CACHE": str(tmp_path / "cache")}
    over = ["trainer.precision=bf16-mixed", "runner=sequential_trainer", "federation.rounds=1"]
    fl_ok(["train", *over, "logger=none", "protocol.stream.stages=[3]"], tmp_path, env)
    (summary,) = tmp_path.glob("outputs/*/*/*/summary.json")
    assert 0.0 <= json.loads(summary.read_text())["metrics"]["test_acc"] <= 1.0
