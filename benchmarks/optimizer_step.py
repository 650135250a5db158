"""One optimizer step on a round's stacked client weights: torch's CPU default (per-tensor)
against ``foreach=True`` (what ``model.optimizer`` gets, ``with_foreach``) and ``fused=True``.

The weights are those of ``model=multimodal_gnn`` (hidden 64, two GCN layers) built for a
dataset's modalities, stacked for ``--clients`` clients (a leading axis, as
``runner.stack_clients`` holds them); ``--clients 1`` is one client's fit. The three updates
are timed interleaved in one process (each repeat times all three, so machine noise hits
them alike), median over repeats, from the same weights and gradients; each line says
whether the weights after ``--steps`` steps are bitwise the per-tensor ones.

    python benchmarks/optimizer_step.py [--dataset citeseer_mm] [--clients 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from fedlightning.federation.executors import with_foreach
from fedlightning.models import MultimodalGNN

IN_DIMS = {"cora": {"bow": 1433}, "citeseer_mm": {"text": 384, "bow": 3703}}
CLASSES = {"cora": 7, "citeseer_mm": 6}


def stacked_weights(dataset: str, clients: int) -> list[torch.Tensor]:
    """The net's weights with a leading axis of ``clients`` copies (none for one client)."""
    torch.manual_seed(0)
    net = MultimodalGNN(IN_DIMS[dataset], CLASSES[dataset], hidden=64, gnn_layers=2)
    ps = [p.detach() for p in net.parameters()]
    return [p.expand(clients, *p.shape).clone() if clients > 1 else p.clone() for p in ps]


def run(factory, start: list[torch.Tensor], steps: int) -> tuple[list[torch.Tensor], list[float]]:
    """``steps`` updates from ``start`` with seeded gradients; the weights and the step times."""
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = factory(params)
    times = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return [p.detach() for p in params], times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=sorted(IN_DIMS), default="citeseer_mm")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = partial(torch.optim.Adam, lr=0.01, weight_decay=5e-4)  # model=multimodal_gnn's
    sides = {
        "per-tensor (torch's CPU default)": base,
        "foreach (with_foreach)": with_foreach(base),
        "fused": partial(base, fused=True),
    }
    start = stacked_weights(args.dataset, args.clients)
    numel = sum(p.numel() for p in start)
    print(
        f"Adam on {args.dataset}'s multimodal_gnn, {args.clients} client(s) stacked "
        f"({numel:,} weights), {args.threads} thread(s), {args.steps} steps x {args.repeats}"
    )
    times: dict[str, list[float]] = {name: [] for name in sides}
    finals: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.repeats):
        for name, factory in sides.items():
            finals[name], t = run(factory, start, args.steps)
            times[name] += t
    ref_name = next(iter(sides))
    ref = statistics.median(times[ref_name])
    for name in sides:
        med = statistics.median(times[name])
        same = all(torch.equal(a, b) for a, b in zip(finals[name], finals[ref_name], strict=True))
        print(
            f"  {name:34s} {med * 1e3:7.2f} ms/step  {ref / med:5.2f}x  "
            f"{'bitwise the per-tensor weights' if same else 'other bits'}"
        )


if __name__ == "__main__":
    main()
