"""A warm FedTIP run of this checkout against a reference commit, side by side, with a
bitwise check of the results.

Checks the reference commit out in a git worktree (``.cache/fedtip_warm/<sha>``, reused if
there, removed at the end unless ``--keep``) and runs the same command in both trees, each a
fresh ``python -m fedlightning train experiment=X max_tasks=N threads=1 logger=none``
process with ``PYTHONPATH`` and the working directory set to its tree and one shared
``FEDLIGHTNING_CACHE`` (bank and contexts are keyed by content: ``--warmup`` untimed passes
first fill or reuse them). This checkout runs once per ``--workers`` value
(``task_workers=W``). Runs are interleaved (ref, head, head with 2 workers, ref, ...), so
machine noise hits every side alike. Prints each side's median wall time (process start to
exit) and CPU time (user + system of the process and its task workers: less sensitive
to other jobs on a shared machine than the wall time), the ratios ref/side of both, and
whether every side's ``summary.json`` ``metrics`` and ``comm`` equal the reference's
bitwise (the wall times aside). ``--workers`` takes ``auto`` (the default setting) too; the
reference runs with its own default.

    python benchmarks/fedtip_warm.py [--ref e220bef] [--experiment fedtip_bitcoin_alpha] \\
        [--tasks 100] [--repeats 2] [--warmup 1] [--workers auto 1] [--cache DIR] [--data DIR] \\
        [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedlightning.recipes import recipe_overrides

REPO = Path(__file__).resolve().parents[1]
TIMING = ("task_time_s", "wall_time_s", "time_s")


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def results(summary: dict) -> dict:
    """What must not change: the metrics and the communication, wall times left out."""

    def clean(d):
        if isinstance(d, dict):
            return {k: clean(v) for k, v in d.items() if not any(t in k for t in TIMING)}
        return d

    return {"metrics": clean(summary["metrics"]), "comm": clean(summary["comm"])}


def cpu_of_children() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def run(tree: Path, env: dict, args: list[str], out: Path) -> tuple[float, float]:
    """Wall and CPU time of one ``fedlightning train`` in ``tree`` (its summary in ``out``);
    the CPU time counts its task workers (children it waited for)."""
    cmd = [sys.executable, "-m", "fedlightning", "train", *args, f"hydra.run.dir={out}"]
    cpu0, t0 = cpu_of_children(), time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=tree, env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True
    )
    wall, cpu = time.perf_counter() - t0, cpu_of_children() - cpu0
    if proc.returncode:
        raise SystemExit(f"{tree}: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="e220bef")
    ap.add_argument("--experiment", default="fedtip_bitcoin_alpha")
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", nargs="+", default=["auto", "1"], help="ints or auto")
    ap.add_argument("--cache", default=os.environ.get("FEDLIGHTNING_CACHE"))
    ap.add_argument("--data", default=os.environ.get("FEDLIGHTNING_DATA", str(REPO / "data")))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes first (0: cache warm)")
    args = ap.parse_args()
    sha = git("rev-parse", "--short", args.ref)
    ref_tree = REPO / ".cache" / "fedtip_warm" / sha
    if not ref_tree.exists():
        git("worktree", "add", "--detach", str(ref_tree), sha)
    tmp = Path(tempfile.mkdtemp(prefix="fedtip_warm_"))
    cache = args.cache or str(tmp / "cache")
    env = {
        **os.environ,
        "FEDLIGHTNING_CACHE": cache,
        "FEDLIGHTNING_DATA": args.data,
        "OMP_NUM_THREADS": "1",
    }
    base = [f"max_tasks={args.tasks}", "threads=1", "logger=none"]
    # each tree's own form of the recipe: an older checkout's own file, or the composed form
    sides = {"ref": (ref_tree, [*recipe_overrides(args.experiment, ref_tree / "conf"), *base])}
    head = [*recipe_overrides(args.experiment, REPO / "conf"), *base]  # recipes: protocol x data
    for w in args.workers:
        sides[f"head w={w}"] = (REPO, [*head, f"task_workers={w}"])
    times: dict[str, list[float]] = {s: [] for s in sides}
    cpus: dict[str, list[float]] = {s: [] for s in sides}
    summaries: dict[str, str] = {}
    try:
        for rep in range(args.repeats + args.warmup):  # warm-up passes fill the cache
            for side, (tree, over) in sides.items():
                out = tmp / f"{side.replace(' ', '_').replace('=', '')}-{rep}"
                wall, cpu = run(tree, env, over, out)
                summary = results(json.loads((out / "summary.json").read_text()))
                summaries[side] = json.dumps(summary, sort_keys=True)  # NaN == NaN as text
                if rep >= args.warmup:
                    times[side].append(wall)
                    cpus[side].append(cpu)
                print(f"pass {rep} {side:11s} {wall:7.1f} s wall {cpu:7.1f} s CPU", flush=True)
    finally:
        if not args.keep:
            git("worktree", "remove", "--force", str(ref_tree))
    ref, ref_cpu = statistics.median(times["ref"]), statistics.median(cpus["ref"])
    print(f"\n{args.experiment}, {args.tasks} tasks, threads=1, median of {args.repeats}:")
    for side, ts in times.items():
        med, cpu = statistics.median(ts), statistics.median(cpus[side])
        same = summaries[side] == summaries["ref"]
        print(
            f"  {side:11s} {med:7.1f} s wall (ref/side {ref / med:5.2f}x)  {cpu:7.1f} s CPU "
            f"(ref/side {ref_cpu / cpu:5.2f}x)  results == ref: {same}"
        )


if __name__ == "__main__":
    main()
