"""The equal-budget study behind docs/claims.md: every sweep of ``sweeps/claims/``, then each
study's best setting at the evaluation seeds, then the table.

For each sweep file (``--only`` narrows them by name), in ``--parallel`` processes at once:

1. ``fedlightning sweep FILE`` (its own Optuna storage ``OUT/optuna/<study>.db``, trial runs
   under ``OUT/trials/<study>``): the study and its trials are MLflow runs in the
   ``--experiment-name`` family (default ``fedlightning-claims``);
2. the best trial's parameters, written to ``OUT/best/<study>/best.json`` with its value;
3. ``fedlightning train -m`` of the study's experiment at those parameters for every
   ``--seeds`` (runs under ``OUT/best/<study>/<job>``, top-level MLflow runs of the same family).

Then ``fedlightning report`` of the best runs, per part (``cil``: node classification;
``cir``: retrieval) into ``OUT/report``, and a line with the whole study's compute time
(the sum of every process's wall time, and the elapsed time). Run it again to go on: a
finished study is not run again (its storage holds its trials), a best setting whose seed
runs all finished is not re-run.

    python tools/claims_study.py [--only cil_fedogl] [--parallel 2] [--seeds 0 1 2 3 4]
        [--out outputs/claims] [--set federation.rounds=2 ...]

``--set`` adds Hydra overrides to every run (a quick check of the whole pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "sweeps" / "claims"


def fedlightning(args: list[str], log: Path) -> float:
    """Run ``python -m fedlightning ARGS`` (one thread, its output to ``log``); its wall time.
    A failure stops the study with the log's last lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.call(
            [sys.executable, "-m", "fedlightning", *args], stdout=f, stderr=f, env=env
        )
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise SystemExit(f"fedlightning {args[0]} failed (exit {code}), {log}:\n{tail}")
    return time.perf_counter() - t0


def best_params(storage: str, study: str) -> tuple[dict, float, int]:
    import optuna

    best = optuna.load_study(study_name=study, storage=storage).best_trial
    return dict(best.params), float(best.value), best.number


def _value(v: object) -> str:
    return json.dumps(v) if isinstance(v, str) else repr(v)


def one_study(sweep: Path, args: argparse.Namespace) -> float:
    """The sweep, its best setting's seed runs; the seconds they took."""
    name, out = sweep.stem, Path(args.out)
    experiment = yaml.safe_load(sweep.read_text())["experiment"]
    storage = f"sqlite:///{(out / 'optuna' / f'{name}.db').resolve()}"
    (out / "optuna").mkdir(parents=True, exist_ok=True)
    common = [f"logger.experiment_name={args.experiment_name}", "threads=1", *args.set]
    spent = fedlightning(
        ["sweep", str(sweep), "--storage", storage, "--out", str(out / "trials" / name), *common],
        out / "logs" / f"{name}.sweep.log",
    )
    params, value, number = best_params(storage, name)
    best_dir = out / "best" / name
    best_dir.mkdir(parents=True, exist_ok=True)
    record = {"study": name, "experiment": experiment, "trial": number, "val_am": value}
    (best_dir / "best.json").write_text(json.dumps({**record, "params": params}, indent=2) + "\n")
    print(f"[{name}] best trial {number}: val_am {value:.4f}  {params}", flush=True)
    done = sorted(best_dir.glob("*/summary.json"))
    if len(done) < len(args.seeds):
        seeds = ",".join(str(s) for s in args.seeds)
        overrides = [f"{k}={_value(v)}" for k, v in params.items()]
        spent += fedlightning(
            [
                "train",
                "-m",
                f"experiment={experiment}",
                f"seed={seeds}",
                *overrides,
                *common,
                f"hydra.sweep.dir={best_dir}",
                "hydra.sweep.subdir=seed${seed}",
            ],
            out / "logs" / f"{name}.best.log",
        )
    print(f"[{name}] {len(args.seeds)} seeds at the best setting done ({spent:.0f} s)", flush=True)
    return spent


def report(args: argparse.Namespace, parts: set[str]) -> None:
    out = Path(args.out)
    for part in sorted(parts):
        metrics = "am,fm,fpr95,auroc_ood" if part == "cil" else "am,fm"
        fedlightning(
            [
                "report",
                "--dirs",
                str(out / "best"),
                "--task",
                part,
                "--dataset",
                *(["citeseer_mm", "cora"] if part == "cil" else ["citeseer_mm"]),
                "--metrics",
                metrics,
                "--out",
                str(out / "report"),
                "--name",
                f"claims_{part}",
            ],
            out / "logs" / f"report_{part}.log",
        )
        print(f"table: {out / 'report' / f'claims_{part}.md'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="sweep files whose name has one of these")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--out", default="outputs/claims")
    ap.add_argument("--experiment-name", default="fedlightning-claims")
    ap.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every run")
    args = ap.parse_args()
    sweeps = [
        p
        for p in sorted(SWEEPS.glob("*.yaml"))
        if not args.only or any(o in p.stem for o in args.only)
    ]
    if not sweeps:
        raise SystemExit(f"no sweep file of {SWEEPS} matches {args.only}")
    print(
        f"{len(sweeps)} studies, {args.parallel} at once: {', '.join(p.stem for p in sweeps)}",
        flush=True,
    )
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:
        spent = sum(pool.map(lambda p: one_study(p, args), sweeps))
    report(args, {p.stem.split("_")[0] for p in sweeps})
    elapsed = time.perf_counter() - t0
    print(
        f"compute: {spent / 60:.1f} process-minutes, {elapsed / 60:.1f} minutes elapsed", flush=True
    )


if __name__ == "__main__":
    main()
