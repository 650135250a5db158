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

A marker whose arguments start with ``--tuned DIR`` is not a ``fedlightning report`` but the
tuned FedTIP-side table of ``benchmarks/fedtip_tuning.py``'s studies and evaluations under
``DIR`` (:func:`tuned_tables`): the means over protocol seeds with the std over seeds beside
the over-task std, and paired differences with two standard errors.
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


#: the rows of the tuned table, in this order (others after them, by name)
TUNED_ORDER = ("zero_shot", "fedtip_residual", "fedtip_paper", "prompt_fedavg")
TUNED_ORDER += ("prompt_central", "dygprompt_fedavg", "dygprompt_central")


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, var**0.5


def _paired(runs: dict, other: dict, metric: str) -> str:
    """``runs`` minus ``other`` (both ``{seed: eval record}``), paired per task within a seed:
    the mean difference (four digits: the differences are small), two standard errors over the seeds' mean differences, and two over
    every (seed, task) difference."""
    seeds = sorted(set(runs) & set(other))
    per_seed, pooled = [], []
    for s in seeds:
        a, b = (r[s]["metrics"][metric]["per_task"] for r in (runs, other))
        if len(a) != len(b):
            raise ValueError(f"seed {s}: {len(a)} tasks against {len(b)}")
        d = [x - y for x, y in zip(a, b, strict=True)]
        per_seed.append(sum(d) / len(d))
        pooled += d
    if not seeds:
        return "-"
    mean, sd_seed = _mean_std(per_seed)
    _, sd_task = _mean_std(pooled)
    se_seed = 2 * sd_seed / len(per_seed) ** 0.5
    se_task = 2 * sd_task / len(pooled) ** 0.5
    return f"{mean:+.4f} ± {se_seed:.4f} / {se_task:.4f}"


def tuned_tables(
    folder: Path,
    studies_dir: Path | list[Path] | None = None,
    against: tuple[str, ...] = ("zero_shot", "prompt_fedavg"),
) -> str:
    """The tuned table (module docstring) from ``folder/studies/*.json`` and
    ``folder/eval/*.json``: per stream and method, the study's trials, wall time and best
    validation value; the test T-LP and I-LP as mean ± std over the protocol seeds with the
    mean over-task std in brackets; the test T-LP minus the zero-shot row and minus
    ``prompt_fedavg`` (± two standard errors over seeds / over seed-task pairs); then each
    method's best setting. ``studies_dir``: the studies' folder (or folders, the first
    that holds a method's study wins), when not ``folder/studies``; ``against``: the rows
    the differences are taken to."""
    dirs = studies_dir if isinstance(studies_dir, list) else [studies_dir or folder / "studies"]
    studies: dict = {}
    for d in dirs:
        for p in sorted(d.glob("*.json")):
            studies.setdefault(p.stem, json.loads(p.read_text()))
    evals: dict = {}
    for p in sorted((folder / "eval").glob("*.json")):
        r = json.loads(p.read_text())
        evals.setdefault(r["stream"], {}).setdefault(r["method"], {})[r["protocol_seed"]] = r
    head = (
        "| stream | method | trials | study s | best val T-LP | seeds x tasks | test T-LP | test I-LP "
        + "".join(f"| T-LP minus {o.replace('_shot', '-shot')} " for o in against)
        + "|"
    )
    lines, settings = (
        [head, "|---" * (8 + len(against)) + "|"],
        [
            "| stream | method | val T-LP at the defaults (trial 0) | best setting |",
            "|---|---|---|---|",
        ],
    )
    for stream in sorted(evals):
        rows = evals[stream]
        order = [m for m in TUNED_ORDER if m in rows] + sorted(set(rows) - set(TUNED_ORDER))
        for m in order:
            runs, st = rows[m], studies.get(f"{m}_{stream}")
            cells = []
            for k in ("auc_tlp", "auc_ilp"):
                means = [runs[s]["metrics"][k]["mean"] for s in sorted(runs)]
                within = [runs[s]["metrics"][k]["std"] for s in sorted(runs)]
                mean, sd = _mean_std(means)
                cells.append(f"{mean:.3f} ± {sd:.3f} ({sum(within) / len(within):.3f})")
            vs = [
                _paired(runs, rows[o], "auc_tlp") if o in rows and o != m else "-" for o in against
            ]
            tasks = sorted({r["tasks"] for r in runs.values()})
            study = (
                [str(len(st["trials"])), f"{st['wall_s']:.0f}", f"{st['best']['value']:.3f}"]
                if st
                else ["0", "-", "-"]
            )
            lines.append(
                f"| {stream} | {m} | {' | '.join(study)} | {len(runs)} x {'/'.join(map(str, tasks))} "
                f"| {' | '.join(cells)} | {' | '.join(vs)} |"
            )
            if st:
                shown = ", ".join(
                    f"{k.split('.')[-1]} {v:.3g}"
                    if isinstance(v, float)
                    else f"{k.split('.')[-1]} {v}"
                    for k, v in st["best"]["params"].items()
                )
                default = st.get("default_value")
                default = "-" if default is None else f"{default:.3f}"
                settings.append(f"| {stream} | {m} | {default} | {shown} |")
    return "\n".join(lines) + "\n\n" + "\n".join(settings) + "\n"


def regenerate(args: str, root: Path = REPO) -> str:
    """The Markdown table ``fedlightning report <args>`` makes (``--dirs`` relative to
    ``root``); it must make one table (name the datasets with ``--dataset``). Arguments
    ``--tuned DIR [STUDIES...] [--against A,B]``: :func:`tuned_tables` of ``root / DIR`` (the
    folders of its studies, the rows the differences are taken to)."""
    if args.startswith("--tuned "):
        words = args.split()[1:]
        against = ("zero_shot", "prompt_fedavg")
        if "--against" in words:
            i = words.index("--against")
            against, words = tuple(words[i + 1].split(",")), words[:i] + words[i + 2 :]
        dirs = [root / d for d in words]
        return tuned_tables(dirs[0], dirs[1:] or None, against)
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
