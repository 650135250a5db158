"""Wall time per round of FedOGL against FedAvg (and FedAvg + replay) on the same data.

The FedOGL paper says its method runs close to FedAvg. This script runs the real
experiments in one process, interleaved (every repeat runs every method once, so machine
noise hits them alike), and prints the median over repeats of

- ``s/round``: whole run wall time / rounds, i.e. local fits, aggregation, server modules,
  per-round evaluation, stage-end evaluation, basis extraction and checkpoints;
- ``fit+agg``: the median ``round_time_s`` of the rounds (clients' fits, aggregation and the
  server modules, plus the per-round evaluation both methods share);

and each method's ratio to FedAvg.

    python benchmarks/round_time.py [--dataset citeseer_mm] [--rounds 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from fedlightning.recipes import recipe_overrides
from fedlightning.resources import conf_dir
from fedlightning.train import train

CONF = str(conf_dir())
METHODS = ("fedavg", "fedavg_replay", "fedogl")


def run_once(experiment: str, rounds: int, seed: int, out: Path) -> tuple[float, float]:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            "train",
            [
                *recipe_overrides(experiment, CONF),
                f"federation.rounds={rounds}",
                "logger=none",
                f"seed={seed}",
            ],
        )
    s = train(cfg, out)
    hist = json.loads((out / "history.json").read_text())
    per_round = statistics.median(h["round_time_s"] for h in hist)
    return s["wall_time_s"] / s["rounds"], per_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="citeseer_mm", choices=["citeseer_mm", "cora"])
    ap.add_argument("--rounds", type=int, default=5, help="rounds per stage")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        run_once(f"cil_fedavg_{args.dataset}", 1, 0, Path(tmp) / "warmup")
        for r in range(args.repeats):
            for m in METHODS:
                out = Path(tmp) / f"{m}_{r}"
                times[m].append(run_once(f"cil_{m}_{args.dataset}", args.rounds, r, out))
                print(f"repeat {r + 1}/{args.repeats}  {m:<14} {times[m][-1][0]:.3f} s/round")
    med = {m: tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for m, v in times.items()}
    base = med["fedavg"]
    print(f"\ncil_*_{args.dataset}, {args.rounds} rounds per stage, median of {args.repeats}")
    print(f"{'method':<14} {'s/round':>8} {'ratio':>6} {'fit+agg':>8} {'ratio':>6}")
    for m, (whole, fit) in med.items():
        print(f"{m:<14} {whole:8.3f} {whole / base[0]:6.2f} {fit:8.3f} {fit / base[1]:6.2f}")


if __name__ == "__main__":
    main()
