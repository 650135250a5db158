"""Input dropout per call and per fedavg_cora local fit: ``nn.Dropout`` vs ``InputDropout``.

Measured side by side in one process, interleaved (every repeat times both, so machine
noise hits them alike), median over repeats, on one thread (``--threads``):

1. one dropout call (p = 0.5, training) on the bag-of-words input of the largest
   fedavg_cora client (real Cora features and Louvain partition when the data directory
   has them, otherwise a synthetic 540 x 1433 matrix at Cora's 1.27% density);
2. fedavg_cora local fits (each client, 5 full-batch epochs, Adam, the lean executor)
   with the model's input dropout as built (``InputDropout``) and swapped for
   ``nn.Dropout`` (the implementation before).

``--sweep`` adds the per-call times over densities, the crossover that sets
``fedlightning.models.dropout.MAX_DENSITY``.

    python benchmarks/input_dropout.py [--data ../shared/data] [--repeats 5] [--threads 1]
                                      [--sweep]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data

from fedlightning.clients import NodeClassifier
from fedlightning.data.graphs import load_planetoid
from fedlightning.data.partition import TEST, TRAIN, VAL, LouvainPartitioner
from fedlightning.errors import DataError
from fedlightning.federation.executors import LeanExecutor
from fedlightning.models import InputDropout, MultimodalGNN, nonzero_dropout
from fedlightning.models.dropout import MAX_DENSITY

P = 0.5


def cora_clients(root: str | None) -> tuple[list[Data], str]:
    """fedavg_cora's five clients (Louvain, protocol seed 0), or one synthetic client."""
    try:
        graph = load_planetoid("cora", root=root)
    except DataError:
        g = torch.Generator().manual_seed(0)
        n, d, c = 540, 1433, 7
        x = (torch.rand(n, d, generator=g) < 0.0127).float()
        y = torch.randint(0, c, (n,), generator=g)
        ei = torch.randint(0, n, (2, 4 * n), generator=g)
        split = torch.randint(0, 5, (n,), generator=g)
        data = Data(x_bow=x, y=y, edge_index=ei, num_nodes=n, modality_mask=torch.ones(n, 1))
        data.modality_mask = data.modality_mask.bool()
        data.train_mask, data.val_mask, data.test_mask = split < 3, split == 3, split == 4
        return [data], "synthetic (no Cora files found), 540 x 1433 at 1.27% density"
    part = LouvainPartitioner()(graph, 5, seed=0)
    clients = []
    for k in range(part.num_clients):
        nodes = part.client_nodes(k)
        data = graph.subgraph(nodes).to_data()
        split = part.split[nodes]
        data.train_mask, data.val_mask, data.test_mask = split == TRAIN, split == VAL, split == TEST
        clients.append(data)
    return clients, "real Cora features, fedavg_cora's Louvain clients (protocol seed 0)"


def with_standard_dropout(net: nn.Module) -> nn.Module:
    """A copy of ``net`` whose ``InputDropout`` modules are plain ``nn.Dropout`` (as before)."""
    net = copy.deepcopy(net)
    for module in list(net.modules()):
        for name, child in module.named_children():
            if isinstance(child, InputDropout):
                setattr(module, name, nn.Dropout(child.p))
    return net


def median_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each callable in ms; interleaved, after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def per_call(x: Tensor, repeats: int) -> dict[str, float]:
    return median_ms(
        {
            "nn.Dropout": lambda: F.dropout(x, P, True),
            "InputDropout": lambda: nonzero_dropout(x, P, True),
            "nn.Linear after it": partial(F.linear, x, torch.randn(64, x.shape[1])),
        },
        repeats,
    )


def local_fits(clients: list[Data], repeats: int, epochs: int) -> dict[str, float]:
    torch.manual_seed(0)
    num_classes = int(max(int(c.y.max()) for c in clients)) + 1
    net = MultimodalGNN({"bow": clients[0].x_bow.shape[1]}, num_classes)
    nets = {"nn.Dropout": with_standard_dropout(net), "InputDropout": net}

    def fit_all(base: nn.Module) -> None:
        for data in clients:
            module = NodeClassifier(copy.deepcopy(base), partial(torch.optim.Adam, lr=0.01))
            LeanExecutor().fit(module, data, epochs)

    return median_ms({k: partial(fit_all, v) for k, v in nets.items()}, repeats)


def sweep(repeats: int) -> None:
    print("\nper call by density (540 x 1433, synthetic), ms; InputDropout falls back to")
    print(f"nn.Dropout above a density of {MAX_DENSITY}")
    head = f"{'density':>8} {'nn.Dropout':>11} {'non-zero path':>14} {'ratio':>6}"
    print(f"{head} {'InputDropout':>13}")
    g = torch.Generator().manual_seed(0)
    for density in (0.0127, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0):
        x = (torch.rand(540, 1433, generator=g) < density).float()
        t = median_ms(
            {
                "dense": lambda x=x: F.dropout(x, P, True),
                "nonzero": lambda x=x: nonzero_dropout(x, P, True, max_density=1.0),
                "built": lambda x=x: nonzero_dropout(x, P, True),
            },
            repeats,
        )
        ratio = t["dense"] / t["nonzero"]
        row = f"{density:8.4f} {t['dense']:11.2f} {t['nonzero']:14.2f} {ratio:6.2f}"
        print(f"{row} {t['built']:13.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.environ.get("FEDLIGHTNING_DATA", "../shared/data"))
    ap.add_argument("--repeats", type=int, default=5, help="repeats of the local fits")
    ap.add_argument("--calls", type=int, default=50, help="repeats of one dropout call")
    ap.add_argument("--epochs", type=int, default=5, help="fedavg_cora's local_epochs")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--sweep", action="store_true", help="also time densities 1%%-100%%")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clients, source = cora_clients(args.data if os.path.isdir(args.data) else None)
    x = max((c.x_bow for c in clients), key=len)
    density = float((x != 0).float().mean())
    print(f"{source}; torch {torch.__version__}, {args.threads} thread(s), p = {P}")

    t = per_call(x, args.calls)
    print(f"\none call on the largest client's input, {tuple(x.shape)}, density {density:.4f}")
    print(f"  nn.Dropout          {t['nn.Dropout']:7.2f} ms")
    print(f"  InputDropout        {t['InputDropout']:7.2f} ms")
    print(f"  nn.Linear after it  {t['nn.Linear after it']:7.2f} ms")
    print(f"  ratio               {t['nn.Dropout'] / t['InputDropout']:7.2f} x")

    f = local_fits(clients, args.repeats, args.epochs)
    print(
        f"\nlocal fits of all {len(clients)} clients ({args.epochs} epochs each, lean executor), "
        f"median of {args.repeats}"
    )
    print(f"  with nn.Dropout     {f['nn.Dropout']:7.1f} ms")
    print(f"  with InputDropout   {f['InputDropout']:7.1f} ms")
    print(f"  ratio               {f['nn.Dropout'] / f['InputDropout']:7.2f} x")
    if args.sweep:
        sweep(max(5, args.calls // 5))


if __name__ == "__main__":
    main()
