"""Peak memory and round times of issue 49's 100k-node FedOGL run, side by side.

The run (docs/scaling.md, "The issue's graph end to end"): 100,000 nodes, two dense 768-d
modalities (586 MiB of float32 features), 10 classes, 10 METIS clients, FedOGL, stages
``[4, 3, 2]`` of one round each, no tracking. Each run is its own process; its
``summary.json`` gives ``peak_rss_mib`` and ``history.json`` the rounds' ``round_time_s``,
and the process's CPU seconds (user + system) are measured from outside:

    python benchmarks/memory_100k.py                       # this tree, once
    python benchmarks/memory_100k.py --trees OLD NEW --repeat 2   # alternating, ratios
    python benchmarks/memory_100k.py --census               # in-process: live tensors

``--census`` runs the same command in this process and prints, after every stacked fit, the
CPU storages of 4 MiB or more that are alive (their bytes, shape and dtype), and the
process's resident and peak memory (docs/scaling.md, "Memory").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FEATURE_MIB = 100_000 * 2 * 768 * 4 / 2**20
COMMAND = [
    "experiment=cil_cora",
    "algorithm=fedogl",
    "dataset=synthetic_20k",
    "dataset.num_nodes=100000",
    "dataset.num_classes=10",
    "dataset.modalities.text=768",
    "+dataset.modalities.image=768",
    "~dataset.multi_hot",
    "federation.clients=10",
    "federation.rounds=1",
    "protocol.stream.stages=[4,3,2]",
    "protocol.cache_dir=null",
    "logger=none",
]


def run(tree: Path, extra: list[str], env: dict[str, str]) -> dict:
    """One run of the command in ``tree``: peak MiB, round times, CPU and wall seconds."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "fedlightning", "train", *COMMAND, *extra]
        cmd.append(f"hydra.run.dir={out}")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(
            cmd,
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree), **env},
            check=True,
            capture_output=True,
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        summary = json.loads(Path(out, "summary.json").read_text())
        history = json.loads(Path(out, "history.json").read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "peak_mib": summary["peak_rss_mib"],
        "rounds_s": [r["round_time_s"] for r in history],
        "cpu_s": cpu,
        "wall_s": wall,
        "test_acc": summary.get("test_acc"),
    }


def census(label: str) -> None:
    """Print the live CPU storages of 4 MiB or more, and resident and peak memory."""
    import torch

    gc.collect()
    seen: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu" or obj.is_sparse:
                continue
            st = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - tensors without storage (meta, wrappers)
            continue
        if st.nbytes() >= 4 << 20 and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (st.nbytes(), f"{tuple(obj.shape)} {obj.dtype}")
    total = sum(n for n, _ in seen.values()) / 2**20
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"--- {label}: large storages {total:.0f} MiB, rss {rss / 2**20:.0f}, peak {peak:.0f}")
    for nbytes, what in sorted(seen.values(), reverse=True):
        print(f"    {nbytes / 2**20:8.1f} MiB  {what}")


def run_census(extra: list[str]) -> None:
    """The command in this process, a census after every stacked fit."""
    import fedlightning.federation.stacking as stacking
    import fedlightning.methods.continual.continual as continual

    fit = stacking.fit_stacked
    count = [0]

    def counted(*args, **kwargs):
        out = fit(*args, **kwargs)
        count[0] += 1
        census(f"after stacked fit {count[0]}")
        return out

    continual.fit_stacked = counted
    from fedlightning.cli import main

    with tempfile.TemporaryDirectory() as out:
        sys.argv = ["fedlightning", "train", *COMMAND, *extra, f"hydra.run.dir={out}"]
        with contextlib.suppress(SystemExit):
            main()
    census("end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", type=Path, default=[REPO])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--census", action="store_true")
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the runs")
    parser.add_argument("extra", nargs="*", help="more overrides")
    args = parser.parse_args()
    if args.census:
        run_census(args.extra)
        return
    env = dict(e.split("=", 1) for e in args.env)
    results: dict[Path, list[dict]] = {t: [] for t in args.trees}
    for i in range(args.repeat):
        for tree in args.trees:
            r = run(tree, args.extra, env)
            results[tree].append(r)
            rounds = ", ".join(f"{s:.2f}" for s in r["rounds_s"])
            print(
                f"{tree} #{i + 1}: peak {r['peak_mib']:.0f} MiB "
                f"({r['peak_mib'] / FEATURE_MIB:.2f}x features), rounds {rounds} s, "
                f"cpu {r['cpu_s']:.1f} s, wall {r['wall_s']:.1f} s, test_acc {r['test_acc']}",
                flush=True,
            )
    if len(args.trees) == 2:
        a, b = (results[t] for t in args.trees)
        for key in ("peak_mib", "cpu_s"):
            ratio = sum(r[key] for r in b) / sum(r[key] for r in a)
            print(f"{key}: second / first = {ratio:.3f}")
        ra = sum(sum(r["rounds_s"]) for r in a)
        rb = sum(sum(r["rounds_s"]) for r in b)
        print(f"round time: second / first = {rb / ra:.3f}")


if __name__ == "__main__":
    main()
