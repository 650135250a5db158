"""Plots of a run's per-round curves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(history: Sequence[dict[str, float]], path: str | Path, title: str = "") -> Path:
    """Accuracy (train/val/test) and training loss per round, side by side, as a PNG."""
    rounds = [h["round"] for h in history]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key in ("train_acc", "val_acc", "test_acc"):
        if history and key in history[0]:
            ax_acc.plot(rounds, [h[key] for h in history], marker=".", label=key)
    ax_acc.set(xlabel="round", ylabel="accuracy", ylim=(0, 1))
    ax_acc.legend()
    ax_loss.plot(rounds, [h["train_loss"] for h in history], marker=".", color="C3")
    ax_loss.set(xlabel="round", ylabel="train loss (weighted over clients)")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_accuracy_matrix(matrix, path: str | Path, title: str = "") -> Path:
    """Heatmap of the accuracy matrix ``M[t, j]`` (rows: after stage t; columns: stage j)."""
    import numpy as np

    m = np.asarray(matrix, dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 * m.shape[1] + 2, 1.0 * m.shape[0] + 1.5))
    im = ax.imshow(np.ma.masked_invalid(m), vmin=0, vmax=1, cmap="viridis")
    for (t, j), v in np.ndenumerate(m):
        if np.isfinite(v):
            ax.text(
                j, t, f"{v:.2f}", ha="center", va="center", color="white" if v < 0.5 else "black"
            )
    ax.set_xticks(range(m.shape[1]), [f"{j + 1}" for j in range(m.shape[1])])
    ax.set_yticks(range(m.shape[0]), [f"{t + 1}" for t in range(m.shape[0])])
    ax.set(xlabel="classes of stage j", ylabel="after stage t", title=title or "accuracy matrix")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_seen_accuracy(
    stage_results: Sequence[dict[str, float]], path: str | Path, title: str = ""
) -> Path:
    """Average accuracy over the seen stages, and FPR95, after each stage."""
    stages = [r["stage"] for r in stage_results]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(stages, [r["seen_acc"] for r in stage_results], marker="o", label="seen-stage acc")
    ax.plot(stages, [r["fpr95"] for r in stage_results], marker="s", label="FPR95")
    ax.set(xlabel="stage", ylabel="fraction", ylim=(0, 1), xticks=stages, title=title)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
