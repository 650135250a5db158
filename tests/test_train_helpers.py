import json
import math
import time

import pytest
import torch
from omegaconf import OmegaConf

from fedlightning.data.graphs import make_synthetic
from fedlightning.data.partition import RandomPartitioner
from fedlightning.errors import ConfigError, FedLightningError
from fedlightning.methods.continual.continual import ContinualFedAvg
from fedlightning.programs.graph_program import save_protocol
from fedlightning.runs import json_safe, prepare_run_dir


def test_resume_refuses_a_finished_run_and_a_non_run(tmp_path):
    cfg = OmegaConf.create({"resume": str(tmp_path), "runner": {}, "logger": {}})
    with pytest.raises(ConfigError, match="resume"):
        prepare_run_dir(cfg, tmp_path / "new")  # no config.yaml there
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="already finished"):
        prepare_run_dir(cfg, tmp_path / "new")


def test_resume_refuses_a_changed_protocol(tmp_path):
    g = make_synthetic(num_nodes=100, num_classes=3, seed=0)
    part = RandomPartitioner()(g, 2, seed=0)
    path = tmp_path / "partition.json"
    save_protocol(part, path, resuming=False)
    save_protocol(part, path, resuming=True)  # same hash: accepted, file untouched
    other = RandomPartitioner()(g, 2, seed=1)
    with pytest.raises(FedLightningError, match="refusing to resume"):
        save_protocol(other, path, resuming=True)
    assert json.loads(path.read_text())["hash"] == part.hash


def test_json_safe_turns_non_finite_into_null():
    out = json_safe({"a": math.nan, "b": [1.0, math.inf], "c": {"d": 2}})
    assert out == {"a": None, "b": [1.0, None], "c": {"d": 2}}
    json.dumps(out, allow_nan=False)


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"distill_on": "all"}, "algorithm.distill_on"),
        ({"lambda_dis": -1}, "algorithm.lambda_dis"),
        ({"tau": 0}, "algorithm.tau"),
        ({"replay_budget": -1}, "algorithm.replay_budget"),
    ],
)
def test_continual_algorithm_errors_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        ContinualFedAvg(**kw)


def test_checkpoints_carry_a_format_and_old_or_unknown_ones_get_one_line(tmp_path):
    from fedlightning.errors import FedLightningError
    from fedlightning.programs.temporal_program import saved_state
    from fedlightning.runs import CHECKPOINT_FORMAT, load_checkpoint

    graph_v1 = {"completed_rounds": 3, "ledger": {"entries": [("up", 1, 0, "w", 4, 16)]}}
    torch.save(graph_v1, tmp_path / "g.pt")
    assert load_checkpoint(tmp_path / "g.pt") == graph_v1  # a graph run of format 1 resumes
    torch.save({"format": 99}, tmp_path / "future.pt")
    with pytest.raises(FedLightningError, match=r"future\.pt: checkpoint format 99"):
        load_checkpoint(tmp_path / "future.pt")
    fedtip_v1 = {"results": [], "fields": {}, "provisioned": [], "message_values": {}}
    torch.save(fedtip_v1, tmp_path / "checkpoint.pt")
    with pytest.raises(FedLightningError, match="format 1.*cannot resume") as e:
        saved_state(tmp_path / "checkpoint.pt")
    assert "\n" not in str(e.value)
    torch.save(
        {"format": CHECKPOINT_FORMAT, "results": [], "ledger": {"entries": []}}, tmp_path / "ok.pt"
    )
    assert saved_state(tmp_path / "ok.pt")["format"] == CHECKPOINT_FORMAT


def test_a_ledger_of_format_1_loads_with_an_empty_scope():
    from fedlightning.federation.ledger import CommLedger

    ledger = CommLedger()
    ledger.load_state_dict({"entries": [("up", 1, 0, "w", 4, 16), ("down", 1, 0, "w", 4, 16)]})
    assert ledger.entries[0] == ("up", 1, 0, "w", 4, 16, "")
    assert ledger.total("up") == 4 and ledger.total("down", scope="") == 4


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_setting_is_applied_and_checked(monkeypatch, restore_threads):
    from fedlightning.runs import apply_threads

    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    for bad in (0, -2, "two", 1.5, True):
        with pytest.raises(ConfigError, match="threads"):
            apply_threads(bad)
    # auto: several processes on this machine share its CPUs, unless OMP_NUM_THREADS says
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert apply_threads("auto") == 2 and torch.get_num_threads() == 2
    torch.set_num_threads(3)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert apply_threads("auto") == 3  # torch's default, which honours OMP_NUM_THREADS


def test_threads_are_recorded_and_a_resume_may_change_them(tmp_path, restore_threads):
    run = {"name": "demo", "task": "fl", "runner": {}, "logger": {}}
    cfg = OmegaConf.create({**run, "resume": None, "threads": 1})
    saved, run_dir, resuming = prepare_run_dir(cfg, tmp_path / "run")
    assert saved.threads == 1 and not resuming
    again = OmegaConf.create({**run, "resume": str(run_dir), "threads": 2})
    assert prepare_run_dir(again, tmp_path / "other")[0].threads == 2


def test_plots_follow_the_environment_are_checked_and_a_resume_may_change_them(
    tmp_path, compose, monkeypatch
):
    from fedlightning.config import validate
    from fedlightning.runs import run_identity

    for env, expected in (("true", True), ("false", False)):
        monkeypatch.setenv("FEDLIGHTNING_PLOTS", env)
        assert compose([]).plots is expected
    monkeypatch.delenv("FEDLIGHTNING_PLOTS")
    assert compose([]).plots is True  # the default: a run draws its plots
    for bad in ("maybe", "0"):
        with pytest.raises(ConfigError, match="config `plots`: must be true or false"):
            validate(compose([f"plots={bad}"]))
    run = {"name": "demo", "task": "fl", "runner": {}, "logger": {}}
    saved, run_dir, _ = prepare_run_dir(
        OmegaConf.create({**run, "resume": None, "plots": False}), tmp_path / "run"
    )
    again = prepare_run_dir(
        OmegaConf.create({**run, "resume": str(run_dir), "plots": True}), tmp_path
    )
    assert saved.plots is False and again[0].plots is True
    assert run_identity(saved, {}) == run_identity(again[0], {})  # the same run


def test_concurrent_builders_of_a_cached_file_build_it_once(tmp_path):
    """Four threads ask for one cached file at once (each opens the lock file itself, as
    separate processes do): one builds it, the three others wait and find it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from fedlightning.utils.io import build_once, save_torch

    path = tmp_path / "cache" / "contexts" / "x.pt"
    builds, started = [], threading.Barrier(4)

    def build() -> None:
        builds.append(threading.get_ident())
        time.sleep(0.3)  # the others arrive while it builds
        save_torch(path, {"built_by": builds[0]})

    def ask(_: int) -> bool:
        started.wait()
        return build_once(path, build)

    with ThreadPoolExecutor(4) as pool:
        reused = list(pool.map(ask, range(4)))
    assert len(builds) == 1 and sorted(reused) == [False, True, True, True]
    assert torch.load(path)["built_by"] == builds[0]
    assert build_once(path, build) is True and len(builds) == 1  # later: reused at once
