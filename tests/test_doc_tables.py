"""The tables in docs/ marked as a report's are that report of the committed run summaries
(``tools/doc_tables.py``): a number changed by hand, or a summary changed without the doc,
fails here."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import doc_tables  # noqa: E402


def summary(seed: int, am: float) -> dict:
    return {
        "experiment": "cil_fedogl_d",
        "seed": seed,
        "tags": {"task": "cil", "method": "fedogl", "dataset": "d", "variant": "full"},
        "metrics": {"am": am, "fm": 0.2, "fpr95": 0.9},
        "comm": {"uplink_mib": 1.0},
        "rounds": 3,
        "wall_time_s": 1.0,
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for name, seed, am in (("a", 0, 0.5), ("b", 1, 0.7)):
        (tmp_path / "res" / name).mkdir(parents=True)
        (tmp_path / "res" / name / "summary.json").write_text(json.dumps(summary(seed, am)))
    (tmp_path / "docs").mkdir()
    return tmp_path


def test_a_marked_table_is_regenerated_and_a_hand_edit_is_caught(root):
    args = "--task cil --dirs res --dataset d --metrics am"
    table = doc_tables.regenerate(args, root)
    mean, std = statistics.fmean([0.5, 0.7]), statistics.stdev([0.5, 0.7])
    assert f"{mean:.3f} ± {std:.3f} (n=2)" in table  # 0.600 ± 0.141
    doc = root / "docs" / "x.md"
    doc.write_text(f"text\n<!-- report: {args} -->\n{table}<!-- /report -->\nmore\n")
    assert doc_tables.check([doc], root) == []
    doc.write_text(doc.read_text().replace("0.600", "0.610"))  # a number edited by hand
    assert doc_tables.check([doc], root) == [f"docs/x.md: {args}"]
    assert doc_tables.write([doc], root) == 1 and doc_tables.check([doc], root) == []
    assert doc.read_text().startswith("text\n") and doc.read_text().endswith("more\n")


def test_keep_stores_what_a_report_reads(root, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    full = {**summary(0, 0.5), "run_dir": "/somewhere", "comm": {"uplink_mib": 2.0, "fields": {}}}
    (run / "summary.json").write_text(json.dumps(full))
    (out,) = doc_tables.keep([run], tmp_path / "kept")
    kept = json.loads((out / "summary.json").read_text())
    assert "run_dir" not in kept and kept["comm"] == {"uplink_mib": 2.0}
    assert kept["metrics"] == full["metrics"] and kept["tags"] == full["tags"]


def test_every_marked_table_in_the_docs_is_its_report():
    docs = sorted((REPO / "docs").glob("*.md"))
    assert any(doc_tables.blocks(p.read_text()) for p in docs)  # at least one is marked
    assert doc_tables.check(docs) == []


def tuned_eval(method: str, seed: int, tlp: list[float]) -> dict:
    ilp = [v - 0.01 for v in tlp]
    per = {"auc_tlp": tlp, "auc_ilp": ilp}
    return {
        "method": method,
        "stream": "s",
        "protocol_seed": seed,
        "tasks": len(tlp),
        "metrics": {
            k: {"mean": statistics.fmean(v), "std": statistics.stdev(v), "per_task": v}
            for k, v in per.items()
        },
    }


def test_the_tuned_table_gives_seed_means_task_stds_and_paired_margins(tmp_path):
    """``--tuned DIR`` markers: the numbers below are computed by hand."""
    runs = {
        ("zero_shot", 1): [0.5, 0.5],
        ("zero_shot", 2): [0.6, 0.6],
        ("fedtip_residual", 1): [0.7, 0.9],  # differences 0.2, 0.4: seed mean 0.3
        ("fedtip_residual", 2): [0.7, 0.7],  # differences 0.1, 0.1: seed mean 0.1
    }
    (tmp_path / "t" / "eval").mkdir(parents=True)
    (tmp_path / "t" / "studies").mkdir()
    for (m, seed), v in runs.items():
        rec = tuned_eval(m, seed, v)
        (tmp_path / "t" / "eval" / f"{m}_s_p{seed}.json").write_text(json.dumps(rec))
    study = {
        "trials": [{"value": 0.6}, {"value": 0.75}],
        "wall_s": 12.3,
        "default_value": 0.6,
        "best": {"value": 0.75, "params": {"algorithm.lr": 0.00123, "federation.local_epochs": 3}},
    }
    (tmp_path / "t" / "studies" / "fedtip_residual_s.json").write_text(json.dumps(study))
    table = doc_tables.regenerate("--tuned t", tmp_path)
    lines = table.splitlines()
    # zero-shot: seed means 0.5, 0.6 -> 0.550 +- 0.0707; over-task stds 0, 0
    assert (
        lines[2]
        == "| s | zero_shot | 0 | - | - | 2 x 2 | 0.550 ± 0.071 (0.000) | 0.540 ± 0.071 (0.000) | - | - |"
    )
    # fedtip: seed means 0.8, 0.7 -> 0.750 +- 0.0707; task stds 0.1414, 0 -> 0.071
    # minus zero-shot: seed means 0.3, 0.1 -> 0.2, 2 SE over seeds 2 * 0.1414 / sqrt(2) = 0.200;
    # pooled (0.2, 0.4, 0.1, 0.1): std 0.1414, 2 SE 2 * 0.1414 / 2 = 0.141
    assert lines[3] == (
        "| s | fedtip_residual | 2 | 12 | 0.750 | 2 x 2 | 0.750 ± 0.071 (0.071) "
        "| 0.740 ± 0.071 (0.071) | +0.2000 ± 0.2000 / 0.1414 | - |"
    )
    assert "| s | fedtip_residual | 0.600 | lr 0.00123, local_epochs 3 |" in table
    other = doc_tables.regenerate("--tuned t t/studies --against fedtip_residual", tmp_path)
    # zero-shot minus fedtip: -0.2, 2 SE over seeds 0.200, over the four pairs 0.141
    assert "| T-LP minus fedtip_residual |" in other.splitlines()[0]
    assert other.splitlines()[2].endswith("| -0.2000 ± 0.2000 / 0.1414 |")


def test_the_tuned_table_reads_studies_from_several_folders(tmp_path):
    """``--tuned DIR A B``: a method's study is read from the first folder that holds it (the
    Table 2 style's baselines beside FedTIP's study of the Table 3 style)."""
    (tmp_path / "t" / "eval").mkdir(parents=True)
    for m, v in (("zero_shot", [0.5, 0.5]), ("fedtip_residual", [0.7, 0.9]), ("stfl", [0.6, 0.8])):
        rec = tuned_eval(m, 1, v)
        (tmp_path / "t" / "eval" / f"{m}_s_p1.json").write_text(json.dumps(rec))

    def study(wall: float, value: float) -> dict:
        return {
            "trials": [{"value": value}] * 3,
            "wall_s": wall,
            "default_value": value,
            "best": {"value": value, "params": {"algorithm.lr": 0.01}},
        }

    for folder, name, wall in (
        ("a", "stfl", 5.0),
        ("b", "fedtip_residual", 7.0),
        ("b", "stfl", 9.0),
    ):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / f"{name}_s.json").write_text(json.dumps(study(wall, 0.7)))
    lines = doc_tables.regenerate("--tuned t a b --against fedtip_residual", tmp_path).splitlines()
    rows = {line.split(" | ")[1]: line for line in lines[2:5]}
    # stfl from a (5 s, not b's 9 s); fedtip from b; one seed, so the seed margin is 0
    assert rows["stfl"].startswith("| s | stfl | 3 | 5 | 0.700 | 1 x 2 | 0.700 ± 0.000 (0.141)")
    # stfl minus fedtip: -0.1, -0.1 -> mean -0.1, pooled std 0
    assert rows["stfl"].endswith("| -0.1000 ± 0.0000 / 0.0000 |")
    assert rows["fedtip_residual"].startswith("| s | fedtip_residual | 3 | 7 | 0.700 |")
    assert rows["zero_shot"].startswith("| s | zero_shot | 0 | - | - |")
