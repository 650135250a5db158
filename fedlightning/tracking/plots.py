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
