"""Speed-up of ``runner=distributed`` with 2 processes over 1, and round time per clients/rank.

Runs the real ``fedavg_cora`` experiment under ``torchrun`` (Gloo on CPU, one intra-op
thread per process) with 1 and 2 processes and 2, 5 and 10 clients per rank, so that a round
of 10 clients runs once on 1 process (10 per rank) and once on 2 (5 per rank). Settings are
interleaved (every repeat runs each once, so machine noise hits them alike), and it prints,
per setting, the median ``round_time_s`` over rounds 2..R (round 1 warms up) and repeats:
the local fits, the gather, the server step and the evaluation of every client (which every
rank runs, so it does not shrink with more processes), then the speed-up of 2 processes over
1 at the same clients per round.

    FEDLIGHTNING_DATA=../shared/data python benchmarks/distributed_speedup.py \\
        [--rounds 5] [--repeats 2] [--per-rank 2 5 10] [--epochs 5]
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
        *("-m", "fedlightning", "train", "experiment=fedavg_cora", "runner=distributed"),
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
    ap.add_argument("--per-rank", type=int, nargs="+", default=[2, 5, 10])
    ap.add_argument("--epochs", type=int, default=5, help="local epochs (fedavg_cora: 5)")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (round 1 is the warm-up)")
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    if cores < 2 or load > 0.5:
        print(f"warning: {cores} cores, load average {load:.1f}: 2 processes need 2 idle cores")
    settings = [(p, k) for k in args.per_rank for p in (1, 2)]
    times: dict[tuple[int, int], list[float]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for procs, per_rank in settings:
                out = Path(tmp) / f"p{procs}_k{per_rank}_{r}"
                rounds = run_once(procs, procs * per_rank, args.rounds, args.epochs, out)
                times[(procs, per_rank)] += rounds
                print(
                    f"repeat {r + 1}/{args.repeats}  {procs} proc x {per_rank:>2} clients  "
                    f"{statistics.median(rounds):.3f} s/round",
                    flush=True,
                )
    med = {s: statistics.median(v) for s, v in times.items()}
    print(
        f"\nfedavg_cora, {args.epochs} local epochs, Gloo on CPU, 1 thread per process; "
        f"median s/round over rounds 2..{args.rounds} x {args.repeats} repeats; "
        f"{cores} cores, load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(f"{'procs':>5} {'clients/rank':>12} {'clients/round':>13} {'s/round':>8} {'s/client':>8}")
    for (procs, k), t in sorted(med.items()):
        print(f"{procs:>5} {k:>12} {procs * k:>13} {t:8.3f} {t / k:8.3f}")
    per_round = {(p, p * k): t for (p, k), t in med.items()}
    for n in sorted({n for _, n in per_round}):
        if (1, n) in per_round and (2, n) in per_round:
            one, two = per_round[(1, n)], per_round[(2, n)]
            print(
                f"speed-up of 2 processes over 1, {n} clients/round: {one / two:.2f}x "
                f"({one:.3f} s -> {two:.3f} s)"
            )


if __name__ == "__main__":
    main()
