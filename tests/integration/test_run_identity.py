"""A run's identity through the real CLI: ``resume`` refuses another run's checkpoint and a
broken checkpoint or saved config with one line (exit 2), and still resumes its own run.

The interrupted run is killed in a real ``fedlightning`` subprocess, and one refusal is a
real subprocess too; the other commands run :func:`fedlightning.cli.main` (what the console
script runs) in this process, without another interpreter's start-up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.inprocess import fl_here

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SMALL = ["federation.rounds=2", "federation.local_epochs=1", "logger=none"]


def fl(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``fedlightning ARGS`` as a user runs it, in ``cwd``."""
    cmd = [str(Path(sys.executable).parent / "fedlightning"), *args]
    return subprocess.run(
        cmd, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )


def assert_one_line_refusal(r: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2 and one line on stderr, without a traceback, holding ``words``."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_data) -> tuple[Path, dict[str, str]]:
    """A finished ``fedavg_cora`` run of one round (``cora``) and an interrupted
    ``fedavg_synthetic`` run (``synth``, killed in its second round)."""
    root = tmp_path_factory.mktemp("identity")
    env = {"FEDLIGHTNING_DATA": str(shared_data), "FEDLIGHTNING_CACHE": str(root / "cache")}
    one_round = [*SMALL, "federation.rounds=1"]
    cora = fl_here(
        ["train", "experiment=fl_cora", "algorithm=fedavg", *one_round, "hydra.run.dir=cora"],
        root,
        env,
    )
    assert cora.returncode == 0, cora.stderr
    synth = ["train", "experiment=fl_synthetic", "algorithm=fedavg", *SMALL, "hydra.run.dir=synth"]
    killed = fl([*synth, "runner.kill_at=2:1"], root, env)
    assert killed.returncode == -9, killed.stderr
    assert (root / "synth" / "checkpoint.pt").exists()
    assert not (root / "synth" / "summary.json").exists()
    shutil.copytree(root / "synth", root / "pristine")  # what copy_run copies, never resumed
    return root, env


def copy_run(root: Path, name: str) -> Path:
    """A copy of the interrupted synthetic run, to break."""
    shutil.copytree(root / "pristine", root / name)
    return root / name


def test_identity_is_recorded(runs):
    root, _ = runs
    for name, experiment in (("cora", "fedavg_cora"), ("synth", "fedavg_synthetic")):
        identity = json.loads((root / name / "identity.json").read_text())
        assert identity["experiment"] == experiment and identity["hashes"]["partition"]
        import torch

        state = torch.load(root / name / "checkpoint.pt", weights_only=False)
        assert state["identity"] == identity


def test_another_experiments_checkpoint_is_refused(runs):
    root, env = runs
    mixed = copy_run(root, "mixed")
    shutil.copy(root / "cora" / "checkpoint.pt", mixed / "checkpoint.pt")
    before = (mixed / "checkpoint.pt").read_bytes()
    r = fl(["train", "resume=mixed", "logger=none"], root, env)  # a real subprocess
    line = assert_one_line_refusal(r, "checkpoint.pt", "experiment", "fedavg_cora")
    assert "fedavg_synthetic" in line
    assert not (mixed / "summary.json").exists()
    assert (mixed / "checkpoint.pt").read_bytes() == before


def test_truncated_checkpoint_is_refused(runs):
    root, env = runs
    broken = copy_run(root, "truncated")
    data = (broken / "checkpoint.pt").read_bytes()
    (broken / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    r = fl_here(["train", "resume=truncated", "logger=none"], root, env)
    assert_one_line_refusal(r, "checkpoint.pt")
    assert not (broken / "summary.json").exists()


def test_garbled_saved_config_is_refused(runs):
    root, env = runs
    broken = copy_run(root, "garbled")
    (broken / "config.yaml").write_text("name: [fedavg_synthetic\n  task: {{fl\n")
    r = fl_here(["train", "resume=garbled", "logger=none"], root, env)
    assert_one_line_refusal(r, "config.yaml")
    assert not (broken / "summary.json").exists()


def test_interrupted_run_resumes(runs):
    root, env = runs
    r = fl_here(["train", "resume=synth", "logger=none"], root, env)
    assert r.returncode == 0, r.stderr
    summary = json.loads((root / "synth" / "summary.json").read_text())
    assert summary["experiment"] == "fedavg_synthetic" and summary["resumed"] is True
    assert summary["rounds"] == 2


def test_another_models_checkpoint_without_identity_is_refused(runs):
    import torch

    root, env = runs
    old = copy_run(root, "old_format")
    state = torch.load(root / "cora" / "checkpoint.pt", weights_only=False)
    state.pop("identity")
    state["format"] = 2  # written before runs had an identity: no identity to check
    torch.save(state, old / "checkpoint.pt")
    (old / "identity.json").unlink()
    r = fl_here(["train", "resume=old_format", "logger=none"], root, env)
    assert_one_line_refusal(r, "checkpoint.pt", "another model")
    assert not (old / "summary.json").exists()


def test_identity_mismatch_names_the_first_differing_key():
    from omegaconf import OmegaConf

    from fedlightning.runs import identity_mismatch, run_identity

    cfg = OmegaConf.create({"name": "x", "seed": 0, "federation": {"rounds": 2}, "runner": {}})
    same = run_identity(OmegaConf.merge(cfg, {"runner": {"kill_at": "1:1"}}), {"partition": "a"})
    assert identity_mismatch(same, run_identity(cfg, {"partition": "a"})) is None
    other = run_identity(OmegaConf.merge(cfg, {"federation": {"rounds": 3}}), {"partition": "a"})
    assert "`federation.rounds`" in identity_mismatch(other, run_identity(cfg, {"partition": "a"}))
    moved = run_identity(cfg, {"partition": "b"})
    assert "partition hash" in identity_mismatch(moved, run_identity(cfg, {"partition": "a"}))


def test_a_resume_on_changed_features_is_refused_naming_the_modality(tmp_path):
    """The run identity holds a content hash of every modality's features: add 1.0 to a
    folder graph's feature file between a kill and a resume and the resume is refused in
    one line naming the modality (before, only labels and edges were hashed); restored, the
    same resume goes on."""
    import numpy as np

    from fedlightning.data.graphs import make_synthetic, save_folder

    g = make_synthetic(num_nodes=200, num_classes=3, modalities={"text": 8, "image": 4},
                       missing_rate=0.0, seed=0)  # fmt: skip
    folder = tmp_path / "graph"
    save_folder(g, folder)
    env = {"FEDLIGHTNING_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    args = ["train", "experiment=fl_synthetic", "algorithm=fedavg", "dataset=folder", f"dataset.path={folder}",
            "federation.clients=2", *SMALL, "hydra.run.dir=run"]  # fmt: skip
    killed = fl([*args, "runner.kill_at=2:1"], tmp_path, env)
    assert killed.returncode == -9, killed.stderr[-3000:]
    text = folder / "features" / "text.npy"
    original = np.load(text)
    np.save(text, original + 1.0)
    r = fl_here(["train", "resume=run", "logger=none"], tmp_path, env)
    line = assert_one_line_refusal(r, "modality `text`", "features hash", "refusing to resume")
    assert "image" not in line
    assert not (tmp_path / "run" / "summary.json").exists()
    np.save(text, original)  # the same features again: the run resumes
    r = fl_here(["train", "resume=run", "logger=none"], tmp_path, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["resumed"] is True
