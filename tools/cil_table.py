"""Aggregate class-incremental runs into a table: mean and std over seeds.

    fedlightning train -m experiment=cil_fedavg_cora,cil_fedogl_cora seed=0,1,2 logger=none
    python tools/cil_table.py multirun/            # every summary.json below it

Rows are experiments (with the FedOGL ablation variant); columns AM, FM, FPR95 (mean ± std
over seeds) and wall time per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

METRICS = ("am", "fm", "fpr95", "auroc_ood", "val_am")


def load(paths: list[Path]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for root in paths:
        for f in sorted(root.rglob("summary.json")):
            s = json.loads(f.read_text())
            if "am" not in s["metrics"]:
                continue
            variant = s.get("tags", {}).get("variant", "full")
            key = s["experiment"] + (
                "" if variant in ("full", "replay", "energy") else f" [{variant}]"
            )
            groups[key].append(s)
    return groups


def fmt(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    args = ap.parse_args()
    groups = load(args.dirs)
    print("| experiment | seeds | " + " | ".join(METRICS) + " | s/round |")
    print("|---|---|" + "---|" * len(METRICS) + "---|")
    for key in sorted(groups):
        runs = groups[key]
        per_round = [r["wall_time_s"] / r["rounds"] for r in runs]
        cells = [fmt([r["metrics"].get(m) for r in runs]) for m in METRICS]
        print(
            f"| {key} | {len(runs)} | "
            + " | ".join(cells)
            + f" | {statistics.mean(per_round):.2f} |"
        )


if __name__ == "__main__":
    main()
