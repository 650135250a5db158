"""Fingerprints of short runs, to show that a refactor leaves every result bitwise the same.

Runs each experiment as a fresh ``python -m fedlightning train experiment=X ...`` (one thread,
no tracking, no plots, its own cache) and hashes what a run computes: ``summary.json`` less
its timings and paths, ``history.json`` less its timings, and the server's final state in
``checkpoint.pt`` (every tensor's bytes). Save the fingerprints of one checkout, then compare
another's with them:

    python tools/fingerprints.py --out before.json
    python tools/fingerprints.py --compare before.json

A run that fails prints its last lines and counts as a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
GRAPH = ["federation.rounds=1"]
TEMPORAL = ["federation.rounds=1", "max_tasks=2"]
CIL = ["experiment=cil_cora", *GRAPH]
CIL_MM = ["experiment=cil_citeseer_mm", *GRAPH]
CIR = ["experiment=cir_citeseer_mm", *GRAPH]
SYNTHETIC = ["experiment=temporal_synthetic", *TEMPORAL]
# one run per method (named as its recipe names it): the reference experiments of the
# redesigns and one per baseline family
RUNS: dict[str, list[str]] = {
    "demo": GRAPH,
    "fedavg_cora": ["experiment=fl_cora", "algorithm=fedavg", *GRAPH],
    "fedavg_cora_one_at_a_time": [
        "experiment=fl_cora",
        "algorithm=fedavg",
        *GRAPH,
        "runner.stack_clients=false",
    ],
    "fedprox_cora": ["experiment=fl_cora", "algorithm=fedprox", *GRAPH],
    "cil_fedavg_replay_cora": [*CIL, "algorithm=cil_fedavg_replay"],
    "cil_fedlwf_cora": [*CIL, "algorithm=cil_fedlwf"],
    "cil_energy_replay_cora": [*CIL, "algorithm=cil_energy_replay"],
    "cil_fedogl_cora": [*CIL, "algorithm=fedogl"],
    "cil_fedogl_citeseer_mm": [*CIL_MM, "algorithm=fedogl"],
    "cir_fedogl_citeseer_mm": [*CIR, "algorithm=cir_fedogl"],
    "cir_fedavg_replay_citeseer_mm": [*CIR, "algorithm=cir_fedavg_replay"],
    "cil_power_cora": [*CIL, "algorithm=cil_power"],
    "cil_fediih_cora": [*CIL, "algorithm=cil_fediih"],
    "cil_fedssp_cora": [*CIL, "algorithm=cil_fedssp"],
    "cil_fedmvp_citeseer_mm": [*CIL_MM, "algorithm=cil_fedmvp"],
    "cil_prism_citeseer_mm": [*CIL_MM, "algorithm=cil_prism"],
    "cil_clipn_cora": [*CIL, "algorithm=cil_clipn"],
    "cir_clipn_citeseer_mm": [*CIR, "algorithm=cir_clipn"],
    "cil_grasp_cora": [*CIL, "algorithm=cil_grasp"],
    "cil_topoood_cora": [*CIL, "algorithm=cil_topoood"],
    **{
        f"{m}_synthetic": [*SYNTHETIC, f"algorithm={m}"]
        for m in (
            "fedtip",
            "prompt_fedavg",
            "fulltune_fedavg",
            "fedgnn",
            "fedlink",
            "feddy",
            "stfl",
            "feddgl",
            "fedgcn",
            "fedsage_plus",
        )
    },
}
VOLATILE = (
    "time",
    "timing",
    "run_dir",
    "seconds",
    "elapsed",
    "s_per",
    "per_s",
    "reused",
    "path",
    "rss",
)


def stable(value: Any) -> Any:
    """``value`` without the entries that differ between two runs of the same computation."""
    if isinstance(value, dict):
        return {
            k: stable(v)
            for k, v in sorted(value.items())
            if not any(t in str(k) for t in VOLATILE) and not str(k).endswith("_s")
        }
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def tensors_digest(obj: Any, h: Any) -> None:
    if isinstance(obj, torch.Tensor):
        h.update(str((obj.dtype, tuple(obj.shape))).encode())
        h.update(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            tensors_digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors_digest(v, h)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        h.update(repr(obj).encode())


def fingerprint(run_dir: Path) -> dict[str, str]:
    out = {}
    for name in ("summary.json", "history.json"):
        path = run_dir / name
        if path.exists():
            text = json.dumps(stable(json.loads(path.read_text())), sort_keys=True)
            out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    ckpt = run_dir / "checkpoint.pt"
    if ckpt.exists():
        h = hashlib.sha256()
        tensors_digest(torch.load(ckpt, map_location="cpu", weights_only=False).get("server"), h)
        out["server"] = h.hexdigest()[:16]
    return out


def run(name: str, overrides: list[str], tmp: Path, data: str) -> dict[str, str] | str:
    args = (
        overrides
        if any(o.startswith("experiment=") for o in overrides)
        else [
            f"experiment={name}",
            *overrides,
        ]
    )
    run_dir = tmp / name
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FEDLIGHTNING_DATA": data,
        "FEDLIGHTNING_PLOTS": "false",
        "FEDLIGHTNING_CACHE": str(tmp / "cache"),
    }
    cmd = [sys.executable, "-m", "fedlightning", "train", *args, "logger=none", "threads=1"]
    cmd.append(f"hydra.run.dir={run_dir}")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        return "failed: " + " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    return fingerprint(run_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the fingerprints to this JSON file")
    ap.add_argument("--compare", help="compare with the fingerprints in this JSON file")
    ap.add_argument("--only", nargs="*", help="these runs only")
    ap.add_argument(
        "--data",
        default=os.environ.get("FEDLIGHTNING_DATA", str(REPO.parent / "shared" / "data")),
        help="the real data's folder (default: FEDLIGHTNING_DATA, else ../shared/data)",
    )
    args = ap.parse_args()
    names = args.only or list(RUNS)
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fingerprints-") as tmp:
        for name in names:
            found[name] = run(name, RUNS[name], Path(tmp), args.data)
            print(f"{name:32s} {found[name]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        diff = [n for n in names if found.get(n) != before.get(n)]
        print(f"{len(names) - len(diff)} of {len(names)} runs bitwise the same")
        for n in diff:
            print(f"  differs: {n}: {before.get(n)} -> {found.get(n)}")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
