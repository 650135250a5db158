"""Plots of runs, sweeps and reports, as PNG files. matplotlib is imported by the first plot,
and used through ``Figure`` (neither ``pyplot`` nor a GUI backend is needed)."""

from __future__ import annotations

import itertools
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _subplots(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """``pyplot.subplots`` without pyplot: a detached ``Figure`` and its axes."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        # a backend named up front: reading every rcParam (``boxplot`` does) would otherwise
        # import pyplot to resolve the automatic one
        matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=kwargs.pop("figsize", None))
    return fig, fig.subplots(nrows, ncols, **kwargs)


def _save(fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def plot_curves(history: Sequence[dict[str, float]], path: str | Path, title: str = "") -> Path:
    """Accuracy (train/val/test) per round and, beside it, the clients' training loss when
    they sent one (``federation.report_train_loss``; rows without it, or NaN, have none):
    with no loss in any round the figure is the accuracy panel alone."""
    import math

    rounds = [h["round"] for h in history]
    losses = [h.get("train_loss", math.nan) for h in history]
    with_loss = any(math.isfinite(v) for v in losses)
    fig, axes = _subplots(1, 2 if with_loss else 1, figsize=(10 if with_loss else 5, 3.6))
    ax_acc = axes[0] if with_loss else axes
    for key in ("train_acc", "val_acc", "test_acc"):
        if history and key in history[0]:
            ax_acc.plot(rounds, [h[key] for h in history], marker=".", label=key)
    ax_acc.set(xlabel="round", ylabel="accuracy", ylim=(0, 1))
    ax_acc.legend()
    if with_loss:
        axes[1].plot(rounds, losses, marker=".", color="C3")
        axes[1].set(xlabel="round", ylabel="train loss (weighted over clients)")
    fig.suptitle(title)
    return _save(fig, path)


def plot_accuracy_matrix(matrix, path: str | Path, title: str = "") -> Path:
    """Heatmap of the accuracy matrix ``M[t, j]`` (rows: after stage t; columns: stage j)."""
    import numpy as np

    m = np.asarray(matrix, dtype=float)
    fig, ax = _subplots(figsize=(1.2 * m.shape[1] + 2, 1.0 * m.shape[0] + 1.5))
    im = ax.imshow(np.ma.masked_invalid(m), vmin=0, vmax=1, cmap="viridis")
    for (t, j), v in np.ndenumerate(m):
        if np.isfinite(v):
            color = "white" if v < 0.5 else "black"
            ax.text(j, t, f"{v:.2f}", ha="center", va="center", color=color)
    ax.set_xticks(range(m.shape[1]), [f"{j + 1}" for j in range(m.shape[1])])
    ax.set_yticks(range(m.shape[0]), [f"{t + 1}" for t in range(m.shape[0])])
    ax.set(xlabel="classes of stage j", ylabel="after stage t", title=title or "accuracy matrix")
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def plot_client_class_matrix(
    panels: Mapping[str, Sequence[Sequence[float]]], path: str | Path, title: str = ""
) -> Path:
    """Client-by-class heatmaps, one panel per entry of ``panels`` (``{name: [[class, client,
    value], ...]}``), on one colour scale from 0 (white) to the largest value (dark); a
    missing (client, class) pair is grey. FedOGL's Fig. 3 with the terms of Eq. (4)."""
    import numpy as np

    rows = [r for p in panels.values() for r in p]
    classes = sorted({int(r[0]) for r in rows})
    clients = sorted({int(r[1]) for r in rows})
    top = max((r[2] for r in rows), default=1.0) or 1.0
    n = len(panels)
    fig, axes = _subplots(
        1,
        n,
        squeeze=False,
        figsize=(0.35 * len(classes) * n + 1.5 * n + 1, 0.3 * len(clients) + 1.8),
    )
    for ax, (name, part) in zip(axes[0], panels.items(), strict=True):
        m = np.full((len(clients), len(classes)), np.nan)
        for cl, k, v in part:
            m[clients.index(int(k)), classes.index(int(cl))] = v
        ax.set_facecolor("0.85")
        im = ax.imshow(np.ma.masked_invalid(m), vmin=0, vmax=top, cmap="Blues", aspect="auto")
        ax.set_xticks(range(len(classes)), [str(c) for c in classes], fontsize=7)
        ax.set_yticks(range(len(clients)), [str(k) for k in clients], fontsize=7)
        ax.set(xlabel="class", ylabel="client" if ax is axes[0][0] else "", title=name)
    fig.colorbar(im, ax=list(axes[0]))
    if title:
        fig.suptitle(title)
    fig.savefig(Path(path), dpi=110, bbox_inches="tight")
    return Path(path)


def plot_seen_accuracy(
    stage_results: Sequence[dict[str, float]], path: str | Path, title: str = ""
) -> Path:
    """Average accuracy over the seen stages, and FPR95, after each stage."""
    stages = [r["stage"] for r in stage_results]
    fig, ax = _subplots(figsize=(5, 3.6))
    ax.plot(stages, [r["seen_acc"] for r in stage_results], marker="o", label="seen-stage acc")
    ax.plot(stages, [r["fpr95"] for r in stage_results], marker="s", label="FPR95")
    ax.set(xlabel="stage", ylabel="fraction", ylim=(0, 1), xticks=stages, title=title)
    ax.legend()
    return _save(fig, path)


def plot_optimization_history(
    values: Sequence[float], path: str | Path, maximize: bool = True, metric: str = ""
) -> Path:
    """Objective of each finished trial (in trial order) and the best so far."""
    fig, ax = _subplots(figsize=(5.5, 3.6))
    xs = list(range(len(values)))
    best = list(itertools.accumulate(values, max if maximize else min))
    ax.plot(xs, values, "o", label="trial")
    ax.step(xs, best, where="post", color="C3", label="best so far")
    ax.set(xlabel="trial", ylabel=metric or "objective", title="optimization history")
    ax.legend()
    return _save(fig, path)


def plot_importances(importances: dict[str, float], path: str | Path) -> Path:
    """Horizontal bars of parameter importances (Optuna's fANOVA)."""
    names = list(importances)[::-1]
    fig, ax = _subplots(figsize=(5.5, 0.5 * len(names) + 1.5))
    ax.barh(names, [importances[n] for n in names])
    ax.set(xlabel="importance", title="parameter importance")
    return _save(fig, path)


def x_scale(x: Sequence[float]) -> str:
    """The axis scale for a parameter grid: ``"log"`` for positive values spanning two
    decades or more, ``"symlog"`` for such a grid with 0 in it (``lambda`` in {0, 1e-4, ...,
    1}), else ``"linear"``."""
    positive = [v for v in x if v > 0]
    if len(positive) < 2 or min(x) < 0 or max(positive) / min(positive) < 100:
        return "linear"
    return "log" if min(x) > 0 else "symlog"


def plot_sensitivity(
    x: Sequence[float],
    values: Sequence[Sequence[float]],
    path: str | Path,
    xlabel: str,
    ylabel: str,
    log_x: bool | None = None,
) -> Path:
    """A metric against one parameter: the mean of each x's ``values`` (over seeds) with
    sample-std error bars (0 for one value), sorted by x; ``log_x=None``: the scale of
    :func:`x_scale`."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    mean = [statistics.fmean(values[i]) for i in order]
    std = [statistics.stdev(values[i]) if len(values[i]) > 1 else 0.0 for i in order]
    fig, ax = _subplots(figsize=(5, 3.6))
    ax.errorbar([x[i] for i in order], mean, yerr=std, marker="o", capsize=3)
    scale = x_scale(x) if log_x is None else "log" if log_x else "linear"
    if scale == "symlog":
        ax.set_xscale("symlog", linthresh=min(v for v in x if v > 0))
    elif scale == "log":
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=f"sensitivity to {xlabel}")
    return _save(fig, path)


def plot_scatter(
    points: dict[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    xlabel: str,
    ylabel: str,
) -> Path:
    """One marker series per label (e.g. method): uplink against a metric, run by run."""
    fig, ax = _subplots(figsize=(5.5, 3.8))
    for i, (label, (xs, ys)) in enumerate(points.items()):
        ax.scatter(xs, ys, label=label, marker="os^vD<>p*h"[i % 10])
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_task_metrics(rows: Sequence[dict[str, float]], path: str | Path, title: str = "") -> Path:
    """FedTIP's AUC-ROCs per task (test, solid; validation, dashed) and their spread."""
    keys = [k for k in ("auc_nc", "auc_tlp", "auc_ilp") if rows and k in rows[0]]
    fig, (ax_line, ax_box) = _subplots(1, 2, figsize=(11, 3.6), width_ratios=[3, 1])
    x = list(range(1, len(rows) + 1))
    for n, key in enumerate(keys):
        ax_line.plot(x, [r[key] for r in rows], color=f"C{n}", lw=1, label=key)
        if f"val_{key}" in rows[0]:
            ax_line.plot(x, [r[f"val_{key}"] for r in rows], color=f"C{n}", lw=1, ls="--")
    ax_line.set(xlabel="task", ylabel="AUC-ROC", ylim=(0, 1))
    ax_line.legend(loc="lower right")
    values = [[r[k] for r in rows if r[k] == r[k]] for k in keys]
    ax_box.boxplot(values, tick_labels=keys)
    ax_box.set(ylim=(0, 1), title="over tasks")
    fig.suptitle(title)
    return _save(fig, path)
