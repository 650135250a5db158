"""Seconds per task of FedTIP's baselines, side by side with FedTIP, one run each.

Runs ``python -m fedlightning train experiment=<name> max_tasks=N threads=1 logger=none`` for
every experiment name given (default: FedTIP and its seven published baselines on
``--dataset``), one after another in fresh processes sharing one ``FEDLIGHTNING_CACHE`` (the
bank, contexts and history graph are keyed by content: the first run of a stream builds
them, the others reuse them), and prints, per experiment, the mean and median of the
per-task wall time (``task_time_s`` of ``task_metrics.json``: a task's federation and
scoring), the run's wall time (process start to exit, setup and one-off exchanges
included), the uplink per task and the mean link-prediction AUC. A new method is added by
name: ``--experiments fedtip_bitcoin_alpha fedgnn_bitcoin_alpha``.

    python benchmarks/baseline_task_time.py [--dataset bitcoin_alpha] [--tasks 10] \\
        [--experiments NAME ...] [--methods fedtip fedgcn ...] [--cache DIR] [--out DIR] \\
        [--override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ["fedtip", "fedsage_plus", "fedgcn", "fedgnn", "feddy", "stfl", "feddgl", "fedlink"]


def run(name: str, tasks: int, out: Path, env: dict, overrides: list[str]) -> dict:
    """One run of experiment ``name``: its per-task times, wall time and summary."""
    cmd = [sys.executable, "-m", "fedlightning", "train", f"experiment={name}"]
    cmd += [f"max_tasks={tasks}", "threads=1", "logger=none", f"hydra.run.dir={out}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    per_task = json.loads((out / "task_metrics.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    times = [r["task_time_s"] for r in per_task]
    m = summary["metrics"]
    return {
        "experiment": name,
        "tasks": len(times),
        "s_per_task": statistics.fmean(times),
        "s_per_task_median": statistics.median(times),
        "wall_s": wall,
        "uplink_mib_per_task": m.get("uplink_mib_per_task", float("nan")),
        "auc_tlp": m.get("auc_tlp", float("nan")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="bitcoin_alpha")
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--experiments", nargs="+", help="experiment names (default: methods)")
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--cache", default=os.environ.get("FEDLIGHTNING_CACHE"))
    ap.add_argument("--out", help="run directories (default: a temporary one)")
    ap.add_argument("--override", nargs="*", default=[], help="extra KEY=VALUE for every run")
    args = ap.parse_args()
    names = args.experiments or [f"{m}_{args.dataset}" for m in args.methods]
    out = Path(args.out or tempfile.mkdtemp(prefix="baseline_task_time_"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.cache:
        env["FEDLIGHTNING_CACHE"] = args.cache
    rows = [run(n, args.tasks, out / n, env, args.override) for n in names]
    head = f"{'experiment':<30} {'tasks':>5} {'s/task':>8} {'median':>8} {'wall s':>8}"
    print(f"{head} {'up MiB/task':>12} {'auc_tlp':>8}")
    for r in rows:
        print(
            f"{r['experiment']:<30} {r['tasks']:>5} {r['s_per_task']:>8.2f} "
            f"{r['s_per_task_median']:>8.2f} {r['wall_s']:>8.1f} "
            f"{r['uplink_mib_per_task']:>12.3f} {r['auc_tlp']:>8.4f}"
        )
    (out / "baseline_task_time.json").write_text(json.dumps(rows, indent=2))
    print(f"rows: {out / 'baseline_task_time.json'}")


if __name__ == "__main__":
    main()
