"""What the private prototype release costs (docs/security.md, "Private prototypes").

Runs FedOGL (class-incremental, AM) and FedTIP (AUC) in-process, once without the release
and once per noise multiplier ``sigma`` at a fixed ``clip``, and prints one markdown table:
method, sigma, the metric, and the run's epsilon at delta = 1e-5 over all its releases
(from the summary, i.e. from dp-accounting). Accuracy figures, not timings: machine load
does not change them.

    PYTHONPATH=$PWD FEDLIGHTNING_DATA=<data root> python benchmarks/privacy_cost.py \\
        --sigmas 0 0.5 1 2 --clip 1.0
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

FEDOGL = ["experiment=cil_cora", "algorithm=fedogl", "federation.rounds=3"]
FEDTIP = [
    "experiment=temporal_bitcoin_alpha",
    "algorithm=fedtip",
    "protocol.tasks.num_tasks=20",
    "federation.rounds=5",
]


def run(overrides: list[str], out: Path) -> dict[str, Any]:
    from fedlightning.config import compose
    from fedlightning.train import train

    return train(compose([*overrides, "logger=none", "runner.progress=false"]), out, verbose=False)


def rows(
    name: str, base: list[str], metrics: list[str], sigmas: list[float], clip: float, tmp: Path
):
    settings: list[tuple[str, list[str]]] = [("none", [])]
    for s in sigmas:
        settings.append((f"{s:g}", [f"algorithm.dp.clip={clip}", f"algorithm.dp.sigma={s}"]))
    for label, extra in settings:
        s = run([*base, *extra], tmp / f"{name}-{label}")
        eps = s["privacy"]["epsilon"]
        value = ", ".join(f"{m} {s['metrics'][m]:.4f}" for m in metrics if m in s["metrics"])
        releases = s["privacy"]["releases"]
        eps_text = "inf" if eps is None else f"{eps:.3g}"
        clip_text = "-" if label == "none" else f"{clip:g}"
        line = f"| {name} | {clip_text} | {label} | {value} | {eps_text} | {releases} |"
        print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0])
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--only", choices=["fedogl", "fedtip"], default=None)
    a = p.parse_args()
    print("| method | clip | sigma | metric | epsilon (delta 1e-5) | releases |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if a.only in (None, "fedogl"):
            rows("cil_fedogl_cora", FEDOGL, ["am"], a.sigmas, a.clip, tmp)
        if a.only in (None, "fedtip"):
            rows("fedtip_bitcoin_alpha", FEDTIP, ["auc_nc", "auc_tlp"], a.sigmas, a.clip, tmp)


if __name__ == "__main__":
    main()
