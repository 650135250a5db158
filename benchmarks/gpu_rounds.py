"""Wall time of a few federated rounds of each method on CUDA, and on the CPU beside it.

A prepared check for a GPU machine (one H200, say). It runs, in this process through
``fedlightning.train.train`` with the real composed configs, each method with the local fits
on ``cuda`` (``+runner.executor.device=cuda``: the executor moves the module and a copy of
the client's batch to the GPU for every fit; evaluation and the server step stay on the
CPU), then the same on the CPU, and prints one table:

    method, device, rounds, wall s, s/round, final metric, CPU/CUDA ratio of s/round

(``wall s``: the whole ``train`` call, data loading included; ``s/round``: the rounds' own
time from history.json / task_metrics.json, i.e. fits, server step and evaluation.)

Methods: ``fedavg`` (fedavg_cora), ``fedprox`` (fedprox_cora), ``fedogl`` (cil_fedogl_cora,
3 stages), ``cir_fedogl`` (cir_fedogl_citeseer_mm: cross-modal retrieval, 4 stages) and
``fedtip`` (fedtip_synthetic, after the bank is pre-trained once with task=bank,
experiment=bank_synthetic bank=tgn, on the same small settings; the bank pre-training has no
device switch and runs on the CPU). ``--rounds`` is per stage (CIL/CIR) and per task
(FedTIP); ``rounds`` in the table counts every round run. A device's first run pays CUDA's
start-up, so a one-round fedavg warm-up precedes the timed runs. A method that fails is
recorded with its error, and the others still run. Defaults take about 5 minutes.

    FEDLIGHTNING_DATA=../shared/data python benchmarks/gpu_rounds.py --out gpu_rounds.json
    python benchmarks/gpu_rounds.py --cpu-only --rounds 1 --out /tmp/cpu.json   # no GPU

Without CUDA it stops with an error unless ``--cpu-only`` is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# method -> (experiment, extra overrides, the final metric to report)
METHODS: dict[str, tuple[str, list[str], str]] = {
    "fedavg": ("fedavg_cora", [], "test_acc"),
    "fedprox": ("fedprox_cora", [], "test_acc"),
    "fedogl": ("cil_fedogl_cora", [], "am"),
    "cir_fedogl": ("cir_fedogl_citeseer_mm", [], "recall_at_1"),
    "fedtip": ("fedtip_synthetic", [], "auc_tlp"),
}


def fedtip_small(tasks: int, bank_events: int) -> list[str]:
    """The small FedTIP settings the bank and FedTIP runs share (the bank cache is keyed by
    the stream, the manifest and the bank config)."""
    return [
        f"protocol.tasks.num_tasks={tasks}",
        "bank.epochs=1",
        f"bank.max_events={bank_events}",
    ]


def run(overrides: list[str], out: Path) -> dict[str, Any]:
    """One ``fedlightning train`` in this process; the summary and the wall time."""
    from fedlightning.config import compose
    from fedlightning.train import train

    cfg = compose([*overrides, "logger=none", "runner.progress=false"])
    t0 = time.perf_counter()
    summary = train(cfg, out, verbose=False)
    summary["wall_s"] = time.perf_counter() - t0
    return summary


def rounds_run(summary: dict[str, Any]) -> int:
    """Every round a run ran: FedTIP's per-task rounds times its tasks."""
    return summary["rounds"] * summary.get("tasks_done", 1)


def loop_seconds(out: Path) -> float:
    """The rounds' own time: ``round_time_s`` (fits, server step, evaluation) summed over
    history.json, or FedTIP's ``task_time_s`` over task_metrics.json; no data loading."""
    if (out / "history.json").exists():
        return sum(h["round_time_s"] for h in json.loads((out / "history.json").read_text()))
    return sum(t["task_time_s"] for t in json.loads((out / "task_metrics.json").read_text()))


def time_method(
    method: str, device: str, rounds: int, extra: list[str], out: Path
) -> dict[str, Any]:
    experiment, overrides, metric = METHODS[method]
    row: dict[str, Any] = {"method": method, "experiment": experiment, "device": device}
    from fedlightning.recipes import recipe_overrides

    recipe = recipe_overrides(experiment, REPO / "conf")
    args = [*recipe, f"federation.rounds={rounds}", *overrides, *extra]
    if device == "cuda":
        args.append("+runner.executor.device=cuda")
    try:
        s = run(args, out)
    except Exception as e:  # one failing method must not cost the others their GPU time
        traceback.print_exc()
        return {**row, "error": f"{type(e).__name__}: {e}".splitlines()[0], "overrides": args}
    n = rounds_run(s)
    value = s["metrics"].get(metric)
    return {
        **row,
        "rounds": n,
        "wall_s": s["wall_s"],
        "s_per_round": loop_seconds(out) / n,
        "metric": metric,
        "value": value,
        "overrides": args,
    }


def environment(devices: list[str]) -> dict[str, Any]:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "devices": devices,
    }
    if "cuda" in devices:
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def table(rows: list[dict[str, Any]]) -> str:
    cpu = {r["method"]: r.get("s_per_round") for r in rows if r["device"] == "cpu"}
    head = f"{'method':<12} {'device':<6} {'rounds':>6} {'wall s':>8} {'s/round':>8} "
    lines = [head + f"{'final metric':<22} {'cpu/cuda':>8}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<12} {r['device']:<6} failed: {r['error']}")
            continue
        value = "n/a" if r["value"] is None else f"{r['value']:.4f}"
        ratio = ""
        if r["device"] == "cuda" and cpu.get(r["method"]):
            ratio = f"{cpu[r['method']] / r['s_per_round']:.2f}x"
        lines.append(
            f"{r['method']:<12} {r['device']:<6} {r['rounds']:>6} {r['wall_s']:8.2f} "
            f"{r['s_per_round']:8.3f} {r['metric'] + ' ' + value:<22} {ratio:>8}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (per stage, per task)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--fedtip-tasks", type=int, default=3)
    ap.add_argument("--bank-events", type=int, default=2000, help="bank pre-training events")
    ap.add_argument("--cpu-only", action="store_true", help="time the CPU alone (no GPU)")
    ap.add_argument("--no-cpu", action="store_true", help="time CUDA alone")
    ap.add_argument("--data", type=Path, help="FEDLIGHTNING_DATA (default: ../shared/data)")
    args = ap.parse_args()

    import torch

    if not args.cpu_only and not torch.cuda.is_available():
        sys.exit(
            f"error: CUDA is not available (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}); pass --cpu-only to time the CPU alone"
        )
    devices = ["cpu"] if args.cpu_only else ["cuda"] + ([] if args.no_cpu else ["cpu"])
    data = args.data or os.environ.get("FEDLIGHTNING_DATA") or REPO.parent / "shared" / "data"
    os.environ["FEDLIGHTNING_DATA"] = str(data)
    logging.getLogger("fedlightning").setLevel(logging.WARNING)

    rows: list[dict[str, Any]] = []
    extra = {m: [] for m in METHODS}
    record = {"rounds": args.rounds, "env": environment(devices), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every run: a cut-off session keeps what it measured
        args.out.write_text(json.dumps(record, indent=2, default=str))

    with tempfile.TemporaryDirectory(prefix="gpu_rounds-") as tmp:
        os.environ["FEDLIGHTNING_CACHE"] = str(Path(tmp) / "cache")  # protocol, bank, contexts
        if "fedtip" in args.methods:  # the bank, then the contexts (cached), untimed
            extra["fedtip"] = fedtip_small(args.fedtip_tasks, args.bank_events)
            bank = run(
                ["experiment=bank_synthetic", "bank=tgn", *extra["fedtip"]], Path(tmp) / "bank"
            )
            print(f"bank pre-trained (task=bank, CPU) in {bank['wall_s']:.1f} s", flush=True)
            rows.append({"method": "bank_tgn", "device": "cpu", "wall_s": bank["wall_s"]})
            contexts = [
                "experiment=temporal_synthetic",
                "algorithm=fedtip",
                "federation.rounds=1",
                *extra["fedtip"],
            ]
            run(contexts, Path(tmp) / "contexts")
        for device in devices:
            warmup = ["experiment=fl_cora", "algorithm=fedavg", "federation.rounds=1"]
            if device == "cuda":
                warmup.append("+runner.executor.device=cuda")
            run(warmup, Path(tmp) / f"warmup_{device}")  # CUDA's start-up, first imports
            for m in args.methods:
                out = Path(tmp) / f"{m}_{device}"
                row = time_method(m, device, args.rounds, extra[m], out)
                rows.append(row)
                save()
                done = row.get("error") or f"{row['wall_s']:.1f} s"
                print(f"{m:<12} {device:<5} {done}", flush=True)
    timed = [r for r in rows if r["method"] in METHODS]
    print(f"\n{args.rounds} rounds per stage/task; torch threads {torch.get_num_threads()}")
    print(table(timed))
    save()
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
