"""Stacked graph clients against one client at a time, side by side in one process.

Runs the same experiment with ``runner.stack_clients=false`` and ``true`` interleaved (every
repeat runs every setting once, so machine noise hits them alike), for each storage of the
bag-of-words modality (dense, and sparse COO with ``dataset.sparse_modalities=[bow]``), and
prints the median ``round_time_s`` (local fits, aggregation and the per-round evaluation),
each setting's ratio to one-at-a-time dense, and whether the stacked run's final global
weights equal the one-at-a-time run's (bitwise, else the largest difference).

``--ceiling`` adds one more setting: the same data held by one client (``federation.clients=1``,
dense, on the stacked path with its cached inputs). Its round is the arithmetic of every
node with no per-client work, the least a stacked round can cost, so its speed-up bounds any
stacked run's (docs/scaling.md, "Stacked graph clients").

    python benchmarks/stacked_clients.py [--experiment fedavg_cora] [--clients 5]
        [--rounds 5] [--repeats 3] [--threads 1] [--ceiling]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from fedlightning.recipes import recipe_overrides
from fedlightning.train import train

CONF = str(Path(__file__).resolve().parents[1] / "conf")
SETTINGS = {  # name -> overrides
    "one-at-a-time dense": ["runner.stack_clients=false"],
    "stacked dense": ["runner.stack_clients=true"],
    "one-at-a-time sparse": ["runner.stack_clients=false", "dataset.sparse_modalities=[bow]"],
    "stacked sparse": ["runner.stack_clients=true", "dataset.sparse_modalities=[bow]"],
}
CEILING = {"one client, every node": ["runner.stack_clients=true", "federation.clients=1"]}


def run_once(args: argparse.Namespace, overrides: list[str], out: Path) -> tuple[float, dict]:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            "train",
            [
                *recipe_overrides(args.experiment, CONF),
                f"federation.clients={args.clients}",
                f"federation.rounds={args.rounds}",
                f"threads={args.threads}",
                "logger=none",
                "runner.progress=false",
                *overrides,
            ],
        )
    train(cfg, out, verbose=False)
    hist = json.loads((out / "history.json").read_text())
    state = torch.load(out / "checkpoint.pt", weights_only=False)["server"]["global_state"]
    return statistics.median(h["round_time_s"] for h in hist), state


def difference(a: dict, b: dict) -> str:
    if all(torch.equal(a[k], b[k]) for k in a):
        return "bitwise"
    return f"max |diff| {max(float((a[k] - b[k]).abs().max()) for k in a):.2e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="fedavg_cora")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ceiling", action="store_true", help="also run every node as one client")
    args = ap.parse_args()
    settings = {**SETTINGS, **(CEILING if args.ceiling else {})}
    times: dict[str, list[float]] = {s: [] for s in settings}
    states: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run_once(args, SETTINGS["stacked dense"], Path(tmp) / "warmup")
        for r in range(args.repeats):
            for name, overrides in settings.items():
                out = Path(tmp) / f"{name.replace(' ', '_')}_{r}"
                t, states[name] = run_once(args, overrides, out)
                times[name].append(t)
                print(f"repeat {r + 1}/{args.repeats}  {name:<22} {t:.3f} s/round", flush=True)
    med = {s: statistics.median(v) for s, v in times.items()}
    base = med["one-at-a-time dense"]
    print(
        f"\n{args.experiment}, {args.clients} clients, {args.rounds} rounds, "
        f"threads={args.threads}, median of {args.repeats}"
    )
    print(f"{'setting':<22} {'s/round':>8} {'speed-up':>9}  final weights vs one-at-a-time")
    for name, t in med.items():
        ref = states[name.replace("stacked", "one-at-a-time")]
        same = "" if name.startswith("one") else difference(ref, states[name])
        print(f"{name:<22} {t:8.3f} {base / t:8.2f}x  {same}")


if __name__ == "__main__":
    main()
