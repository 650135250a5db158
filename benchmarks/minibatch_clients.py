"""Mini-batch clients at scale: set-up time, round time and peak memory of FedAvg and FedOGL
on a large synthetic graph, with every client trained by neighbour-sampled mini-batches
(``federation.minibatch``) and, for the ratio, the same run full batch.

The graph is ``benchmarks/scaling_curves.py``'s family (10 classes, average degree about
15, METIS clients) with mostly sparse features: a 1,000-word multi-hot modality at 1%
density and a ``--dense-width`` dense one (default 16; the generator needs one), nothing
missing. Each point is one ``fedlightning train`` in
a fresh interpreter (its own peak memory); set-up, round and peak are read as in
``scaling_curves.py``.

    python benchmarks/minibatch_clients.py [--nodes 300000] [--clients 20]
        [--budget 10000] [--batch-size 1024] [--fanout 10 10] [--dense-width 16]
        [--modes mini full]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def curves():
    """``scaling_curves.py`` as a module (its config and its timing of one point)."""
    spec = importlib.util.spec_from_file_location("scaling_curves", HERE / "scaling_curves.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_overrides(spec: dict) -> list[str]:
    """The point's config: scaling_curves' graph with sparse features only, and the
    mini-batch setting (``mode=mini``)."""
    width = spec["dense_width"]
    over = curves().overrides(spec["method"], spec["nodes"], spec["clients"], width, spec["rounds"])
    over += ["dataset.missing_rate=0"]
    if spec["mode"] == "mini":
        fanout = ",".join(str(k) for k in spec["fanout"])
        over.append(
            f"+federation.minibatch={{budget_nodes:{spec['budget']},"
            f"batch_size:{spec['batch_size']},fanout:[{fanout}]}}"
        )
    return over


def point(spec: dict) -> dict:
    """One run in this process, timed by ``scaling_curves.point`` on our overrides."""
    mod = curves()
    mod.overrides = lambda *a, **k: run_overrides(spec)
    return mod.point({**spec, "width": spec["dense_width"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=300_000)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--budget", type=int, default=10_000, help="federation.minibatch budget")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--fanout", type=int, nargs="+", default=[10, 10])
    ap.add_argument("--dense-width", type=int, default=16, help="the dense modality's width")
    ap.add_argument("--rounds", type=int, default=2, help="FedAvg's rounds (FedOGL: 3 stages)")
    ap.add_argument("--methods", nargs="+", default=["fedavg", "fedogl"])
    ap.add_argument("--modes", nargs="+", default=["mini", "full"], choices=["mini", "full"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--point", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print("POINT " + json.dumps(point(json.loads(args.point))), flush=True)
        return
    rows = []
    for method in args.methods:
        for mode in args.modes:
            spec = {
                "method": method,
                "mode": mode,
                "nodes": args.nodes,
                "clients": args.clients,
                "budget": args.budget,
                "batch_size": args.batch_size,
                "fanout": args.fanout,
                "dense_width": args.dense_width,
                "rounds": args.rounds,
                "threads": args.threads,
            }
            r = curves().run_point(spec, __file__)
            rows.append(r)
            print(
                f"{method} {mode}: N={r['nodes']} E={r['edges']} K={r['clients']}: set-up "
                f"{r['setup_s']:.1f} s, {r['round_s']:.2f} s/round, peak "
                f"{r['peak_rss_mib']:.0f} MiB, wall {r['wall_s']:.1f} s",
                flush=True,
            )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
