"""One program per kind of run, from a composed config to ``summary.json``: graph federations
(``task=fl``, ``cil``, ``cir``: :mod:`.graph_program`), FedTIP's task protocol (``task=temporal``:
:mod:`.temporal_program`), the bank's pre-training (``task=bank``: :mod:`.bank_program`) and the
protocol manifest (:mod:`.manifest_program`). Each goes through the run wrapper,
:mod:`fedlightning.runs`."""

import math


def metric_text(value: float | None, spec: str = ".4f") -> str:
    """``value`` formatted, or ``-`` for a metric that could not be computed (``None`` or
    NaN; the run's log says why, e.g. an untrained FedTIP has no class prototype)."""
    if value is None or not math.isfinite(value):
        return "-"
    return format(value, spec)
