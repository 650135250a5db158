"""The end-of-run ``curves.png``: a loss panel only when the clients sent a training loss."""

from __future__ import annotations

import math
import struct

from fedlightning.tracking.plots import plot_curves


def png_width(path) -> int:
    """Width in pixels from the PNG's IHDR chunk (bytes 16-20, big-endian)."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">I", head[16:20])[0]


def rows(loss):
    return [{"round": r, "val_acc": 0.5, "test_acc": 0.4, "train_loss": loss} for r in (1, 2)]


def test_a_loss_panel_only_with_a_reported_loss(tmp_path):
    """10 x 3.6 in at 110 dpi with the loss panel (1100 px wide), 5 x 3.6 in without (550)."""
    assert png_width(plot_curves(rows(0.7), tmp_path / "loss.png")) == 1100
    assert png_width(plot_curves(rows(math.nan), tmp_path / "nan.png")) == 550
    no_key = [{"round": 1, "val_acc": 0.5}]
    assert png_width(plot_curves(no_key, tmp_path / "none.png")) == 550


def test_sensitivity_axis_scale_follows_the_grid():
    from fedlightning.tracking.plots import x_scale

    assert x_scale([0, 1e-4, 1e-3, 1e-2, 0.1, 1]) == "symlog"  # FedTIP's lambda grids
    assert x_scale([2, 4, 8, 16, 32, 256]) == "log"
    assert x_scale([2, 4, 8, 16, 32]) == "linear"  # under two decades
    assert x_scale([0, 0.1, 0.5, 1]) == "linear"
    assert x_scale([-1, 0.01, 10]) == "linear"
