"""What each robust rule adds to a round's aggregation, measured side by side in one process
(docs/security.md, "Cost of each defence").

Builds ``n`` client updates of a model of ``d`` float32 weights (random, seeded; the rules'
cost depends on ``n`` and ``d``, not on the values) and times ``robust_aggregate`` under each
rule of ``benchmarks/robust_aggregation.py``'s ``DEFENCES`` against FedAvg's weighted mean
(``none``), interleaved over ``--repeats`` passes so machine noise hits every rule alike.
Prints the median milliseconds per aggregation and the ratio to FedAvg's. ``fedavg_cora``'s
GCN has 92,231 weights; a round's five local fits take about half a second on two cores.

    PYTHONPATH=$PWD python benchmarks/robust_cost.py [--clients 5 20] [--weights 92231 1000000]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import yaml

from fedlightning.messages import ClientUpdate
from fedlightning.server.aggregate import as_model_fields
from fedlightning.server.robust import robust_aggregate, robust_rule

_spec = importlib.util.spec_from_file_location(
    "robust_aggregation", Path(__file__).with_name("robust_aggregation.py")
)
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
DEFENCES = _bench.DEFENCES  # the names and settings of the accuracy table


def updates(n: int, d: int, seed: int = 0) -> tuple[list[ClientUpdate], dict[str, torch.Tensor]]:
    """``n`` clients' models around a global model of ``d`` weights in two fields."""
    g = torch.Generator().manual_seed(seed)
    half = d // 2
    start = {"a": torch.randn(half, generator=g), "b": torch.randn(d - half, generator=g)}
    out = []
    for k in range(n):
        state = {key: v + 0.01 * torch.randn(v.shape, generator=g) for key, v in start.items()}
        out.append(
            ClientUpdate(1, as_model_fields(state), {"num_examples": 100.0 + k}, client_id=k)
        )
    return out, start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[5, 20])
    p.add_argument("--weights", type=int, nargs="+", default=[92231, 1000000])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--defences", nargs="+", default=list(DEFENCES), choices=list(DEFENCES))
    a = p.parse_args()
    torch.set_num_threads(1)
    print("| clients | weights | rule | ms per aggregation (median) | x FedAvg |")
    print("|---:|---:|---|---:|---:|")
    for n in a.clients:
        for d in a.weights:
            ups, start = updates(n, d)
            previous = 0.001 * torch.randn(d, dtype=torch.float64)
            rules = {name: robust_rule(yaml.safe_load(DEFENCES[name])) for name in a.defences}
            times: dict[str, list[float]] = {name: [] for name in rules}
            for _ in range(a.repeats):
                for name, rule in rules.items():
                    t0 = time.perf_counter()
                    robust_aggregate(rule, ups, start, previous)
                    times[name].append(time.perf_counter() - t0)
            base = statistics.median(times.get("none", [float("nan")]))
            for name, ts in times.items():
                ms = 1000 * statistics.median(ts)
                print(f"| {n} | {d:,} | {name} | {ms:.1f} | {ms / 1000 / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
