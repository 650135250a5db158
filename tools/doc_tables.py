"""Tables in docs/ regenerated from committed run summaries, through ``fedlightning report``.

A table in a doc that comes from runs sits between two markers; the first names the report
that makes it:

    <!-- report: --task temporal --dirs docs/results/fedtip_learning --dataset bitcoin_alpha -->
    | method | ... |
    <!-- /report -->

``--dirs`` point at committed folders of the runs' trimmed summaries (:func:`keep`), so the
numbers in the doc are the report's, not copied by hand. ``--check`` regenerates every
marked table and lists those that differ (``tests/test_doc_tables.py`` runs it); ``--write``
puts the regenerated tables in place; ``--keep RUN_DIR... --into DIR`` stores runs' trimmed
``summary.json`` and ``config.yaml`` under ``DIR`` for a table to read:

    python tools/doc_tables.py --keep outputs/bitcoin_alpha/fedtip_bitcoin_alpha/* --into docs/results/x
    python tools/doc_tables.py --write
    python tools/doc_tables.py --check
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- report: (?P<args>.+?) -->\n(?P<body>.*?)<!-- /report -->", re.S)
#: what ``fedlightning report`` reads of a run's summary (the rest stays with the run)
KEPT = ("experiment", "seed", "tags", "metrics", "timing", "tasks_done", "rounds")
KEPT += ("wall_time_s", "families", "start_time")
COMM_KEPT = ("uplink_mib", "downlink_mib", "recurrent_downlink_mib_per_task")


def keep(run_dirs: list[Path], into: Path) -> list[Path]:
    """Each run's ``summary.json`` cut to what a report reads, and its ``config.yaml``
    (what tells two configurations apart), under ``into/<run folder name>``."""
    written = []
    for run in run_dirs:
        summary = json.loads((run / "summary.json").read_text())
        kept = {k: summary[k] for k in KEPT if k in summary}
        comm = summary.get("comm", {})
        kept["comm"] = {k: comm[k] for k in COMM_KEPT if k in comm}
        out = into / run.name
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        if (run / "config.yaml").exists():
            shutil.copy(run / "config.yaml", out / "config.yaml")
        written.append(out)
    return written


def regenerate(args: str, root: Path = REPO) -> str:
    """The Markdown table ``fedlightning report <args>`` makes (``--dirs`` relative to
    ``root``); it must make one table (name the datasets with ``--dataset``)."""
    from fedlightning.report import main as report

    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(root):
        argv = [*shlex.split(args), "--out", tmp, "--name", "table"]
        with contextlib.redirect_stdout(io.StringIO()):
            report(argv)
        tables = sorted(Path(tmp).glob("table*.md"))
        if len(tables) != 1:
            raise ValueError(f"report {args!r} made {len(tables)} tables; name one --dataset set")
        return tables[0].read_text()


def blocks(text: str) -> list[re.Match]:
    return list(BLOCK.finditer(text))


def check(paths: list[Path], root: Path = REPO) -> list[str]:
    """Every marked table of ``paths`` that its report does not make as written."""
    stale = []
    for path in paths:
        for m in blocks(path.read_text()):
            if regenerate(m["args"], root).strip() != m["body"].strip():
                stale.append(f"{path.relative_to(root)}: {m['args']}")
    return stale


def write(paths: list[Path], root: Path = REPO) -> int:
    """Put each marked table's regenerated form in place; the number of tables written."""
    done = 0
    for path in paths:
        text = path.read_text()

        def fresh(m: re.Match) -> str:
            return f"<!-- report: {m['args']} -->\n{regenerate(m['args'], root).strip()}\n<!-- /report -->"

        new, n = BLOCK.subn(fresh, text)
        if new != text:
            path.write_text(new)
        done += n
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="list the tables that differ")
    ap.add_argument("--write", action="store_true", help="regenerate the tables in place")
    ap.add_argument("--keep", nargs="+", type=Path, help="run folders to store for a table")
    ap.add_argument("--into", type=Path, help="with --keep: the folder under docs/results")
    args = ap.parse_args()
    docs = sorted((REPO / "docs").glob("*.md"))
    if args.keep:
        if args.into is None:
            ap.error("--keep needs --into")
        print("\n".join(str(p) for p in keep(args.keep, args.into)))
    if args.write:
        print(f"{write(docs)} tables regenerated")
    if args.check:
        stale = check(docs)
        print("\n".join(stale) if stale else "every marked table is its report's")
        return 1 if stale else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
