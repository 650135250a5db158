"""Paper-style tables and plots from finished runs: ``fedlightning report``.

Runs come from MLflow (selected by their tags) or from the ``summary.json`` files under
``--dirs``; a cell is the mean and sample std over seeds (docs/experiments.md, "Reports",
gives the selection, layouts, options and files)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fedlightning.errors import ConfigError
from fedlightning.tracking import MlflowTracker, flatten
from fedlightning.tracking.mlflow_tracker import PARENT_TAG, family_experiment, local_store
from fedlightning.tracking.plots import (
    plot_accuracy_matrix,
    plot_client_class_matrix,
    plot_scatter,
    plot_sensitivity,
)

LOWER_IS_BETTER = {"fm", "fm_diag", "fpr95", "val_fm", "val_fpr95", "train_loss", "s_per_round"}
LOWER_IS_BETTER |= {"s_per_task", "uplink_mib_per_task", "downlink_mib_per_task", "uplink_mib"}
LOWER_IS_BETTER |= {"downlink_mib", "recurrent_downlink_mib_per_task"}
#: the drift diagnostics of FedOGL Eqs. (2)-(4) and the spread of Eq. (4)'s terms
LOWER_IS_BETTER |= {"d_sem", "d_str", "d_fed", "d_fed_local"}
LOWER_IS_BETTER |= {f"d_fed_local_{s}" for s in ("std", "class_std", "client_std")}
#: each task family's own metrics, the default columns of its table
DEFAULT_METRICS = {
    "fl": "test_acc,val_acc,uplink_mib",
    "cil": "am,fm,fpr95",
    "cir": "recall_at_1,am,fm",
    "temporal": "auc_nc,auc_tlp,auc_ilp,uplink_mib_per_task,s_per_task",
    "bank": "bank_val_auc,bank_val_ap",
}
LABELS = {"am": "AM", "fm": "FM", "fpr95": "FPR95", "auroc_ood": "AUROC", "open_acc": "OpenAcc"}
LABELS.update(s_per_round="s/round", uplink_mib="uplink MiB", downlink_mib="downlink MiB")
#: from summary.json["comm"]: a run's totals, and FedTIP's downlink per task without the bank
COMM_METRICS = ("uplink_mib", "downlink_mib", "recurrent_downlink_mib_per_task")
LABELS.update(
    auc_nc="NC", auc_tlp="T-LP", auc_ilp="I-LP", uplink_mib_per_task="MiB/task", s_per_task="s/task"
)
LABELS.update(recurrent_downlink_mib_per_task="down MiB/task (no bank)")
SWEEP_TASKS = ("sweep", "sweep_trial", "report")
TASKS = ("fl", "cil", "cir", "temporal", "bank")  # the `task` tags of training runs


def runs_from_dirs(dirs: list[Path]) -> list[dict[str, Any]]:
    """Every ``summary.json`` below ``dirs``."""
    out = []
    for root in dirs:
        if not root.exists():
            raise ConfigError("--dirs", f"{root} does not exist")
        for f in sorted(root.rglob("summary.json")):
            s = json.loads(f.read_text())
            config = f.parent / "config.yaml"
            if config.exists():
                params = flatten(OmegaConf.to_container(OmegaConf.load(config), resolve=False))
                s["params"] = {k: str(v) for k, v in params.items()}
            out.append(s)
    return out


def runs_from_mlflow(tracking_uri: str, prefix: str, tags: dict[str, str]) -> list[dict]:
    """The ``summary.json`` of every finished, top-level MLflow run whose tags match
    ``tags``, from the experiment of its task family (``<prefix>/<task>``) and the single
    experiment ``prefix`` that older versions logged every run to. Sweep trials' runs (nested
    under a trial) are left out. A store that does not exist is an error, not created."""
    store = local_store(tracking_uri)
    if store is not None and not store.exists():
        raise ConfigError(
            "--tracking-uri",
            f"no MLflow store at {tracking_uri} (no run has logged there); "
            "pass the store's --tracking-uri, or --dirs with run directories",
        )
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    names = [prefix, family_experiment(prefix, tags)]
    found = [e for e in (client.get_experiment_by_name(n) for n in names) if e is not None]
    if not found:
        raise ConfigError(
            "--task",
            f"no runs of task {tags.get('task')!r} at {tracking_uri} (no MLflow experiment "
            f"{names[-1]!r}; --experiment-name sets the prefix, now {prefix!r})",
        )
    query = " and ".join(
        [f"tags.{k} = '{v}'" for k, v in tags.items()] + ["attributes.status = 'FINISHED'"]
    )
    out = []
    ids = [e.experiment_id for e in found]
    with tempfile.TemporaryDirectory() as tmp:
        for run in client.search_runs(ids, query, max_results=50000):
            if run.data.tags.get("task") in SWEEP_TASKS or PARENT_TAG in run.data.tags:
                continue
            try:
                path = client.download_artifacts(run.info.run_id, "summary.json", tmp)
            except Exception:  # a run without its summary (e.g. logged by another tool)
                continue
            s = json.loads(Path(path).read_text())
            s["start_time"] = run.info.start_time
            s["params"] = dict(run.data.params)
            out.append(s)
    return out


FAMILY_METRICS = {"nc": "auc_nc", "lp": "auc_tlp,auc_ilp"}


def run_tags(summary: dict) -> dict[str, str]:
    """A run's tags, with ``families`` filled in for FedTIP runs made before runs carried
    that tag (their ``summary.json`` lists the families they ran)."""
    tags = dict(summary.get("tags", {}))
    if tags.get("task") == "temporal" and "families" not in tags and summary.get("families"):
        tags["families"] = ",".join(summary["families"])
    return tags


def matches(summary: dict, wanted: dict[str, str], family: str | None) -> bool:
    """The run has every tag of ``wanted`` and, with ``family``, ran that task family."""
    tags = run_tags(summary)
    if family and family not in tags.get("families", "").split(","):
        return False
    return all(tags.get(k) == v for k, v in wanted.items())


def row_label(tags: dict[str, str], layout: str) -> str:
    """``method`` or ``method+variant`` (main); the variant alone (ablation)."""
    method, variant = tags.get("method", "?"), tags.get("variant", "full")
    if tags.get("task") == "temporal":  # FedTIP's tables compare backbones too
        method = f"{method} ({tags.get('backbone', '?')})"
        variant = variant if layout != "ablation" else f"{variant} ({tags.get('backbone', '?')})"
    if layout == "ablation":
        return variant
    return method if variant == "full" else f"{method}+{variant}"


def select(runs: list[dict], layout: str, method: str | None) -> list[dict]:
    """Keep the runs of the layout; of runs with the same config and seed, the newest."""
    keep = runs
    if layout == "main":  # no ablations
        keep = [s for s in runs if not s.get("tags", {}).get("variant", "full").startswith("no_")]
    elif layout == "ablation":
        keep = [s for s in runs if s.get("tags", {}).get("method") == (method or "fedogl")]
    newest: dict[tuple, dict] = {}
    for s in sorted(keep, key=lambda s: s.get("start_time", 0)):
        t = s.get("tags", {})
        key = (s.get("experiment"), t.get("dataset"), t.get("variant"), s["seed"])
        newest[(*key, _config_key(s))] = s
    return list(newest.values())


def _config_key(summary: dict) -> str:
    """What makes two runs the same configuration: their params but where they logged."""
    params = summary.get("params", {})
    kept = {k: v for k, v in params.items() if not k.startswith(("logger.", "resume", "runner."))}
    return json.dumps(kept, sort_keys=True)


def aggregate(runs: list[dict], metrics: list[str], layout: str) -> dict[str, dict[str, dict]]:
    """``table[row][dataset][metric] = {"mean", "std", "std_over", "n", "values"}``:
    ``std`` over seeds (``std_over="seeds"``), over one FedTIP run's tasks (``"tasks"``) or
    ``None`` for a single value."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for s in runs:
        groups[(row_label(s["tags"], layout), s["tags"].get("dataset", "?"))].append(s)
    table: dict[str, dict[str, dict]] = defaultdict(dict)
    for (row, dataset), group in sorted(groups.items()):
        cells = {}
        for m in metrics:
            values = [v for v in (value(s, m) for s in group) if _finite(v)]
            one = len(group) == 1 and len(values) == 1
            within = group[0]["metrics"].get(f"{m}_std") if one else None
            over = "seeds" if len(values) > 1 else "tasks" if _finite(within) else None
            cells[m] = {
                "mean": statistics.fmean(values) if values else math.nan,
                "std": statistics.stdev(values) if over == "seeds" else within if over else None,
                "std_over": over,  # seeds; one FedTIP run's tasks; None: one value
                "n": len(values),
                "values": values,
            }
            if over == "tasks":
                cells[m]["tasks"] = group[0].get("tasks_done")
        table[row][dataset] = cells
    return dict(table)


def value(summary: dict, metric: str) -> float | None:
    """A run's metric. ``s_per_round`` (``s_per_task``): the mean round (task) time the
    run measured (``summary.json["timing"]``), else its wall time over its rounds (tasks);
    ``uplink_mib``, ``downlink_mib`` and ``recurrent_downlink_mib_per_task`` (FedTIP, the
    bank left out): from ``summary.json["comm"]``."""
    if metric in ("s_per_round", "s_per_task"):
        measured = summary.get("timing", {}).get(metric)
        if _finite(measured):
            return measured
        done = summary.get("tasks_done") if metric == "s_per_task" else summary["rounds"]
        return summary["wall_time_s"] / max(done or 1, 1)
    if metric in COMM_METRICS and metric not in summary["metrics"]:
        return summary.get("comm", {}).get(metric)
    return summary["metrics"].get(metric)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def best_rows(table: dict, datasets: list[str], metrics: list[str]) -> dict[tuple, str]:
    """The row with the best mean in each (dataset, metric) column."""
    best = {}
    for d in datasets:
        for m in metrics:
            scored = [(r, c[d][m]["mean"]) for r, c in table.items() if d in c]
            scored = [(r, v) for r, v in scored if math.isfinite(v)]
            if scored:
                pick = min if m in LOWER_IS_BETTER else max
                best[(d, m)] = pick(scored, key=lambda x: x[1])[0]
    return best


def render(table: dict, metrics: list[str], digits: int, fmt: str) -> str:
    """The table as Markdown (``fmt="md"``) or a LaTeX ``tabular`` (``fmt="tex"``).
    Written out rather than with pandas: ``to_markdown`` needs ``tabulate`` (not installed)
    and neither writer bolds each column's best cell or adds ``n`` and the spread."""
    datasets = sorted({d for cells in table.values() for d in cells})
    best = best_rows(table, datasets, metrics)
    names = [LABELS.get(m, m) for m in metrics]

    def cell(row: str, d: str, m: str) -> str:
        c = table[row].get(d, {}).get(m)
        if c is None or not c["n"]:
            return "-"
        pm = "±" if fmt == "md" else r"$\pm$"
        text = f"{c['mean']:.{digits}f}"
        if c["std_over"] is not None:
            text += f" {pm} {c['std']:.{digits}f}"
        if c["std_over"] == "tasks":  # one run: the spread over its tasks, not over seeds
            text += f" (n=1, {pm} over {c.get('tasks') or ''} tasks)".replace("  ", " ")
        else:
            text += f" (n={c['n']})"
        if best.get((d, m)) == row:
            text = f"**{text}**" if fmt == "md" else rf"\textbf{{{text}}}"
        return text

    rows = {row: [cell(row, d, m) for d in datasets for m in metrics] for row in table}
    if fmt == "md":
        head = "| method | " + " | ".join(f"{d} {n}" for d in datasets for n in names) + " |"
        lines = [head, "|---" * (1 + len(datasets) * len(metrics)) + "|"]
        lines += [f"| {row} | " + " | ".join(cells) + " |" for row, cells in rows.items()]
        return "\n".join(lines) + "\n"
    cols = "l" + "c" * len(datasets) * len(metrics)
    lines = [rf"\begin{{tabular}}{{{cols}}}", r"\toprule"]
    groups = " & ".join(rf"\multicolumn{{{len(metrics)}}}{{c}}{{{_tex(d)}}}" for d in datasets)
    lines += [f" & {groups} \\\\", "method & " + " & ".join(names * len(datasets)) + r" \\"]
    lines.append(r"\midrule")
    lines += [f"{_tex(row)} & " + " & ".join(cells) + r" \\" for row, cells in rows.items()]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def _tex(text: str) -> str:
    return text.replace("_", r"\_")


def plots(runs: list[dict], layout: str, metric: str, out: Path) -> list[Path]:
    """Uplink against ``metric`` for every run, and seed-mean accuracy matrices."""
    points: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    mats: dict[tuple[str, str], list] = defaultdict(list)
    terms: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for s in runs:
        row, d = row_label(s["tags"], layout), s["tags"].get("dataset", "?")
        if _finite(s["metrics"].get(metric)):
            points[f"{row} ({d})"][0].append(s["comm"]["uplink_mib"])
            points[f"{row} ({d})"][1].append(s["metrics"][metric])
        if s.get("acc_matrix"):
            mats[(row, d)].append(s["acc_matrix"])
        if s.get("prototype_terms"):
            terms[d][row].append(s["prototype_terms"][-1])
    paths = []
    if points:
        paths.append(
            plot_scatter(dict(points), out / f"uplink_vs_{metric}.png", "uplink (MiB)", metric)
        )
    for (row, d), ms in sorted(mats.items()):
        mean = [
            [_mean_or_nan([m[t][j] for m in ms]) for j in range(len(ms[0][t]))]
            for t in range(len(ms[0]))
        ]
        name = f"acc_matrix_{row}_{d}".replace("+", "_").replace("/", "_")
        paths.append(plot_accuracy_matrix(mean, out / f"{name}.png", f"{row}, {d}"))
    for d, by_row in sorted(terms.items()):
        panels = {row: mean_terms(ts) for row, ts in sorted(by_row.items())}
        title = f"{d}, last stage: 1 - cos(client prototype, global prototype), seed mean"
        paths.append(plot_client_class_matrix(panels, out / f"d_fed_terms_{d}.png", title))
    return paths


def mean_terms(runs_terms: list[list[list[float]]]) -> list[list[float]]:
    """The mean over runs of each (class, client) term of Eq. (4) (``[class, client, term]``
    rows, over the runs that have the pair), sorted by class then client."""
    cells: dict[tuple[int, int], list[float]] = defaultdict(list)
    for rows in runs_terms:
        for cl, k, v in rows:
            cells[(int(cl), int(k))].append(v)
    return [[cl, k, statistics.fmean(v)] for (cl, k), v in sorted(cells.items())]


def sensitivity(runs: list[dict], key: str, metric: str, layout: str, out: Path) -> list[Path]:
    """``metric`` against the config value ``key``: mean and std over seeds, one plot per
    row and dataset (a grid run with ``train -m key=a,b,c seed=0,1,2``)."""
    groups: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in runs:
        raw, v = s.get("params", {}).get(key), value(s, metric)
        try:
            x = float(raw)
        except (TypeError, ValueError):
            continue
        if _finite(v):
            groups[(row_label(s["tags"], layout), s["tags"].get("dataset", "?"))][x].append(v)
    paths = []
    for (row, d), points in sorted(groups.items()):
        if len(points) < 2:
            continue
        xs = sorted(points)
        name = re.sub(r"(?:[^\w.=-]|_)+", "_", f"sensitivity_{key}_{row}_{d}")  # "fedtip (tgn)"
        paths.append(
            plot_sensitivity(xs, [points[x] for x in xs], out / f"{name}.png", key, metric)
        )
    if not paths:
        raise ConfigError("--sensitivity", f"no two runs of a method differ in {key!r}")
    return paths


def _mean_or_nan(values: list) -> float:
    vals = [v for v in values if _finite(v)]
    return statistics.fmean(vals) if vals else math.nan


def main(argv: list[str]) -> int:
    if not (sys.stdout.isatty() and sys.stderr.isatty()):  # piped or captured: no bars
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    ap = argparse.ArgumentParser(prog="fedlightning report", description=__doc__.splitlines()[0])
    ap.add_argument("--dirs", nargs="+", type=Path, help="read summary.json below these")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store (default: as train)")
    ap.add_argument(
        "--experiment-name",
        default="fedlightning",
        help="prefix of the MLflow experiments <prefix>/<task> (logger.experiment_name)",
    )
    ap.add_argument("--task", default="cil", help=f"runs with this task tag: {', '.join(TASKS)}")
    ap.add_argument(
        "--dataset",
        nargs="*",
        default=[],
        help="one table with these datasets side by side (default: one table per dataset)",
    )
    ap.add_argument("--tag", action="append", default=[], help="only runs with tag k=v")
    ap.add_argument(
        "--family", choices=sorted(FAMILY_METRICS), help="temporal: runs of this task family"
    )
    ap.add_argument("--layout", choices=["main", "ablation"], default="main")
    ap.add_argument("--method", default=None, help="the ablated method (ablation layout)")
    ap.add_argument(
        "--metrics",
        default=None,
        help="default: the task's own ("
        + "; ".join(f"{k}: {v}" for k, v in DEFAULT_METRICS.items())
        + ")",
    )
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("reports"))
    ap.add_argument("--name", default=None, help="file stem (default: <task>_<layout>)")
    ap.add_argument("--log", action="store_true", help="log the files to an MLflow run")
    ap.add_argument(
        "--sensitivity", metavar="KEY", help="also plot the first metric against config KEY"
    )
    args = ap.parse_args(argv)
    if args.task not in TASKS:
        raise ConfigError("--task", f"unknown task {args.task!r}; one of {', '.join(TASKS)}")
    bad = [t for t in args.tag if "=" not in t]
    if bad:
        raise ConfigError("--tag", f"expected key=value, got {bad[0]!r}")
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    if args.dirs:
        runs = runs_from_dirs(args.dirs)
    else:
        runs = runs_from_mlflow(uri, args.experiment_name, {"task": args.task})
    wanted = dict(t.split("=", 1) for t in args.tag)
    wanted["task"] = args.task
    runs = [s for s in runs if matches(s, wanted, args.family)]
    if args.dataset:
        runs = [s for s in runs if s["tags"].get("dataset") in args.dataset]
    method = args.method or ("fedtip" if args.task == "temporal" else None)
    runs = select(runs, args.layout, method)
    if not runs:
        raise ConfigError("--task", f"no finished runs with task {args.task!r} match")
    chosen = args.metrics or FAMILY_METRICS.get(args.family)
    chosen = chosen or DEFAULT_METRICS.get(args.task, "am,fm,fpr95")
    metrics = [m.strip() for m in chosen.split(",") if m.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{args.task}_{args.layout}"
    # one table per dataset, unless --dataset names the datasets to put side by side
    if args.dataset:
        parts = {stem: runs}
    else:
        datasets = sorted({s["tags"].get("dataset", "?") for s in runs})
        parts = {
            f"{stem}_{d}": [s for s in runs if s["tags"].get("dataset", "?") == d] for d in datasets
        }
    files = []
    for name, part in parts.items():
        table = aggregate(part, metrics, args.layout)
        md = render(table, metrics, args.digits, "md")
        written = [args.out / f"{name}.md", args.out / f"{name}.tex", args.out / f"{name}.json"]
        written[0].write_text(md)
        written[1].write_text(render(table, metrics, args.digits, "tex"))
        written[2].write_text(json.dumps(table, indent=2))
        files += written
        print(f"{name}: {len(part)} runs\n{md}")
    files += plots(runs, args.layout, metrics[0], args.out)
    if args.sensitivity:
        files += sensitivity(runs, args.sensitivity, metrics[0], args.layout, args.out)
    print(f"{len(runs)} runs; wrote {', '.join(str(f) for f in files)}")
    if args.log:
        tracker = MlflowTracker(uri, args.experiment_name)
        tracker.start(f"report-{stem}", {"task": "report", "layout": args.layout}, vars(args))
        tracker.log_artifacts(files)
        tracker.end()
    return 0
