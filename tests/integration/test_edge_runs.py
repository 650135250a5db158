"""Edge runs a user reaches from the documented commands: they finish with exit 0, and a
metric that cannot be computed prints as ``-`` while the log says why."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from fedlightning.programs import metric_text
from tests.inprocess import fl_ok


def only_run(root: Path) -> Path:
    (run,) = [p.parent for p in root.glob("outputs/*/*/*/summary.json")]
    return run


def test_metric_text_prints_a_dash_for_what_was_not_computed():
    assert metric_text(0.25) == "0.2500"
    assert metric_text(None) == "-" and metric_text(float("nan")) == "-"


def test_one_stage_class_incremental_run_is_plain_fl_with_open_set_metrics(tmp_path):
    env = {"FEDLIGHTNING_CACHE": str(tmp_path / "cache")}
    over = ["protocol.stream.stages=[3]", "federation.rounds=1", "logger=none"]
    r = fl_ok(["train", *over], tmp_path, env)
    run = only_run(tmp_path)
    s = json.loads((run / "summary.json").read_text())
    m = s["metrics"]
    (classes,) = s["stream"]["stages"]
    assert len(classes) == 3 and s["acc_matrix"] == [[m["am"]]]
    # one stage: its known classes are the run's, so AM is the closed-set test accuracy
    assert m["am"] == pytest.approx(m["test_acc"], abs=1e-12)
    assert m["fm"] == 0.0 and 0.0 <= m["fpr95"] <= 1.0 and 0.0 <= m["auroc_ood"] <= 1.0
    assert f"fpr95            {m['fpr95']:.4f}" in r.stdout
    # the files a run writes atomically get the modes of those written in place
    mode = stat.S_IMODE((run / "config.yaml").stat().st_mode)
    assert {stat.S_IMODE((run / f).stat().st_mode) for f in ("summary.json", "stream.json")} == {
        mode
    }
    assert mode & 0o044  # readable by group and others under the usual umask


@pytest.mark.slow
def test_untrained_fedtip_on_a_labelled_stream_prints_a_dash_for_auc_nc(
    tmp_path, shared_data, shared_cache
):
    env = {"FEDLIGHTNING_DATA": str(shared_data), "FEDLIGHTNING_CACHE": str(shared_cache)}
    over = [
        "experiment=temporal_bitcoin_alpha",
        "algorithm=fedtip",
        "federation.rounds=0",
        "max_tasks=2",
        "bank.epochs=1",
        "bank.max_events=2000",
        "logger=none",
    ]
    r = fl_ok(["train", *over], tmp_path, env)
    run = only_run(tmp_path)
    m = json.loads((run / "summary.json").read_text())["metrics"]
    # no client message observed a class: no prototype to score nodes with
    assert m["auc_nc"] is None and 0.0 <= m["auc_tlp"] <= 1.0
    assert any(line.split() == ["auc_nc", "-", "+-", "-"] for line in r.stdout.splitlines())
    log = next(run.glob("*.log")).read_text()
    assert "auc_nc not scored" in log
