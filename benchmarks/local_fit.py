"""Cost of one local fit: plain torch loop vs the lean executor vs a fresh Lightning Trainer.

Measured side by side in one process, interleaved, median over repeats, on two sizes:
a tiny model (the FedTIP regime: thousands of small fits) and a Cora-sized client.

    python benchmarks/local_fit.py [--fits 30] [--epochs 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from fedlightning.clients import NodeClassifier
from fedlightning.data.graphs import make_synthetic
from fedlightning.federation.executors import LeanExecutor, TrainerExecutor
from fedlightning.models import MultimodalGNN


def plain_loop(module: NodeClassifier, data, epochs: int) -> None:
    """The same steps by hand: Adam, full-batch CE, no hooks."""
    opt = module.optimizer_factory(module.parameters())
    module.train()
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module.net(data)[data.train_mask], data.y[data.train_mask])
        loss.backward()
        opt.step()


def setup(num_nodes: int, dims: dict[str, int], hidden: int):
    g = make_synthetic(num_nodes=num_nodes, num_classes=5, modalities=dims, seed=0)
    data = g.to_data()
    data.train_mask = torch.arange(num_nodes) % 5 < 3
    net = MultimodalGNN(dims, 5, hidden=hidden)
    return data, net


def measure(fits: int, epochs: int, num_nodes: int, dims: dict[str, int], hidden: int) -> dict:
    data, net = setup(num_nodes, dims, hidden)
    paths = {
        "plain torch": lambda m: plain_loop(m, data, epochs),
        "lean executor": lambda m: LeanExecutor().fit(m, data, epochs),
        "fresh Trainer": lambda m: TrainerExecutor().fit(m, data, epochs),
    }
    times: dict[str, list[float]] = {k: [] for k in paths}
    for fn in paths.values():  # warm-up (imports, allocator)
        fn(NodeClassifier(copy.deepcopy(net), partial(torch.optim.Adam, lr=0.01)))
    for _ in range(fits):
        for name, fn in paths.items():  # interleaved: machine noise hits every path alike
            module = NodeClassifier(copy.deepcopy(net), partial(torch.optim.Adam, lr=0.01))
            t0 = time.perf_counter()
            fn(module)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fits", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = {
        "tiny (100 nodes, d=16, h=16)": (100, {"a": 16}, 16),
        "cora-client (550 nodes, d=1433, h=64)": (550, {"bow": 1433}, 64),
    }
    print(f"local fit of {args.epochs} full-batch steps, median of {args.fits} fits, 1 thread")
    for label, (n, dims, h) in cases.items():
        med = measure(args.fits, args.epochs, n, dims, h)
        base = med["plain torch"]
        print(f"\n{label}")
        for name, t in med.items():
            print(f"  {name:<15} {t * 1e3:8.2f} ms   x{t / base:5.2f} of plain torch")


if __name__ == "__main__":
    main()
