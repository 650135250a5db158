"""The equal-budget study behind docs/claims.md: every sweep of ``sweeps/claims/``, then each
study's best setting at the evaluation seeds, then the table.

For each sweep file (``--only`` narrows them by name), in ``--parallel`` processes at once:

1. ``fedlightning sweep FILE`` (its own Optuna storage ``OUT/optuna/<study>.db``, trial runs
   under ``OUT/trials/<study>``): the study and its trials are MLflow runs in the
   ``--experiment-name`` family (default ``fedlightning-claims``);
2. the best trial's parameters, written to ``OUT/best/<study>/best.json`` with its value;
3. ``fedlightning train`` of the study's experiment at those parameters for every ``--seeds``
   (runs under ``OUT/best/<study>/seed<k>``, top-level MLflow runs of the same family).

Then ``fedlightning report`` of the best runs, per part (``cil``: node classification;
``cir``: retrieval) into ``OUT/report``, and a line with the whole study's compute time
(the sum of every process's wall time, and the elapsed time). Run it again to go on: a
finished study is not run again (its storage holds its trials), a finished seed run is
kept, and one whose process died is resumed from its checkpoint.

    python tools/claims_study.py [--only cil_fedogl] [--parallel 2] [--seeds 0 1 2 3 4]
        [--out outputs/claims] [--trials N] [--set federation.rounds=2 ...]
        [--sweeps sweeps/claims/rejection]

``--sweeps`` names another folder of sweep files: ``sweeps/claims/rejection/`` searches the
rejection parameters of CLIPN, GRASP and TopoOOD on the validation FPR95, with the
accuracy-tuned setting as each file's fixed ``overrides`` (which the seed runs keep too).

``--set`` adds Hydra overrides to every run (a quick check of the whole pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "sweeps" / "claims"
ABLATED = ("replay", "distill", "projection", "prototypes")  # FedOGL's components (Table 2)
DATASETS = {"cil": ["citeseer_mm", "cora"], "cir": ["citeseer_mm"]}  # each part's table


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
    spec = yaml.safe_load(sweep.read_text())
    experiment, metric = spec["experiment"], spec["objective"]["metric"]
    storage = f"sqlite:///{(out / 'optuna' / f'{name}.db').resolve()}"
    (out / "optuna").mkdir(parents=True, exist_ok=True)
    common = [f"logger.experiment_name={args.experiment_name}", "threads=1", *args.set]
    spent = fedlightning(
        ["sweep", str(sweep), "--storage", storage, "--out", str(out / "trials" / name)]
        + (["--trials", str(args.trials)] if args.trials else [])
        + common,
        out / "logs" / f"{name}.sweep.log",
    )
    params, value, number = best_params(storage, name)
    best_dir = out / "best" / name
    best_dir.mkdir(parents=True, exist_ok=True)
    record = {"study": name, "experiment": experiment, "trial": number, metric: value}
    (best_dir / "best.json").write_text(json.dumps({**record, "params": params}, indent=2) + "\n")
    print(f"[{name}] best trial {number}: {metric} {value:.4f}  {params}", flush=True)
    tuned = [*spec.get("overrides", []), *(f"{k}={_value(v)}" for k, v in params.items())]
    spent += seed_runs(
        experiment, [*tuned, *common], best_dir, out / "logs" / f"{name}.best.log", args
    )
    print(f"[{name}] {len(args.seeds)} seeds at the best setting done ({spent:.0f} s)", flush=True)
    if "_fedogl_" in f"_{name}_":
        spent += ablations(experiment, name, params, args, [*spec.get("overrides", []), *common])
    return spent


def seed_runs(experiment: str, overrides: list[str], run_dir: Path, log: Path, args) -> float:
    """``fedlightning train`` of ``experiment`` at ``overrides`` for every seed into
    ``run_dir/seed<k>``: a seed whose ``summary.json`` is there is done, one whose process
    died after a checkpoint is resumed, one that died before it starts again."""
    spent = 0.0
    for seed in args.seeds:
        seed_dir = run_dir / f"seed{seed}"
        if (seed_dir / "summary.json").exists():
            continue
        if (seed_dir / "checkpoint.pt").exists():
            cmd = ["train", f"resume={seed_dir}"]
        else:
            if seed_dir.exists():  # died before its first checkpoint: nothing to keep
                shutil.rmtree(seed_dir)
            cmd = ["train", f"experiment={experiment}", f"seed={seed}", *overrides]
            cmd.append(f"hydra.run.dir={seed_dir}")
        spent += fedlightning(cmd, log.with_suffix(f".seed{seed}.log"))
    return spent


def ablations(experiment: str, name: str, params: dict, args, common: list[str]) -> float:
    """FedOGL's Table 2 at the tuned setting: each component off (``algorithm.<c>=false``)."""
    out, spent = Path(args.out), 0.0
    tuned = [f"{k}={_value(v)}" for k, v in params.items()]
    for c in ABLATED:
        run_dir = out / "ablations" / name / f"no_{c}"
        log = out / "logs" / f"{name}.no_{c}.log"
        spent += seed_runs(
            experiment, [*tuned, f"algorithm.{c}=false", *common], run_dir, log, args
        )
    print(f"[{name}] ablations at the best setting done", flush=True)
    return spent


def report(args: argparse.Namespace, parts: set[str]) -> None:
    out = Path(args.out)
    for part in sorted(parts):
        metrics = "am,fm,fpr95,auroc_ood" if part == "cil" else "am,fm,recall_at_1,fpr95,auroc_ood"
        fedlightning(
            [
                "report",
                "--dirs",
                str(out / "best"),
                "--task",
                part,
                "--dataset",
                *DATASETS[part],
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
        if any(out.glob(f"ablations/{part}_*/*/seed*/summary.json")):
            fedlightning(
                ["report", "--dirs", str(out / "best"), str(out / "ablations"), "--task", part]
                + ["--layout", "ablation", "--dataset", *DATASETS[part], "--metrics", metrics]
                + ["--out", str(out / "report"), "--name", f"claims_{part}_ablation"],
                out / "logs" / f"report_{part}_ablation.log",
            )
            print(f"table: {out / 'report' / f'claims_{part}_ablation.md'}", flush=True)


def _runs(
    out: Path, part: str = "cil", ablations: bool = True
) -> dict[tuple[str, str], list[dict]]:
    """The finished best (and ablation) runs' summaries of a part (``cil``, ``cir``) by
    (dataset, row label); each carries its run folder as ``"dir"``."""
    groups: dict[tuple[str, str], list[dict]] = {}
    paths = [*out.glob("best/*/seed*/summary.json")]
    paths += [*out.glob("ablations/*/*/seed*/summary.json")] if ablations else []
    for path in sorted(paths):
        s = json.loads(path.read_text()) | {"dir": str(path.parent)}
        tags = s.get("tags", {})
        if tags.get("task") != part:
            continue
        variant = tags.get("variant", "full")
        label = tags["method"] if variant in ("full", "") else f"{tags['method']}, {variant}"
        groups.setdefault((tags["dataset"], label), []).append(s)
    return groups


def _mean_std(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}" if values else "-"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def plasticity(acc: list[list[float | None]]) -> float:
    """The mean over stages of the accuracy on a stage's own classes right after it (the
    diagonal of the accuracy matrix): how well new classes are learned."""
    return sum(acc[t][t] for t in range(len(acc))) / len(acc)


def mechanism(out: Path) -> None:
    """Per dataset, the drift diagnostics of Eqs. (2)-(4) over stages for every row (the FedOGL
    paper's Fig. 2; mean over seeds), ``OUT/report/drift_<dataset>.png``, and a table of the
    last stage's drifts beside plasticity, FM and AM, ``OUT/report/mechanism_<dataset>.md``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    groups = _runs(out)
    (out / "report").mkdir(parents=True, exist_ok=True)
    for dataset in sorted({d for d, _ in groups}):
        rows = sorted(label for d, label in groups if d == dataset)
        fig = Figure(figsize=(13, 3.8))
        axes = fig.subplots(1, 3)
        table = [
            f"| {dataset} | n | d_sem (last stage) | d_str | d_fed | plasticity | FM | AM |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label in rows:
            runs = groups[(dataset, label)]
            stages = len(runs[0]["stages"])
            for ax, key in zip(axes, ("d_sem", "d_str", "d_fed"), strict=True):
                curve = [sum(r["stages"][t][key] for r in runs) / len(runs) for t in range(stages)]
                ax.plot(range(1, stages + 1), curve, marker="o", label=label)
                ax.set_title(key)
                ax.set_xlabel("stage")
                ax.set_xticks(range(1, stages + 1))
            cells = [
                _mean_std([r["metrics"][k] for r in runs]) for k in ("d_sem", "d_str", "d_fed")
            ]
            cells += [_mean_std([plasticity(r["acc_matrix"]) for r in runs])]
            cells += [_mean_std([r["metrics"][k] for r in runs]) for k in ("fm", "am")]
            table.append(f"| {label} | {len(runs)} | " + " | ".join(cells) + " |")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"drift over stages, {dataset} (mean over seeds, tuned settings)")
        fig.tight_layout()
        fig.savefig(out / "report" / f"drift_{dataset}.png", dpi=110)
        (out / "report" / f"mechanism_{dataset}.md").write_text("\n".join(table) + "\n")
        print(f"mechanism: {out / 'report' / f'mechanism_{dataset}.md'}", flush=True)


def progress(out: Path) -> dict[tuple[str, str, str], tuple[list[float], list[float]]]:
    """Per part and dataset, the tuned methods side by side (mean over seeds): the seen-class
    accuracy after every stage (the FedOGL paper's Fig. 5 right; for retrieval, Recall@1),
    ``OUT/report/seen_<part>_<dataset>.png``, and the test accuracy after every round (its
    Fig. 6 left: convergence; the run's ``history.json``), ``OUT/report/rounds_<part>_<dataset>.png``.
    Returns both curves per (part, dataset, row label)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    curves = {}
    (out / "report").mkdir(parents=True, exist_ok=True)
    for part in DATASETS:
        groups = _runs(out, part, ablations=False)
        for dataset in sorted({d for d, _ in groups}):
            seen, rounds = Figure(figsize=(5.5, 3.8)), Figure(figsize=(7, 3.8))
            ax_s, ax_r = seen.subplots(), rounds.subplots()
            same: dict[tuple, list[str]] = {}  # rows that train alike share one line
            for label in sorted(label for d, label in groups if d == dataset):
                runs = groups[(dataset, label)]
                curve = [statistics.mean(r["stages"][t]["seen_acc"] for r in runs)
                         for t in range(len(runs[0]["stages"]))]  # fmt: skip
                hist = [json.loads((Path(r["dir"]) / "history.json").read_text()) for r in runs]
                acc = [statistics.mean(h[i]["test_acc"] for h in hist) for i in range(len(hist[0]))]
                curves[(part, dataset, label)] = (curve, acc)
                same.setdefault((tuple(curve), tuple(acc)), []).append(label)
            for i, ((curve, acc), labels) in enumerate(same.items()):
                style = {"label": " = ".join(labels), "ls": ("-", "--", ":")[i // 10 % 3]}
                ax_s.plot(range(1, len(curve) + 1), curve, marker="o", **style)
                ax_s.set_xticks(range(1, len(curve) + 1))
                ax_r.plot(range(1, len(acc) + 1), acc, lw=1.2, **style)
            metric = "Recall@1" if part == "cir" else "accuracy"
            ax_s.set(xlabel="stage", ylabel=f"seen-class {metric}", title=f"{part} {dataset}")
            ax_r.set(
                xlabel="round (all stages)", ylabel=f"test {metric}", title=f"{part} {dataset}"
            )
            for fig, ax, name in ((seen, ax_s, "seen"), (rounds, ax_r, "rounds")):
                ax.legend(fontsize=7)
                fig.tight_layout()
                fig.savefig(out / "report" / f"{name}_{part}_{dataset}.png", dpi=110)
            print(f"progress: {out / 'report'}/{{seen,rounds}}_{part}_{dataset}.png", flush=True)
    return curves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="sweep files whose name has one of these")
    ap.add_argument("--sweeps", default=str(SWEEPS), help="the folder of the sweep files")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument(
        "--trials", type=int, default=None, help="finished trials per study (the files')"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--out", default="outputs/claims")
    ap.add_argument("--experiment-name", default="fedlightning-claims")
    ap.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every run")
    args = ap.parse_args()
    folder = Path(args.sweeps)
    sweeps = [
        p
        for p in sorted(folder.glob("*.yaml"))
        if not args.only or any(o in p.stem for o in args.only)
    ]
    if not sweeps:
        raise SystemExit(f"no sweep file of {folder} matches {args.only}")
    print(
        f"{len(sweeps)} studies, {args.parallel} at once: {', '.join(p.stem for p in sweeps)}",
        flush=True,
    )
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:
        spent = sum(pool.map(lambda p: one_study(p, args), sweeps))
    report(args, {p.stem.split("_")[0] for p in sweeps})
    mechanism(Path(args.out))
    progress(Path(args.out))
    elapsed = time.perf_counter() - t0
    print(
        f"compute: {spent / 60:.1f} process-minutes, {elapsed / 60:.1f} minutes elapsed", flush=True
    )


if __name__ == "__main__":
    main()
