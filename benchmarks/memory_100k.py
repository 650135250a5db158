"""Peak memory and round times of issue 49's 100k-node FedOGL run, side by side.

The run (docs/scaling.md, "The issue's graph end to end"): 100,000 nodes, two dense 768-d
modalities (586 MiB of float32 features), 10 classes, 10 METIS clients, FedOGL, stages
``[4, 3, 2]`` of one round each, no tracking. Each run is its own process; its
``summary.json`` gives ``peak_rss_mib`` and ``history.json`` the rounds' ``round_time_s``,
and the process's CPU seconds (user + system) are measured from outside:

    python benchmarks/memory_100k.py                       # this tree, once
    python benchmarks/memory_100k.py --trees OLD NEW --repeat 2   # alternating, ratios
    python benchmarks/memory_100k.py --census               # in-process: live tensors
    python benchmarks/memory_100k.py --peaks                # in-process: where RSS climbs

``--census`` runs the same command in this process and prints, after every stacked fit, the
CPU storages of 4 MiB or more that are alive (their bytes, shape and dtype), and the
process's resident and peak memory (docs/scaling.md, "Memory"). ``--peaks`` runs it in this
process while a thread samples the resident memory every millisecond; each time it passes
its highest so far by 8 MiB, the main thread's innermost frames of this repository are
recorded, and the climbs are printed by place (the highest RSS seen there).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
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


class _Mallinfo2(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 - glibc's struct mallinfo2
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def heap_mib() -> tuple[float, float]:
    """glibc's heap now (``mallinfo2``), MiB: in use (mapped blocks included) and free but
    held; ``(nan, nan)`` on another C library."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return float("nan"), float("nan")
    fn.restype = _Mallinfo2
    info = fn()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def rss_mib() -> float:
    """The process's resident memory now, MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def where(frame) -> str:  # noqa: ANN001 - a frame
    """The innermost six frames of this repository's package under ``frame``."""
    own = [f for f in traceback.extract_stack(frame) if "/fedlightning/" in f.filename]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in own[::-1][:6])


def run_peaks(extra: list[str]) -> None:
    """The command in this process, the places where its resident memory climbs."""
    main_id, stop = threading.get_ident(), threading.Event()
    climbs: dict[str, tuple[float, float, float]] = {}

    def sample() -> None:
        top = 0.0
        while not stop.is_set():
            now = rss_mib()
            if now > top + 8:
                top = now
                frame = sys._current_frames().get(main_id)
                key = where(frame) if frame is not None else "?"
                climbs[key] = max(climbs.get(key, (0.0, 0.0, 0.0)), (now, *heap_mib()))
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    from fedlightning.cli import main

    with tempfile.TemporaryDirectory() as out:
        sys.argv = ["fedlightning", "train", *COMMAND, *extra, f"hydra.run.dir={out}"]
        with contextlib.suppress(SystemExit):
            main()
    stop.set()
    thread.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"--- peak {peak:.0f} MiB; the last climbs (RSS, heap in use, heap free; MiB; where):")
    for key, (mib, used, free) in sorted(climbs.items(), key=lambda kv: kv[1])[-25:]:
        print(f"    {mib:7.0f} {used:7.0f} {free:7.0f}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", type=Path, default=[REPO])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--census", action="store_true")
    parser.add_argument("--peaks", action="store_true")
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the runs")
    parser.add_argument("extra", nargs="*", help="more overrides")
    args = parser.parse_args()
    if args.census:
        run_census(args.extra)
        return
    if args.peaks:
        run_peaks(args.extra)
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
