"""``fedlightning data manifest``: FedTIP's protocol objects materialized, written, printed
and logged (an MLflow run tagged ``task=protocol``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedlightning.config import build_stream
from fedlightning.data.temporal.protocol import TemporalProtocol, format_table, materialize_checked
from fedlightning.errors import ConfigError
from fedlightning.runs import Run
from fedlightning.tracking import flatten


def run_manifest(cfg: Any, out: Path) -> TemporalProtocol:
    """``fedlightning data manifest``: materialize (or reuse) the protocol of ``cfg``, write it
    to ``out``, print the Table 1 row and the checks, log them to MLflow."""
    if "manifest" not in cfg.protocol:
        raise ConfigError("protocol", "use protocol=temporal (or an experiment=temporal_* )")
    stream = build_stream(cfg)
    params, proto, reused = materialize_checked(stream, cfg.protocol)
    existing = out / "protocol.json"
    if existing.exists() and json.loads(existing.read_text())["hashes"] != proto.hashes:
        raise ConfigError(
            "--out", f"{out} holds a different protocol; refusing to overwrite, choose another"
        )
    files = proto.write(out)
    print(format_table(proto.table()))
    print("tasks        " + json.dumps(proto.tasks.stats(stream)))
    for name, check in proto.negatives["checks"].items():
        print(f"collisions   {name}: " + ", ".join(f"{k} {v}" for k, v in check.items()))
    print("hashes       " + json.dumps(proto.hashes) + ("  (reused)" if reused else ""))
    print(f"written      {out}")
    tags = {"task": "protocol", "dataset": stream.name, "experiment": str(cfg.name)}
    tags.update({f"hash_{k}": v for k, v in proto.hashes.items()})
    run = Run(cfg, out)
    with run.start(tags, f"manifest-{stream.name}", flatten({"protocol": params}), False):
        row = {k: v for k, v in proto.table().items() if isinstance(v, (int, float))}
        run.tracker.log_metrics(row, step=0)
        run.tracker.log_artifacts(files)
    run.tracker.end()
    return proto
