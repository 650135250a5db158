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
