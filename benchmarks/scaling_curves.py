"""Cost curves: set-up time, round time and peak memory of FedAvg and FedOGL as the graph,
the number of clients and the feature width grow.

Every point is one run of ``fedlightning train`` in a fresh process (so its peak memory is
its own) on ``dataset=synthetic_20k`` resized: ``N`` nodes in 10 classes, average degree
about 15 (``p_in = 10 / (N / 10)``, ``p_out = 5 / N``: ~10 neighbours in the node's class
and ~4.5 outside; edges drawn per block at every size), a dense ``text`` modality of ``--width`` features and a sparse 1,000-word
``words`` modality (10 words a node), 10% of each modality missing. Clients come from
``partition=metis`` (every size the same partitioner; ``partition=louvain`` uses it above
50k nodes anyway).

- FedAvg: ``experiment=fl_cora algorithm=fedavg``, ``--rounds`` rounds of 2 local epochs;
- FedOGL: ``experiment=cil_cora algorithm=fedogl``, stages ``[4, 3, 2]`` (class 9 never introduced),
  one round per stage.

A point's **set-up** is the time from the start of ``train()`` (its modules imported before)
to the end of the clients' construction (the log line "... split into K clients"): the
config's checks, the graph, the partition, the class stream and the clients' subgraphs. Its **round** is the median ``round_time_s`` of
``history.json`` (clients' fits, aggregation, the round's evaluation), its **peak** the run's
``summary.json`` ``peak_rss_mib``. Beside the wall time, ``cpu_round_s`` is the median of the
process's CPU time between consecutive rounds' log lines (from the second round on; FedOGL's
include the stage's end and the next stage's start): with one thread it is the round's cost
without the waits a shared machine adds, so the fit is also made on it. The table is printed and written (``--out``, Markdown and
JSON) with a log-log plot of the three against the edges, and the exponent ``b`` of the
least-squares fit ``round = a * edges^b`` over the node sweep, per method (``b`` near 1: the
cost per edge is flat).

    python benchmarks/scaling_curves.py [--nodes 10000 30000 100000] [--large]
        [--clients 5 10 20] [--widths 64 256 1024] [--threads 1] [--out scaling_curves]

``--large`` adds 300k and 1M nodes (100 clients at 1M). ``--clients`` and ``--widths``
sweep at 30k nodes (default: no sweep). ``--setup-only`` times the set-up alone (the
graph, the partition and class stream, the clients: their sum is the set-up) and no
round.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLASSES = 10
METHODS = {
    "fedavg": ["experiment=fl_cora", "algorithm=fedavg", "federation.local_epochs=2"],
    "fedogl": ["experiment=cil_cora", "algorithm=fedogl", "protocol.stream.stages=[4,3,2]"],
}


def overrides(method: str, nodes: int, clients: int, width: int, rounds: int) -> list[str]:
    """The run's config: the resized graph, its clients, the method and its rounds."""
    per_stage = 1 if method == "fedogl" else rounds
    return [
        *METHODS[method],
        "dataset=synthetic_20k",
        f"dataset.num_nodes={nodes}",
        f"dataset.num_classes={CLASSES}",
        f"dataset.p_in={10 / (nodes / CLASSES):.6g}",
        f"dataset.p_out={5 / nodes:.6g}",
        "+dataset.sampler=blocks",  # every size the same generator (auto: above 50k nodes)
        f"dataset.modalities.text={width}",
        "dataset.multi_hot.words=1000",
        "dataset.density=0.01",
        "partition=metis",
        "protocol.cache_dir=null",  # every point partitions afresh (no cached manifest)
        f"federation.clients={clients}",
        f"federation.rounds={per_stage}",
        "logger=none",
    ]


def point(spec: dict) -> dict:
    """One run in this process: its set-up, median round time, peak memory and edges."""
    from hydra import compose, initialize_config_dir

    import fedlightning.programs.graph_program  # noqa: F401  (imports out of the set-up's time)
    from fedlightning.resources import conf_dir
    from fedlightning.train import train

    seen: dict[str, float] = {}
    ticks: list[float] = []  # the process's CPU time at each round's log line

    class SplitLine(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "split into" in record.msg and "setup_s" not in seen:
                seen["setup_s"] = time.perf_counter() - t0
                seen["edges"] = record.args[0].num_edges  # the graph, before its copy goes
            elif str(record.msg).startswith("round %d/%d") and "setup_s" in seen:
                ticks.append(time.process_time())

    over = overrides(spec["method"], spec["nodes"], spec["clients"], spec["width"], spec["rounds"])
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", [*over, f"threads={spec['threads']}"])
    logger = logging.getLogger("fedlightning")
    logger.addHandler(SplitLine())
    logger.setLevel(logging.INFO)
    if spec.get("setup_only"):
        return {**spec, **setup_only(cfg)}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = train(cfg, Path(tmp) / "run", verbose=False)
        wall = time.perf_counter() - t0
        history = json.loads((Path(tmp) / "run" / "history.json").read_text())
    rounds = [h["round_time_s"] for h in history if "round_time_s" in h]
    return {
        **spec,
        "edges": int(seen["edges"]),
        "setup_s": seen["setup_s"],
        "round_s": statistics.median(rounds),
        "cpu_round_s": statistics.median(b - a for a, b in zip(ticks[:-1], ticks[1:], strict=True)),
        "peak_rss_mib": summary["peak_rss_mib"],
        "wall_s": wall,
    }


def setup_only(cfg) -> dict:
    """The set-up of a run alone (graph, partition and stream, clients), timed step by step,
    with the process's peak memory: for sizes whose rounds are not run."""
    from fedlightning.programs.graph_program import build_clients, build_protocol, load_graph
    from fedlightning.runs import peak_rss_mib

    out, t = {}, time.perf_counter()
    graph = load_graph(cfg)
    out["graph_s"], t = time.perf_counter() - t, time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        partition, _, _ = build_protocol(cfg, graph, Path(tmp), False)
    out["protocol_s"], t = time.perf_counter() - t, time.perf_counter()
    build_clients(graph, partition)
    out["clients_s"] = time.perf_counter() - t
    out["setup_s"] = out["graph_s"] + out["protocol_s"] + out["clients_s"]
    return {**out, "edges": graph.num_edges, "round_s": math.nan, "peak_rss_mib": peak_rss_mib()}


def run_point(spec: dict, script: str = __file__) -> dict:
    """``script --point SPEC`` (this one's :func:`point`) in a fresh interpreter (its own
    peak memory): the ``POINT`` line it prints, read back."""
    out = subprocess.run(
        [sys.executable, script, "--point", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("POINT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"point {spec} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1][len("POINT ") :])


def exponent(xs: list[float], ys: list[float]) -> float:
    """``b`` of the least-squares line ``log y = log a + b log x``."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )


def table(rows: list[dict]) -> str:
    head = (
        "| method | nodes | edges | clients | width | set-up s | s/round | CPU s/round | peak MiB |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['nodes']:,} | {r['edges']:,} | {r['clients']} | "
            f"{r['width']} | {r['setup_s']:.1f} | {r['round_s']:.2f} | "
            f"{r.get('cpu_round_s', math.nan):.2f} | {r['peak_rss_mib']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Log-log: set-up time, round time and peak memory against edges, one line per method
    (the node sweep only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(
        axes,
        ("setup_s", "round_s", "peak_rss_mib"),
        ("set-up (s)", "round (s)", "peak RSS (MiB)"),
        strict=True,
    ):
        for method in METHODS:
            pts = sorted((r["edges"], r[key]) for r in rows if r["method"] == method)
            if pts:
                ax.loglog(*zip(*pts, strict=True), marker="o", label=method)
        ax.set_xlabel("undirected edges")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[10_000, 30_000, 100_000])
    ap.add_argument("--large", action="store_true", help="also 300k and 1M nodes")
    ap.add_argument("--clients", type=int, nargs="*", default=[], help="sweep at 30k nodes")
    ap.add_argument("--widths", type=int, nargs="*", default=[], help="sweep at 30k nodes")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--rounds", type=int, default=3, help="FedAvg's rounds (FedOGL: 3 stages)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--width", type=int, default=128, help="the dense modality's width")
    ap.add_argument("--out", default="scaling_curves", help="writes OUT.md, OUT.json, OUT.png")
    ap.add_argument("--setup-only", action="store_true", help="time the set-up alone (no rounds)")
    ap.add_argument("--point", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print("POINT " + json.dumps(point(json.loads(args.point))), flush=True)
        return
    base = {"rounds": args.rounds, "threads": args.threads, "setup_only": args.setup_only}
    sizes = [*args.nodes, *([300_000, 1_000_000] if args.large else [])]
    specs = [
        {
            **base,
            "sweep": "nodes",
            "method": m,
            "nodes": n,
            "width": args.width,
            "clients": 100 if n >= 1_000_000 else 10,
        }
        for n in sizes
        for m in args.methods
    ]
    specs += [
        {
            **base,
            "sweep": "clients",
            "method": m,
            "nodes": 30_000,
            "clients": k,
            "width": args.width,
        }
        for k in args.clients
        for m in args.methods
    ]
    specs += [
        {**base, "sweep": "width", "method": m, "nodes": 30_000, "clients": 10, "width": w}
        for w in args.widths
        for m in args.methods
    ]
    rows = []
    for spec in specs:
        rows.append(run_point(spec))
        r = rows[-1]
        print(
            f"{r['method']} N={r['nodes']} E={r['edges']} K={r['clients']} d={r['width']}: "
            f"set-up {r['setup_s']:.1f} s, {r['round_s']:.2f} s/round, "
            f"peak {r['peak_rss_mib']:.0f} MiB",
            flush=True,
        )
    sweep = [r for r in rows if r["sweep"] == "nodes"]
    fits = {}
    for m in args.methods:
        for key in ("round_s", "cpu_round_s"):
            pts = sorted((r["edges"], r[key]) for r in sweep if r["method"] == m)
            if len(pts) >= 2 and not args.setup_only:
                fits[f"{m} {key}"] = exponent([p[0] for p in pts], [p[1] for p in pts])
    text = table(rows) + "\n\n" + "\n".join(f"- {m}: ~ edges^{b:.2f}" for m, b in fits.items())
    print("\n" + text)
    out = Path(args.out)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "exponents": fits}, indent=1))
    plot(sweep, out.with_suffix(".png"))
    print(
        f"\nwrote {out.with_suffix('.md')}, {out.with_suffix('.json')}, {out.with_suffix('.png')}"
    )


if __name__ == "__main__":
    main()
