"""FedAvg's, FedIIH's and FedSSP's rounds on the 22k-node graph, side by side.

Each method runs the same class-incremental stream (``experiment=cil_cora
dataset=synthetic_20k partition=random``, stages ``[2, 1]``, ``--rounds`` rounds per stage,
5 clients, 2 local epochs, ``threads=1 logger=none``) in a fresh ``python -m fedlightning
train`` process, one after the other on the same machine; FedAvg is ``cil_fedavg_replay``
(FedAvg with the same replay budget and rejection rule as the two baselines). Each process
records every round's wall time and CPU time (``time.process_time``, this process's threads:
less sensitive than the wall time to other jobs on a shared machine).

Printed per method: the median over the *steady* rounds (every round but a stage's first)
of the wall and CPU seconds, and its ratio to FedAvg's; and the *first-round extra*, the
CPU seconds of the stages' first rounds beyond a steady round each (work done once per
graph: FedSSP's Laplacian eigenpairs, every method's first-forward caches). A round is the
clients' fits, the aggregation and the round's evaluation; a stage's end is not counted.

``--ref REV`` also runs FedIIH and FedSSP from a git worktree of ``REV``
(``.cache/slow_baselines/<sha>``, removed at the end unless ``--keep``), interleaved with
this checkout's runs, and says whether each run's ``summary.json`` metrics (wall times
aside) equal the reference's bitwise.

    python benchmarks/slow_baselines.py [--rounds 3] [--repeats 1] [--ref REV] [--keep] \\
        [--methods fedavg fediih fedssp] [--extra fediih:model.net.iterations=1]
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
METHODS = {"fedavg": "cil_fedavg_replay", "fediih": "cil_fediih", "fedssp": "cil_fedssp"}
BASE = [
    "experiment=cil_cora",
    "dataset=synthetic_20k",
    "partition=random",
    "protocol.stream.stages=[2,1]",
    "threads=1",
    "logger=none",
]
TIMING = ("task_time_s", "wall_time_s", "time_s")


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def child(out: Path, overrides: list[str]) -> None:
    """In the child process: ``fedlightning train overrides`` with each round's wall and CPU
    seconds written to ``out`` (the tree on ``PYTHONPATH`` gives ``fedlightning``)."""
    from fedlightning.cli import main
    from fedlightning.federation.loop import FederatedLoop

    rounds: list[dict[str, float]] = []
    run_round = FederatedLoop.run_round

    def timed(self, round: int) -> dict[str, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        metrics = run_round(self, round)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        rounds.append({"round": round, "wall_s": wall, "cpu_s": cpu})
        return metrics

    FederatedLoop.run_round = timed
    sys.argv = ["fedlightning", "train", *overrides]
    try:
        main()
    finally:
        out.write_text(json.dumps(rounds))


def results(run_dir: Path) -> str:
    """``summary.json``'s metrics, wall times left out, as sorted JSON text (NaN == NaN)."""

    def clean(d):
        if isinstance(d, dict):
            return {k: clean(v) for k, v in d.items() if not any(t in k for t in TIMING)}
        return d

    summary = json.loads((run_dir / "summary.json").read_text())
    return json.dumps(clean(summary["metrics"]), sort_keys=True)


def run(tree: Path, method: str, rounds: int, out: Path, env: dict, extra: list[str]) -> list[dict]:
    """One method's run in ``tree`` (a fresh process, ``extra`` overrides last); its
    rounds' timings."""
    times = out.with_suffix(".json")
    overrides = [*BASE, f"algorithm={METHODS[method]}", f"federation.rounds={rounds}", *extra]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(times), "--"]
    cmd += [*overrides, f"hydra.run.dir={out}"]
    proc = subprocess.run(
        cmd, cwd=tree, env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"{tree}: {method} failed:\n{proc.stderr[-3000:]}")
    return json.loads(times.read_text())


def steady(timings: list[dict], rounds: int, key: str) -> float:
    """The median of ``key`` over every round but a stage's first."""
    return statistics.median(t[key] for t in timings if (t["round"] - 1) % rounds)


def first_extra(timings: list[dict], rounds: int) -> float:
    """CPU seconds of the stages' first rounds beyond a steady round each."""
    firsts = [t["cpu_s"] for t in timings if (t["round"] - 1) % rounds == 0]
    return sum(firsts) - len(firsts) * steady(timings, rounds, "cpu_s")


def main() -> None:
    if "--child" in sys.argv:
        at = sys.argv.index("--child")
        child(Path(sys.argv[at + 1]), sys.argv[at + 3 :])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per stage (>= 2)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--ref", default=None, help="also run FedIIH and FedSSP of this git rev")
    ap.add_argument("--keep", action="store_true", help="keep the reference worktree")
    ap.add_argument(
        "--extra",
        nargs="+",
        default=[],
        metavar="METHOD:OVERRIDE",
        help="an override for one method's runs, e.g. fediih:model.net.iterations=1",
    )
    args = ap.parse_args()
    if args.rounds < 2:
        raise SystemExit(f"--rounds must be >= 2 (a stage's first round is set apart), got {args.rounds}")  # fmt: skip
    ref_tree = None
    if args.ref:
        sha = git("rev-parse", "--short", args.ref)
        ref_tree = REPO / ".cache" / "slow_baselines" / sha
        if not ref_tree.exists():
            git("worktree", "add", "--detach", str(ref_tree), sha)
    sides = []  # each baseline's reference run just before this checkout's
    for m in args.methods:
        if ref_tree is not None and m != "fedavg":
            sides.append(("ref", m, ref_tree))
        sides.append(("head", m, REPO))
    extra: dict[str, list[str]] = {m: [] for m in METHODS}
    for item in args.extra:
        method, _, override = item.partition(":")
        if method not in METHODS or not override:
            raise SystemExit(f"--extra takes METHOD:OVERRIDE with METHOD in {list(METHODS)}, got {item!r}")  # fmt: skip
        extra[method].append(override)
    tmp = Path(tempfile.mkdtemp(prefix="slow_baselines_"))
    env = {**os.environ, "FEDLIGHTNING_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}
    timings: dict[tuple[str, str], list[dict]] = {}
    summaries: dict[tuple[str, str], str] = {}
    try:
        for rep in range(args.repeats):
            for side, method, tree in sides:
                out = tmp / f"{side}-{method}-{rep}"
                t = run(tree, method, args.rounds, out, env, extra[method])
                timings.setdefault((side, method), []).extend(t)
                summaries[(side, method)] = results(out)
                cpu = sum(r["cpu_s"] for r in t)
                print(f"pass {rep} {side} {method:7s} rounds {cpu:7.1f} s CPU", flush=True)
    finally:
        if ref_tree is not None and not args.keep:
            git("worktree", "remove", "--force", str(ref_tree))
    base = timings.get(("head", "fedavg"))
    print(
        f"\n22k-node graph, stages [2, 1] x {args.rounds} rounds, 5 clients, threads=1, "
        f"{args.repeats} repeat(s); steady rounds (a stage's first set apart):"
    )
    print(f"{'side':5s} {'method':7s} {'wall s':>7s} {'CPU s':>7s} {'wall/FedAvg':>11s} "
          f"{'CPU/FedAvg':>10s} {'1st-round extra CPU s':>21s}  results == ref")  # fmt: skip
    for (side, method), t in timings.items():
        wall, cpu = steady(t, args.rounds, "wall_s"), steady(t, args.rounds, "cpu_s")
        rw = f"{wall / steady(base, args.rounds, 'wall_s'):.2f}x" if base else "-"
        rc = f"{cpu / steady(base, args.rounds, 'cpu_s'):.2f}x" if base else "-"
        extra = first_extra(t, args.rounds) / args.repeats
        same = summaries.get(("ref", method))
        same = "-" if same is None else str(same == summaries[(side, method)])
        print(f"{side:5s} {method:7s} {wall:7.2f} {cpu:7.2f} {rw:>11s} {rc:>10s} {extra:21.1f}  {same}")  # fmt: skip


if __name__ == "__main__":
    main()
