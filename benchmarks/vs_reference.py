"""Rounds of this checkout against a reference commit (default e492aed), side by side.

Checks the reference commit out in a git worktree (``.cache/vs_reference/<sha>``, reused if
there, removed at the end unless ``--keep``) and runs the same experiments in both trees, each
run a fresh ``python -m fedlightning train experiment=X federation.rounds=R logger=none``
with ``PYTHONPATH`` and the working directory set to its tree, its own ``FEDLIGHTNING_CACHE``
and ``OMP_NUM_THREADS=T`` on both sides (plus ``threads=T`` where the tree's config has the
key; e492aed's has not). Before timing, each side's resolved config is dumped
(``--cfg job``), which checks that it accepts every override, and the keys that differ
between the two sides are printed. Runs are interleaved (ref, head, ref, head, ...), so
machine noise hits both alike. Per experiment it prints the median ``round_time_s`` over all
rounds of every run but its first (the warm-up) and the repeats, the ratio ref/head, and the
median wall time of a whole run (process start to exit) per side.

    python benchmarks/vs_reference.py [--ref e492aed] [--experiments fedavg_cora \\
        cil_fedogl_citeseer_mm] [--rounds 5] [--repeats 2] [--threads 2] [--data DIR] [--keep] \
        [--head dataset.sparse_modalities=[bow]]

``--head`` overrides apply to this checkout's runs only. ``--rounds`` is per stage for the class-incremental experiments (``cil_*``).
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

import yaml

from fedlightning.recipes import recipe_overrides

REPO = Path(__file__).resolve().parents[1]
SIDES = ("ref", "head")
CONF = REPO / "conf"


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out = {}
    for key, v in d.items():
        out.update(flatten(v, f"{prefix}{key}.") if isinstance(v, dict) else {prefix + key: v})
    return out


def fedlightning(tree: Path, env: dict[str, str], args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fedlightning", "train", *args]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)


def measure(args: argparse.Namespace, trees: dict[str, Path]) -> tuple[dict, dict, dict]:
    """Round times (rounds 2..) and run wall times per (experiment, side); why a side failed."""
    rounds: dict[tuple[str, str], list[float]] = {}
    walls: dict[tuple[str, str], list[float]] = {}
    failed: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory(prefix="vs_reference-") as tmp:
        envs = {
            side: {
                **os.environ,
                "PYTHONPATH": str(tree),
                "OMP_NUM_THREADS": str(args.threads),
                "FEDLIGHTNING_DATA": args.data,
                "FEDLIGHTNING_CACHE": f"{tmp}/cache_{side}",
            }
            for side, tree in trees.items()
        }
        for side, tree in trees.items():  # PYTHONPATH must win over an installed package
            probe = "import fedlightning; print(fedlightning.__file__)"
            found = subprocess.run(
                [sys.executable, "-c", probe],
                cwd=tree,
                env=envs[side],
                capture_output=True,
                text=True,
            ).stdout.strip()
            if not found.startswith(str(tree / "fedlightning")):
                sys.exit(f"{side}: imports fedlightning from {found!r}, not from {tree}")
        overrides: dict[tuple[str, str], list[str]] = {}
        for exp in args.experiments:
            cfgs = {}
            for side, tree in trees.items():
                key = (exp, side)
                # the head's recipes are protocol x dataset: an older name in its composed form
                named = [f"experiment={exp}"] if side == "ref" else recipe_overrides(exp, CONF)
                ov = [*named, f"federation.rounds={args.rounds}", "logger=none"]
                r = fedlightning(tree, envs[side], [*ov, "--cfg", "job", "--resolve"])
                if r.returncode != 0:
                    failed[key] = f"config rejected: {r.stderr.strip()[-1500:]}"
                    continue
                # each side's own cache folder is the same setting
                dump = r.stdout.replace(envs[side]["FEDLIGHTNING_CACHE"], "$FEDLIGHTNING_CACHE")
                cfgs[side] = flatten(yaml.safe_load(dump))
                if "threads" in cfgs[side]:
                    ov.append(f"threads={args.threads}")
                    cfgs[side]["threads"] = args.threads
                if side == "head":  # head-only settings, e.g. dataset.sparse_modalities=[bow]
                    ov.extend(args.head)
                overrides[key] = ov
            if len(cfgs) == 2:
                a, b = cfgs["ref"], cfgs["head"]
                diff = [
                    f"{k}: {a.get(k, '-')!r} -> {b.get(k, '-')!r}"
                    for k in sorted(a.keys() | b.keys())
                    if a.get(k, "-") != b.get(k, "-")
                ]
                print(f"{exp}: config keys that differ (ref -> head): {'; '.join(diff) or 'none'}")

        for rep in range(args.repeats):
            for exp in args.experiments:
                for side in SIDES:
                    key = (exp, side)
                    if key in failed:
                        continue
                    out = Path(tmp) / f"{exp}_{side}_{rep}"
                    t0 = time.perf_counter()
                    p = fedlightning(
                        trees[side], envs[side], [*overrides[key], f"hydra.run.dir={out}"]
                    )
                    wall = time.perf_counter() - t0
                    if p.returncode != 0:
                        failed[key] = (
                            f"run failed (exit {p.returncode}): {p.stderr.strip()[-1500:]}"
                        )
                        print(f"{exp} {side}: {failed[key]}", flush=True)
                        continue
                    times = [
                        h["round_time_s"] for h in json.loads((out / "history.json").read_text())
                    ]
                    rounds.setdefault(key, []).extend(times[1:])
                    walls.setdefault(key, []).append(wall)
                    print(
                        f"repeat {rep + 1}/{args.repeats}  {exp:<24} {side:<4} "
                        f"{statistics.median(times[1:]):7.3f} s/round  {wall:6.1f} s run "
                        f"({len(times)} rounds)",
                        flush=True,
                    )

    return rounds, walls, failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="e492aed")
    ap.add_argument("--experiments", nargs="+", default=["fedavg_cora", "cil_fedogl_citeseer_mm"])
    ap.add_argument("--rounds", type=int, default=5, help="rounds (per stage for cil_*)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--keep", action="store_true", help="keep the reference worktree")
    ap.add_argument(
        "--head", nargs="*", default=[], help="overrides for head only (not in the config diff)"
    )
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (a run's first round warms up)")

    sha = git("rev-parse", "--verify", f"{args.ref}^{{commit}}")
    wt = REPO / ".cache" / "vs_reference" / sha[:12]
    if not (wt / "fedlightning").is_dir():
        git("worktree", "add", "--detach", str(wt), sha)
    trees = {"ref": wt, "head": REPO}
    head = git("rev-parse", "--short", "HEAD") + (
        " (dirty)" if git("status", "--porcelain") else ""
    )
    load = os.getloadavg()
    print(f"ref {args.ref} ({sha[:12]}) in {wt}; head {head}")
    print(f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")

    try:
        rounds, walls, failed = measure(args, trees)
    finally:
        if not args.keep:
            git("worktree", "remove", "--force", str(wt))
    load = os.getloadavg()
    print(
        f"\nmedian round_time_s over rounds 2.. of each run x {args.repeats} repeats, "
        f"OMP_NUM_THREADS={args.threads}; load average after: {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}; run s: median wall time of a whole run"
    )
    print(f"{'experiment':<24} {'ref s/round':>11} {'head s/round':>12} {'ratio':>6}", end="")
    print(f" {'ref run s':>9} {'head run s':>10}")
    for exp in args.experiments:
        missing = [s for s in SIDES if (exp, s) in failed or (exp, s) not in rounds]
        if missing:
            why = "; ".join(f"{s}: {failed.get((exp, s), 'no run')}" for s in missing)
            print(f"{exp:<24} not measured ({why})")
            continue
        ref, hd = (statistics.median(rounds[(exp, s)]) for s in SIDES)
        rw, hw = (statistics.median(walls[(exp, s)]) for s in SIDES)
        print(f"{exp:<24} {ref:11.3f} {hd:12.3f} {ref / hd:5.2f}x {rw:9.1f} {hw:10.1f}")


if __name__ == "__main__":
    main()
