"""Speed-up of ``runner=distributed`` with 2 processes over 1, by clients per rank.

Runs the real ``fedavg_cora`` experiment under ``torchrun`` (Gloo on CPU, one intra-op
thread per process) with 1 and 2 processes on the same rounds of 2, 4, 10 and 20 clients,
i.e. 1, 2, 5 and 10 clients per rank on 2 processes; the round of 10 clients is the headline.
Settings are interleaved (every repeat runs each once, so machine noise hits them alike),
and it prints, per setting, the median ``round_time_s`` over rounds 2..R (round 1 warms up)
and repeats: the local fits, the gather, the server step and the evaluation of every client
(which every rank runs, so it does not shrink with more processes), then the speed-up of 2
processes over 1 for each round size, i.e. how it grows with the clients per rank.

    FEDLIGHTNING_DATA=../shared/data python benchmarks/distributed_speedup.py \\
        [--rounds 5] [--repeats 2] [--clients 2 4 10 20] [--epochs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(procs: int, clients: int, rounds: int, epochs: int, out: Path) -> list[float]:
    """One torchrun job; the round times of rounds 2..R."""
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        f"--nproc_per_node={procs}",
        *(
            "-m",
            "fedlightning",
            "train",
            "experiment=fl_cora",
            "algorithm=fedavg",
            "runner=distributed",
        ),
        *(f"federation.clients={clients}", f"federation.rounds={rounds}"),
        *(f"federation.local_epochs={epochs}", "logger=none", f"hydra.run.dir={out}"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"torchrun failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    history = json.loads((out / "history.json").read_text())
    return [h["round_time_s"] for h in history[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--clients", type=int, nargs="+", default=[2, 4, 10, 20], help="per round")
    ap.add_argument("--epochs", type=int, default=5, help="local epochs (fedavg_cora: 5)")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (round 1 is the warm-up)")
    if any(n < 2 for n in args.clients):
        ap.error("--clients: every round needs at least one client per process (>= 2)")
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    if cores < 2 or load > 0.5:
        print(f"warning: {cores} cores, load average {load:.1f}: 2 processes need 2 idle cores")
    settings = [(p, n) for n in args.clients for p in (1, 2)]
    times: dict[tuple[int, int], list[float]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for procs, clients in settings:
                out = Path(tmp) / f"p{procs}_n{clients}_{r}"
                rounds = run_once(procs, clients, args.rounds, args.epochs, out)
                times[(procs, clients)] += rounds
                print(
                    f"repeat {r + 1}/{args.repeats}  {procs} proc x {clients:>2} clients/round  "
                    f"{statistics.median(rounds):.3f} s/round",
                    flush=True,
                )
    med = {s: statistics.median(v) for s, v in times.items()}
    print(
        f"\nfedavg_cora, {args.epochs} local epochs, Gloo on CPU, 1 thread per process; "
        f"median s/round over rounds 2..{args.rounds} x {args.repeats} repeats; "
        f"{cores} cores, load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(
        f"{'clients/round':>13} {'clients/rank':>12} {'1 proc s/round':>14} "
        f"{'2 procs s/round':>15} {'speed-up':>8}"
    )
    for n in args.clients:
        one, two = med[(1, n)], med[(2, n)]
        print(f"{n:>13} {n / 2:>12g} {one:14.3f} {two:15.3f} {one / two:7.2f}x")
    if 10 in args.clients:
        one, two = med[(1, 10)], med[(2, 10)]
        print(
            f"speed-up of 2 processes over 1, 10 clients/round: {one / two:.2f}x "
            f"({one:.3f} s -> {two:.3f} s)"
        )


if __name__ == "__main__":
    main()
