"""Optuna sweeps over the real configs: checks before any trial, pruning, kill and resume."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import FixedTrial, TrialState

from fedlightning.config import compose
from fedlightning.errors import ConfigError
from fedlightning.sweeps import Sweep, experiment_setting, load_spec, suggest
from fedlightning.train import train

REPO = Path(__file__).resolve().parents[1]
FL = str(Path(sys.executable).parent / "fedlightning")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


GOOD = """
experiment: fl_synthetic
space:
  algorithm._target_: {type: categorical, choices: [fedlightning.methods.fedavg.fedavg.FedAvg]}
objective: {metric: val_acc}
trials: 1
"""


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("val_acc}", "test_acc}"), "objective.metric"),
        (("val_acc}", "acc}"), "objective.metric"),
        (("trials: 1", "trials: 0"), "trials"),
        (("trials: 1", "trails: 1"), "trails"),
        (
            (
                "type: categorical, choices: [fedlightning.methods.fedavg.fedavg.FedAvg]",
                "type: float",
            ),
            "low",
        ),
        (("experiment: fl_synthetic", "experiment: [1]"), "experiment"),
    ],
)
def test_bad_sweep_files_name_file_and_field(tmp_path, change, field):
    bad = write(tmp_path / "bad.yaml", GOOD.replace(*change))
    with pytest.raises(ConfigError, match=rf"bad\.yaml: .*{field}"):
        load_spec(bad)


def test_log_range_and_grid_rules(tmp_path):
    spec = GOOD.replace(
        "type: categorical, choices: [fedlightning.methods.fedavg.fedavg.FedAvg]",
        "type: float, low: 0.0, high: 1.0, log: true",
    )
    with pytest.raises(ConfigError, match="low > 0"):
        load_spec(write(tmp_path / "a.yaml", spec))
    grid = "experiment: x\nspace:\n  a: {type: categorical, choices: [1, 2]}\n"
    grid += "objective: {metric: val_am}\nsampler: {name: grid}\n"
    assert load_spec(write(tmp_path / "g.yaml", grid)).trials == 2  # the grid's size
    with pytest.raises(ConfigError, match="exceed the grid"):
        load_spec(write(tmp_path / "h.yaml", grid + "trials: 3\n"))
    floaty = grid.replace("type: categorical, choices: [1, 2]", "type: float, low: 1, high: 2")
    with pytest.raises(ConfigError, match="categorical"):
        load_spec(write(tmp_path / "i.yaml", floaty))


def test_suggest_types():
    trial = FixedTrial({"a": 0.5, "b": 3, "c": "sage"})
    assert suggest(trial, "a", {"type": "float", "low": 0.1, "high": 1.0, "log": True}) == 0.5
    assert suggest(trial, "b", {"type": "int", "low": 1, "high": 4}) == 3
    assert suggest(trial, "c", {"type": "categorical", "choices": ["gcn", "sage"]}) == "sage"


def test_shipped_sweep_files_are_valid():
    """Every sweep file of ``sweeps/`` and its subfolders (``sweeps/claims/``): a valid spec
    whose searched keys are keys of its composed experiment, each default inside its range
    where trial 0 is the defaults (what a sweep checks before its first trial). Composition
    only, under one Hydra initialization."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fedlightning.config import CONF_DIR

    files = sorted((REPO / "sweeps").glob("**/*.yaml"))
    assert any(f.parent.name == "claims" for f in files)  # the subfolders are read
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for f in files:
            spec = load_spec(f)
            assert spec.metric.startswith("val_"), f
            base = hydra_compose(
                config_name="train", overrides=[f"experiment={spec.experiment}", *spec.overrides]
            )
            for key in spec.space:
                assert OmegaConf.select(base, key, default=KeyError) is not KeyError, (f, key)
            if spec.start_from_defaults:
                experiment_setting(spec, base)  # a ConfigError names the file and the key


def test_test_objective_refused_before_any_trial(tmp_path):
    bad = write(tmp_path / "bad.yaml", GOOD.replace("val_acc}", "test_acc}"))
    r = subprocess.run([FL, "sweep", str(bad)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert "bad.yaml" in line and "objective.metric" in line and "test_acc" in line
    assert not (tmp_path / "optuna.db").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_threshold_pruner_stops_a_trial_at_its_first_round(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec_file = write(
        tmp_path / "p.yaml",
        GOOD.replace("trials: 1", "trials: 1\npruner: {name: threshold, lower: 1.01}"),
    )
    spec = load_spec(spec_file)
    spec.storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    seen = []

    def run(cfg, run_dir, observe):
        def spy(kind, step, metrics):
            seen.append((kind, step))
            observe(kind, step, metrics)

        return train(cfg, run_dir, spy, verbose=False)

    study = Sweep(
        spec, tmp_path / "out", ["logger=none", "federation.rounds=3"], compose, run
    ).run()
    (trial,) = study.trials
    assert trial.state == TrialState.PRUNED and trial.intermediate_values.keys() == {1}
    assert seen == [("round", 1)]  # the run stopped after its first round
    run_dir = tmp_path / "out" / "p" / "trial_0" / "seed_0"
    assert (run_dir / "checkpoint.pt").exists() and not (run_dir / "summary.json").exists()


def _complete(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db) as con:
            return con.execute("select count(*) from trials where state = 'COMPLETE'").fetchone()[0]
    except sqlite3.OperationalError:  # tables not created yet
        return 0


@pytest.mark.slow
def test_fedprox_mu_sweep_killed_and_resumed(tmp_path, shared_data):
    """The acceptance run: the shipped sweep file on Cora, 4 of its 6 trials (its 3 random
    startup trials and a TPE one), SIGKILLed after some, resumed from storage."""
    trials = 4  # `fedlightning sweep --trials`
    env = {
        **os.environ,
        "FEDLIGHTNING_DATA": str(shared_data),
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    cmd = [
        FL,
        "sweep",
        str(REPO / "sweeps" / "fedprox_mu_cora.yaml"),
        f"--trials={trials}",
        "federation.rounds=2",
        "federation.local_epochs=1",
    ]
    db = tmp_path / "optuna.db"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 1200  # a hang guard: a loaded machine must not cut the sweep short
    trials_dir = tmp_path / "outputs" / "sweeps" / "fedprox_mu_cora"

    def mid_trial() -> bool:  # two trials done and the third one checkpointed its first round
        n = _complete(db)
        return n >= 2 and (trials_dir / f"trial_{n}" / "seed_0" / "checkpoint.pt").exists()

    while not mid_trial() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_seed0 = trials_dir / f"trial_{_complete(db)}" / "seed_0"
    seed0_was_done = (killed_seed0 / "summary.json").exists()
    study = optuna.load_study(study_name="fedprox_mu_cora", storage=f"sqlite:///{db}")
    before = {t.number: (t.params, t.value) for t in study.trials if t.state == TrialState.COMPLETE}
    assert 2 <= len(before) < trials

    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    study = optuna.load_study(study_name="fedprox_mu_cora", storage=f"sqlite:///{db}")
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) == trials
    for t in done:  # trials finished before the kill are kept as they were
        if t.number in before:
            assert (t.params, t.value) == before[t.number]
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(failed) == 1  # the trial killed mid-run
    retries = [t for t in done if "retry_of" in t.user_attrs]
    # a trial killed mid-run is failed and its parameters run once more, in its own directory
    assert sorted(t.user_attrs["retry_of"] for t in retries) == sorted(t.number for t in failed)
    for t in retries:
        assert t.params == next(f.params for f in failed if f.number == t.user_attrs["retry_of"])
    # no training run twice: one finished run per (trial, seed), 4 trials x 2 seeds
    summaries = sorted(trials_dir.rglob("summary.json"))
    assert len(summaries) == 2 * trials
    values = {
        p.parent.parent.name: json.loads(p.read_text())["metrics"]["val_acc"] for p in summaries
    }
    assert len(values) == trials
    assert killed_seed0.parent.name == f"trial_{failed[0].number}"
    if not seed0_was_done:  # its checkpointed run went on, not started over
        assert json.loads((killed_seed0 / "summary.json").read_text())["resumed"] is True

    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    sweep_exp = client.get_experiment_by_name("fedlightning/sweep").experiment_id
    (parent,) = client.search_runs([sweep_exp], "tags.task = 'sweep'")
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["best_value"] == pytest.approx(study.best_value)
    trial_runs = client.search_runs(
        [sweep_exp], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    finished = [t for t in trial_runs if t.info.status == "FINISHED"]
    assert len(finished) == trials
    assert {float(t.data.params["algorithm.mu"]) for t in finished} == {
        t.params["algorithm.mu"] for t in done
    }
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"trials.csv", "best_params.json", "optimization_history.png"} <= arts
    assert "param_importance.png" in arts and "sensitivity_algorithm.mu.png" in arts


# A sweep process killed (SIGKILL) in trial 1, seed 1, right after its first round's
# checkpoint: seed 0 of trial 1 has finished, seed 1 has a checkpoint.
KILLED_SWEEP = """
import os, signal, sys
from pathlib import Path
from fedlightning.config import compose
from fedlightning.sweeps import Sweep, load_spec
from fedlightning.train import train

def run(cfg, run_dir, observe):
    def spy(kind, step, metrics):
        if observe is not None:
            observe(kind, step, metrics)
        if (run_dir.parent.name, run_dir.name, kind, step) == ("trial_1", "seed_1", "round", 1):
            os.kill(os.getpid(), signal.SIGKILL)
    return train(cfg, run_dir, spy, verbose=False)

Sweep(load_spec(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:], compose, run).run()
"""
SMALL = ["federation.rounds=2", "federation.local_epochs=1", "dataset.num_nodes=300"]


@pytest.mark.slow
def test_killed_sweep_resumes_without_repeats_and_closes_the_dead_trial(tmp_path):
    spec_file = write(
        tmp_path / "lr.yaml",
        "experiment: fl_synthetic\n"
        "space:\n  model.optimizer.lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\n"
        "objective: {metric: val_acc}\ntrials: 3\nseeds: [0, 1]\n"
        "sampler: {name: tpe, seed: 0, startup: 3}\n"
        f"storage: sqlite:///{tmp_path / 'optuna.db'}\n",
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    out = tmp_path / "out"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_SWEEP, str(spec_file), str(out), *SMALL],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    trial_1 = out / "lr" / "trial_1"
    assert (trial_1 / "seed_0" / "summary.json").exists()
    assert (trial_1 / "seed_1" / "checkpoint.pt").exists()

    r = subprocess.run(
        [FL, "sweep", str(spec_file), "--out", str(out), *SMALL],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trial 1 died with its process; trial 2 runs its parameters" in r.stdout
    assert re.search(r"trial 3 started .*\[2/3 trials done, best val_acc", r.stdout)  # progress

    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    states = [t.state for t in study.trials]
    assert states == [
        TrialState.COMPLETE,
        TrialState.FAIL,
        TrialState.COMPLETE,
        TrialState.COMPLETE,
    ]
    dead, retry = study.trials[1], study.trials[2]
    assert retry.user_attrs["retry_of"] == 1 and retry.params == dead.params
    # no finished trial repeats another's parameters (a fresh seed-0 sampler drew trial 0's)
    finished = [t.params["model.optimizer.lr"] for t in study.trials if t.state.is_finished()]
    done = [t.params["model.optimizer.lr"] for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(set(done)) == 3 and len(set(finished)) == 3

    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("fedlightning/sweep")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    by_id = {x.info.run_id: x for x in runs}
    trial_runs = {x.data.tags["trial"]: x for x in runs if x.data.tags["task"] == "sweep_trial"}
    dead_run, retry_run = trial_runs["1"], trial_runs["2"]
    assert dead_run.info.status == "KILLED" and dead_run.data.tags["retried_by"] == "2"
    assert dead_run.data.tags["retry_run_id"] == retry_run.info.run_id
    assert retry_run.data.tags["retry_of_run_id"] == dead_run.info.run_id
    # every trial's seed runs nest under one trial run; the dead trial's moved to its retry
    children = defaultdict(list)
    for x in runs:
        parent = x.data.tags.get("mlflow.parentRunId")
        if parent in by_id and by_id[parent].data.tags["task"] == "sweep_trial":
            children[by_id[parent].data.tags["trial"]].append(x)
    assert sorted(children) == ["0", "2", "3"]
    for trial, seed_runs in children.items():
        assert sorted(x.data.tags["seed"] for x in seed_runs) == ["0", "1"], trial
        assert {x.info.status for x in seed_runs} == {"FINISHED"}
        assert {x.info.run_name.rsplit("-", 1)[1] for x in seed_runs} == {"s0", "s1"}
    (parent,) = [x for x in runs if x.data.tags["task"] == "sweep"]
    assert json.loads(parent.data.params["cli_overrides"]) == SMALL
    best = study.best_trial
    assert parent.data.tags["best_trial_run_id"] == trial_runs[str(best.number)].info.run_id


def test_duplicate_draws_are_drawn_again(tmp_path, monkeypatch, capsys):
    """Three trials over three categorical points: each point once, a repeated draw is
    failed as `duplicate_of` and drawn again (identical parameters give identical runs)."""
    monkeypatch.chdir(tmp_path)
    spec = load_spec(
        write(
            tmp_path / "c.yaml",
            "experiment: fl_synthetic\n"
            "space:\n  model.net.conv: {type: categorical, choices: [gcn, sage, gat]}\n"
            "objective: {metric: val_acc}\ntrials: 3\nsampler: {name: random, seed: 0}\n",
        )
    )
    spec.storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    ran = []

    def fake_train(cfg, run_dir, observe):
        ran.append(cfg.model.net.conv)
        return {"metrics": {"val_acc": {"gcn": 0.1, "sage": 0.2, "gat": 0.3}[cfg.model.net.conv]}}

    study = Sweep(spec, tmp_path / "out", ["logger=none"], compose, fake_train).run()
    assert sorted(ran) == ["gat", "gcn", "sage"]
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert sorted(t.params["model.net.conv"] for t in done) == ["gat", "gcn", "sage"]
    twins = [t for t in study.trials if t.state == TrialState.FAIL]
    assert twins  # the random draws did repeat (seeds fixed): the guard was exercised
    for t in twins:
        assert t.params == study.trials[t.user_attrs["duplicate_of"]].params
    assert study.best_value == 0.3
    # progress as trials start and end: trials done / total, best so far, elapsed
    lines = capsys.readouterr().out.splitlines()
    assert all(re.match(r"\[\d+:\d\d:\d\d\] ", line) for line in lines)
    assert lines[0].endswith("study c: [0/3 trials done]")
    started = [line for line in lines if " started " in line]
    assert len(started) == 3 and started[0].endswith("[0/3 trials done]")
    assert re.search(r"\[1/3 trials done, best val_acc 0\.\d{4} \(trial \d+\)\]$", started[1])
    assert lines[-1].split("] ", 1)[1].startswith(f"trial {done[-1].number} val_acc")
    best = study.best_trial.number
    assert lines[-1].endswith(f"[3/3 trials done, best val_acc 0.3000 (trial {best})]")


LR = "model.optimizer.lr: {type: float, low: 1.0e-3, high: 0.1, log: true}"
MALFORMED = [  # (file text, the key the error line names)
    ("experiment: fl_synthetic\nspace: {a: [unclosed\n", "line 2"),
    ("experiment: fl_synthetic\n\tspace: 1\n", "line"),  # a tab: not YAML
    ("experiment: [fedavg\n", "line 1"),
    (GOOD.replace("type: categorical,", "type: normal,"), "space.algorithm._target_.type"),
    (GOOD.replace("choices: [fedlightning.methods.fedavg.fedavg.FedAvg]", "choices: []"), ".choices"),
    (f"experiment: fl_synthetic\nspace: {{{LR.replace('low: 1.0e-3', 'low: 0.5')}}}\n"
     "objective: {metric: val_acc}\n", "space.model.optimizer.lr"),  # low > high
    (f"experiment: fl_synthetic\nspace: {{{LR.replace('1.0e-3', 'small')}}}\n"
     "objective: {metric: val_acc}\n", "space.model.optimizer.lr.low"),
    (f"experiment: fl_synthetic\nspace: {{{LR.replace('log: true', 'lgo: true')}}}\n"
     "objective: {metric: val_acc}\n", "space.model.optimizer.lr.lgo"),
    ("experiment: fl_synthetic\nspace: {a: {type: int, low: 1.5, high: 4}}\n"
     "objective: {metric: val_acc}\n", "space.a.low"),
    (GOOD.replace("experiment: fl_synthetic\n", ""), "experiment"),
    (GOOD.replace("objective: {metric: val_acc}\n", ""), "objective"),
    (GOOD.replace("objective: {metric: val_acc}", "objective: val_acc"), "objective"),
    ("experiment: fl_synthetic\nobjective: {metric: val_acc}\n", "space"),
    (GOOD + "sampler: tpe\n", "sampler"),
    (GOOD + "sampler: {name: tpe, startup: -1}\n", "sampler.startup"),
    (GOOD + "sampler: {name: random, startup: 3}\n", "sampler.startup"),
    (GOOD + "pruner: {name: median, warmup: 3}\n", "pruner"),
    (GOOD + "overrides: federation.rounds=2\n", "overrides"),
    (GOOD.replace("trials: 1", "trials: 2"), "trials"),  # one categorical point
    (GOOD.replace("fl_synthetic", "no_such_experiment"), "experiment"),
    (GOOD.replace("algorithm._target_:", "algorithm.no_such_key:"), "space.algorithm.no_such_key"),
    (GOOD + "storage: nosuchdb://x\n", "storage"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "key"), MALFORMED)
def test_malformed_sweep_file_is_one_line_exit_2(tmp_path, monkeypatch, capsys, text, key):
    """Through the CLI (in process): exit 2, one line naming the file and the key, no
    traceback, no study and no run written."""
    from fedlightning.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    bad = write(tmp_path / "bad.yaml", text)
    with pytest.raises(SystemExit) as e:
        main(["sweep", str(bad), "logger=none"])
    out = capsys.readouterr()
    assert e.value.code == 2, out.err
    (line,) = out.err.strip().splitlines()
    assert line.startswith("error:") and "Traceback" not in line
    assert "bad.yaml" in line and key in line, line
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "optuna.db").exists()


def test_start_from_defaults_runs_the_experiments_own_setting_first(tmp_path, monkeypatch):
    """``start_from_defaults: true``: trial 0 is the composed experiment's values of the
    searched keys (so tuning never ends below the defaults on validation), later trials are
    sampled; a default outside its range is one error naming the key."""
    monkeypatch.chdir(tmp_path)
    text = (
        "experiment: fl_synthetic\nspace:\n"
        "  model.optimizer.lr: {type: float, low: 1.0e-3, high: 0.1, log: true}\n"
        "  model.net.conv: {type: categorical, choices: [sage, gcn]}\n"
        "  federation.local_epochs: {type: int, low: 1, high: 9}\n"
        "objective: {metric: val_acc}\ntrials: 3\nsampler: {name: random, seed: 0}\n"
        "start_from_defaults: true\n"
    )
    spec = load_spec(write(tmp_path / "d.yaml", text))
    spec.storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    base = compose(["experiment=fl_synthetic", "algorithm=fedavg"])
    ran = []

    def fake_train(cfg, run_dir, observe):
        ran.append((cfg.model.optimizer.lr, cfg.model.net.conv, cfg.federation.local_epochs))
        return {"metrics": {"val_acc": 0.5}}

    study = Sweep(spec, tmp_path / "out", ["logger=none"], compose, fake_train).run()
    defaults = (base.model.optimizer.lr, base.model.net.conv, base.federation.local_epochs)
    assert ran[0] == defaults and len(ran) == 3
    assert study.trials[0].params == dict(zip(spec.space, defaults, strict=True))
    assert all(r != defaults for r in ran[1:])
    narrow = load_spec(
        write(tmp_path / "n.yaml", text.replace("low: 1, high: 9", "low: 20, high: 30"))
    )
    with pytest.raises(ConfigError, match=r"space\.federation\.local_epochs.*outside"):
        Sweep(narrow, tmp_path / "out", ["logger=none"], compose, fake_train)
    assert not load_spec(write(tmp_path / "g.yaml", GOOD)).start_from_defaults


def test_a_finished_seed_run_left_running_by_a_killed_sweep_is_closed(tmp_path):
    """A sweep killed after a seed run wrote its summary but before it ended its MLflow
    run left that run RUNNING forever; the resumed trial reads the summary and closes it."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from fedlightning.sweeps import Sweep

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("sweep")
    seed_run = client.create_run(exp).info.run_id  # RUNNING, as the killed process left it
    trial_run = client.create_run(exp).info.run_id
    run_dir = tmp_path / "trial_1" / "seed_0"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"metrics": {"val_acc": 0.5}}))
    (run_dir / "mlflow_run.json").write_text(json.dumps({"run_id": seed_run}))
    run = SimpleNamespace(client=client, run_id=trial_run)
    summary = Sweep.run_seed(SimpleNamespace(), run_dir, {}, 0, run, None)
    assert summary["metrics"]["val_acc"] == 0.5
    closed = client.get_run(seed_run)
    assert closed.info.status == "FINISHED" and closed.data.tags["closed_by"] == "sweep"
    assert closed.data.tags["mlflow.parentRunId"] == trial_run
    assert client.get_run(trial_run).info.status == "RUNNING"  # the trial's own: untouched
