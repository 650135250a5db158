"""`fedlightning report`: tables from MLflow equal the mean and std of the runs' summaries."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from fedlightning.report import render
from tests.inprocess import fl_ok

FL = str(Path(sys.executable).parent / "fedlightning")
METRICS = ("am", "fm", "fpr95")


def test_render_bolds_the_best_of_each_column():
    cell = lambda m, s: {"mean": m, "std": s, "std_over": "seeds", "n": 2, "values": []}  # noqa: E731
    one = {"mean": 0.641, "std": None, "std_over": None, "n": 1, "values": [0.641]}
    table = {
        "a": {"d": {"am": cell(0.5, 0.1), "fm": cell(0.2, 0.0)}},
        "b": {"d": {"am": cell(0.7, 0.05), "fm": cell(0.3, 0.01)}},
        "c": {"d": {"am": one, "fm": cell(0.4, 0.01)}},
    }
    md = render(table, ["am", "fm"], 2, "md")
    assert "| a | 0.50 ± 0.10 (n=2) | **0.20 ± 0.00 (n=2)** |" in md  # lower FM is better
    assert "| b | **0.70 ± 0.05 (n=2)** | 0.30 ± 0.01 (n=2) |" in md  # higher AM is better
    assert "| c | 0.64 (n=1) | 0.40 ± 0.01 (n=2) |" in md  # one seed: no spread shown
    tex = render(table, ["am", "fm"], 2, "tex")
    assert r"\textbf{0.70 $\pm$ 0.05 (n=2)}" in tex and r"\multicolumn{2}{c}{d}" in tex
    drift = {"a": {"d": {"d_fed_local_std": cell(0.1, 0.0)}}, "b": {"d": {"d_fed_local_std": one}}}
    assert "| a | **0.10 ± 0.00 (n=2)** |" in render(
        drift, ["d_fed_local_std"], 2, "md"
    )  # less drift


def parse(md: str) -> dict[str, list[str]]:
    rows = {}
    for line in md.splitlines()[2:]:
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_report_of_a_three_seed_multirun_equals_the_summaries(tmp_path):
    env = {
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }

    def fl(*args: str) -> subprocess.CompletedProcess:
        return fl_ok(list(args), tmp_path, env)  # in this process, as the console script

    # the default demo (FedOGL, class-incremental, synthetic) against FedAvg + replay, smaller:
    # two stages of one round, two clients (every cell still varies over the seeds)
    small = ["federation.rounds=1", "protocol.stream.stages=[2,1]", "federation.clients=2"]
    fl("train", "-m", "algorithm=fedogl,cil_fedavg_replay", "seed=0,1,2", *small)
    fl("train", "algorithm.replay=false", *small, "hydra.run.dir=ablation")
    fl("report", "--task", "cil", "--out", "rep")
    md = (tmp_path / "rep" / "cil_main_synthetic.md").read_text()  # one table per dataset

    groups = defaultdict(list)
    for p in (tmp_path / "multirun").rglob("summary.json"):
        s = json.loads(p.read_text())
        t = s["tags"]
        groups[t["method"] if t["variant"] == "full" else f"{t['method']}+{t['variant']}"].append(s)
    assert {k: len(v) for k, v in groups.items()} == {"fedogl": 3, "fedavg+replay": 3}
    rows = parse(md)
    assert set(rows) == set(groups)  # the ablation run is not a row of the main table
    exact = json.loads((tmp_path / "rep" / "cil_main_synthetic.json").read_text())
    for row, runs in groups.items():
        for i, m in enumerate(METRICS):
            values = [s["metrics"][m] for s in runs]
            mean, std = statistics.fmean(values), statistics.stdev(values)
            assert rows[row][i] == f"{mean:.3f} ± {std:.3f} (n=3)"
            assert exact[row]["synthetic"][m]["mean"] == mean
            assert exact[row]["synthetic"][m]["std"] == std
    for i in range(len(METRICS)):  # one bold cell per column
        assert (
            sum(line.split("|")[2 + i].strip().startswith("**") for line in md.splitlines()[2:])
            == 1
        )
    assert (tmp_path / "rep" / "cil_main_synthetic.tex").exists()
    assert (tmp_path / "rep" / "uplink_vs_am.png").exists()
    assert (tmp_path / "rep" / "acc_matrix_fedogl_synthetic.png").exists()

    # the same table from the run directories
    fl("report", "--dirs", "multirun", "--task", "cil", "--out", "rep_dirs")
    assert (tmp_path / "rep_dirs" / "cil_main_synthetic.md").read_text() == md

    # the ablation layout: variants of fedogl, the ablation run included
    fl("report", "--task", "cil", "--layout", "ablation", "--out", "rep", "--log")
    ablation = parse((tmp_path / "rep" / "cil_ablation_synthetic.md").read_text())
    assert set(ablation) == {"full", "no_replay"}
    assert re.fullmatch(r"\d\.\d{3} \(n=1\)", ablation["no_replay"][0])  # one seed, no ± 0


def test_no_matching_runs_is_a_one_line_error(tmp_path):
    (tmp_path / "empty").mkdir()
    r = subprocess.run(
        [FL, "report", "--dirs", "empty", "--task", "cil"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no finished runs" in r.stderr


def _summary(seed, rank, am, start=0, method="fedogl", variant="full"):
    return {
        "experiment": "x",
        "seed": seed,
        "metrics": {"am": am},
        "tags": {"method": method, "variant": variant, "dataset": "d", "task": "cil"},
        "params": {"algorithm.basis.rank": str(rank), "seed": str(seed), "logger.enabled": "x"},
        "start_time": start,
        "comm": {"uplink_mib": 1.0},
        "wall_time_s": 10.0,
        "rounds": 4,
    }


def test_repeated_runs_count_once_and_sensitivity_over_a_config_value(tmp_path):
    from fedlightning.errors import ConfigError
    from fedlightning.report import aggregate, select, sensitivity

    runs = [_summary(s, r, 0.1 * r + 0.01 * s) for r in (4, 8) for s in (0, 1)]
    rerun = {**_summary(0, 4, 0.9, start=5), "params": {**runs[0]["params"], "logger.x": "y"}}
    kept = select([*runs, rerun], "main", None)
    assert len(kept) == 4 and rerun in kept and runs[0] not in kept  # the newest of a config
    table = aggregate(kept, ["am", "s_per_round"], "main")
    assert table["fedogl"]["d"]["am"]["n"] == 4
    assert table["fedogl"]["d"]["s_per_round"]["mean"] == 2.5
    (path,) = sensitivity(kept, "algorithm.basis.rank", "am", "main", tmp_path)
    assert path.name == "sensitivity_algorithm.basis.rank_fedogl_d.png" and path.exists()
    with pytest.raises(ConfigError, match="differ"):
        sensitivity(kept, "seedless.key", "am", "main", tmp_path)


def _temporal(seed, families, tagged=True, auc_nc=0.6, auc_tlp=0.7):
    metrics = {"auc_tlp": auc_tlp, "auc_ilp": auc_tlp - 0.1}
    if "nc" in families:
        metrics["auc_nc"] = auc_nc
    tags = {"method": "fedtip", "variant": "full", "dataset": "d", "task": "temporal"}
    if tagged:
        tags["families"] = ",".join(families)
    return {
        "experiment": "t",
        "seed": seed,
        "families": list(families),
        "metrics": metrics,
        "tags": {**tags, "backbone": "tgn"},
        "comm": {"uplink_mib": 1.0},
        "wall_time_s": 1.0,
        "rounds": 2,
    }


def test_temporal_tables_select_a_task_family_by_tag_old_runs_included(tmp_path):
    """`--family nc` keeps the runs that ran node classification: runs tagged `families`
    and runs made before that tag (their summary lists the families)."""
    runs = {
        "both": _temporal(0, ["nc", "lp"], auc_nc=0.6),
        "old_both": _temporal(1, ["nc", "lp"], tagged=False, auc_nc=0.8),
        "lp_only": _temporal(2, ["lp"]),
    }
    for name, s in runs.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(s))
    r = subprocess.run(
        [FL, "report", "--dirs", "runs", "--task", "temporal", "--family", "nc", "--out", "rep"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    table = json.loads((tmp_path / "rep" / "temporal_main_d.json").read_text())
    cell = next(iter(next(iter(table.values())).values()))
    assert set(cell) == {"auc_nc"}  # the family's metric only
    assert cell["auc_nc"]["n"] == 2 and cell["auc_nc"]["mean"] == pytest.approx(0.7)


def _cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """`fedlightning ARGV` in process: exit status and the stderr lines."""
    from fedlightning.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_unknown_task_or_missing_store_is_one_line_and_creates_nothing(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code, err = _cli(["report", "--task", "clil"], capsys)
    assert code == 2 and len(err) == 1 and "`--task`" in err[0] and "'clil'" in err[0]
    assert "cil" in err[0] and "experiment-name" not in err[0]
    code, err = _cli(["report", "--task", "cil"], capsys)  # no store here yet
    assert code == 2 and len(err) == 1 and "no MLflow store at sqlite:///mlflow.db" in err[0]
    code, err = _cli(["report", "--tag", "seed"], capsys)
    assert code == 2 and len(err) == 1 and "`--tag`" in err[0]
    assert list(tmp_path.iterdir()) == []  # neither ./mlflow.db nor reports/


def _run(dataset: str, seed: int, am: float, tasks: int | None = None) -> dict:
    s = _summary(seed, 4, am)
    s["tags"] = {**s["tags"], "dataset": dataset}
    if tasks is not None:  # a FedTIP-like run: its value is already a mean over tasks
        s["metrics"]["am_std"], s["tasks_done"] = 0.05, tasks
    return s


def test_one_table_per_dataset_and_n_in_every_cell(tmp_path):
    runs = {
        "cora0": _run("cora", 0, 0.6),
        "cora1": _run("cora", 1, 0.7),
        "demo0": _run("synthetic", 0, 0.9),
    }
    for name, s in runs.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(s))

    def report(*extra: str) -> None:
        cmd = [FL, "report", "--dirs", "runs", "--task", "cil", "--metrics", "am", *extra]
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

    report("--out", "per")
    cora = parse((tmp_path / "per" / "cil_main_cora.md").read_text())
    mean, std = statistics.fmean([0.6, 0.7]), statistics.stdev([0.6, 0.7])
    assert cora == {"fedogl": [f"{mean:.3f} ± {std:.3f} (n=2)"]}
    demo = parse((tmp_path / "per" / "cil_main_synthetic.md").read_text())
    assert demo == {"fedogl": ["0.900 (n=1)"]}  # the demo stays out of the Cora table
    assert not (tmp_path / "per" / "cil_main.md").exists()
    report("--out", "both", "--dataset", "cora", "synthetic")  # asked: side by side
    md = (tmp_path / "both" / "cil_main.md").read_text()
    assert md.splitlines()[0] == "| method | cora AM | synthetic AM |"
    exact = json.loads((tmp_path / "both" / "cil_main.json").read_text())
    assert exact["fedogl"]["synthetic"]["am"]["n"] == 1
    assert exact["fedogl"]["synthetic"]["am"]["std"] is None


def test_one_run_shows_its_spread_over_tasks_as_such():
    from fedlightning.report import aggregate

    table = aggregate([_run("d", 0, 0.641, tasks=40)], ["am"], "main")
    assert table["fedogl"]["d"]["am"]["std_over"] == "tasks"
    md = render(table, ["am"], 3, "md")
    assert "0.641 ± 0.050 (n=1, ± over 40 tasks)" in md


def test_uplink_mib_and_seconds_per_round_columns_from_the_summaries(tmp_path):
    """`--metrics ...,uplink_mib,s_per_round`: the runs' ledger totals (summary "comm") and
    measured mean round times (summary "timing"), mean ± std over seeds with n; a run made
    before runs measured their rounds falls back to wall time / rounds."""

    def run(seed: int, mib: float, spr: float | None, wall: float = 0.0) -> dict:
        s = {
            "experiment": "cil_topoood_cora",
            "seed": seed,
            "metrics": {"am": 0.5 + 0.1 * seed},
            "tags": {"method": "topoood", "variant": "full", "dataset": "cora", "task": "cil"},
            "comm": {"uplink_mib": mib, "downlink_mib": 2 * mib},
            "wall_time_s": wall,
            "rounds": 4,
        }
        if spr is not None:
            s["timing"] = {"s_per_round": spr, "rounds_timed": 4.0}
        return s

    runs = {"a": run(0, 10.0, 0.5, wall=99.0), "b": run(1, 12.0, 0.7), "c": run(2, 11.0, None, 2.4)}
    for name, s in runs.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(s))
    cmd = [FL, "report", "--dirs", "runs", "--task", "cil", "--out", "out"]
    cmd += ["--metrics", "am,uplink_mib,s_per_round"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "out" / "cil_main_cora.md").read_text()
    assert md.splitlines()[0] == "| method | cora AM | cora uplink MiB | cora s/round |"
    spr = [0.5, 0.7, 2.4 / 4]  # the third: wall time / rounds
    row = parse(md)["topoood"]
    mib = [10.0, 12.0, 11.0]
    assert row[1] == f"{statistics.fmean(mib):.3f} ± {statistics.stdev(mib):.3f} (n=3)"
    assert row[2] == f"{statistics.fmean(spr):.3f} ± {statistics.stdev(spr):.3f} (n=3)"
    exact = json.loads((tmp_path / "out" / "cil_main_cora.json").read_text())
    assert exact["topoood"]["cora"]["s_per_round"]["values"] == pytest.approx(spr)
    assert exact["topoood"]["cora"]["uplink_mib"]["values"] == mib


def test_seconds_per_task_from_the_summaries_timing_or_wall_time():
    """`s_per_task` (a default column of `--task temporal`): the mean task time the run
    measured (summary "timing", from TaskLoop.timing), else wall time / tasks done."""
    from fedlightning.federation.task_loop import TaskLoop
    from fedlightning.report import DEFAULT_METRICS, value

    assert "s_per_task" in DEFAULT_METRICS["temporal"].split(",")
    loop = TaskLoop.__new__(TaskLoop)
    loop.results = [{"task_time_s": 2.0}, {"task_time_s": 4.0}, {"task_time_s": 9.0}]
    timing = loop.timing()
    assert timing == {"s_per_task": 5.0, "tasks_timed": 3}
    s = {"metrics": {}, "timing": timing, "wall_time_s": 100.0, "tasks_done": 3}
    assert value(s, "s_per_task") == 5.0
    del s["timing"]
    assert value(s, "s_per_task") == pytest.approx(100.0 / 3)


def test_fig3_panels_are_the_seed_means_of_each_client_and_class(tmp_path):
    from fedlightning.report import mean_terms, plots

    # two seeds of one method: (class 0, client 1) in both, (class 2, client 0) in one
    a = [[0, 1, 0.2], [2, 0, 0.5]]
    b = [[0, 1, 0.4]]
    assert mean_terms([a, b]) == [[0, 1, pytest.approx(0.3)], [2, 0, 0.5]]
    runs = []
    for seed, terms in ((0, a), (1, b)):
        s = _run("cora", seed, 0.6)
        runs.append({**s, "prototype_terms": [[[0, 1, 9.9]], terms]})  # the last stage counts
    paths = plots(runs, "main", "am", tmp_path)
    assert (
        tmp_path / "d_fed_terms_cora.png" in paths and (tmp_path / "d_fed_terms_cora.png").exists()
    )
