"""Rounds on a 20k-node graph with a sparse bag-of-words modality: sparse against dense.

``dataset=synthetic_20k`` has the shape of a 22k-node page graph (22,000 nodes, ~170k edges,
4 classes, a 4,700-word multi-hot modality at ~2% density and a 384-d dense one). The same
graph is trained with the words stored sparse (torch COO: the encoder's first layer does CSR
products) and dense (``dataset.sparse=false``). Runs are interleaved (every repeat runs every
arm once, so machine noise hits them alike); the table gives the median ``round_time_s``
(clients' fits, aggregation, server modules, the round's evaluation) over the rounds of every
repeat, and the dense/sparse ratio:

- FedAvg: ``experiment=fl_cora algorithm=fedavg``, 5 clients x 2 local epochs;
- FedOGL: ``experiment=cil_cora algorithm=fedogl``, stages ``[2, 1]`` (class 1 never introduced).

Clients come from ``partition=random``: Louvain finds the generator's 4 class blocks, fewer
communities than the 5 clients. ``--full`` also times the whole ``cil_fedogl`` protocol (2
stages x 20 rounds) with the sparse words, from start to summary.

    python benchmarks/graph_20k.py [--rounds 4] [--repeats 2] [--threads 2] [--full]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from fedlightning.resources import conf_dir
from fedlightning.train import train

CONF = str(conf_dir())
DATA = ["dataset=synthetic_20k", "partition=random", "logger=none"]
METHODS = {
    "fedavg": ["experiment=fl_cora", "algorithm=fedavg", "federation.local_epochs=2"],
    "fedogl": ["experiment=cil_cora", "algorithm=fedogl", "protocol.stream.stages=[2,1]"],
}


def run(overrides: list[str], out: Path) -> tuple[list[float], float]:
    """The run's round times and its wall time (s)."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", [*DATA, *overrides])
    t0 = time.perf_counter()
    train(cfg, out, verbose=False)
    wall = time.perf_counter() - t0
    return [h["round_time_s"] for h in json.loads((out / "history.json").read_text())], wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds (per stage for FedOGL)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--full", action="store_true", help="also the 2 x 20-round cil_fedogl run")
    args = ap.parse_args()
    arms = {(m, s): [] for m in METHODS for s in ("sparse", "dense")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for (method, storage), times in arms.items():
                over = [
                    *METHODS[method],
                    f"federation.rounds={args.rounds}",
                    f"dataset.sparse={storage == 'sparse'}",
                    f"threads={args.threads}",
                ]
                rounds, _ = run(over, Path(tmp) / f"{method}-{storage}-{r}")
                times.extend(rounds)
                print(
                    f"repeat {r + 1}/{args.repeats}  {method} {storage}: "
                    f"median {statistics.median(rounds):.2f} s/round",
                    flush=True,
                )
        print(f"\nsynthetic_20k, 5 clients, {args.threads} threads, median s/round")
        print(f"{'method':<8} {'sparse':>8} {'dense':>8} {'dense/sparse':>13}")
        for method in METHODS:
            sp, de = (statistics.median(arms[method, s]) for s in ("sparse", "dense"))
            print(f"{method:<8} {sp:8.2f} {de:8.2f} {de / sp:13.2f}")
        if args.full:
            over = [*METHODS["fedogl"], "federation.rounds=20", f"threads={args.threads}"]
            _, wall = run(over, Path(tmp) / "fedogl-full")
            print(f"\ncil_fedogl, 2 stages x 20 rounds, sparse words: {wall:.0f} s end to end")


if __name__ == "__main__":
    main()
