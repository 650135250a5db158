"""``fedlightning data manifest``: FedTIP's protocol objects materialized, written and
printed. It touches no tracking store (no ``mlflow.db`` appears): each training run logs the
protocol hashes it used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedlightning.config import build_stream
from fedlightning.data.temporal.protocol import TemporalProtocol, format_table, materialize_checked
from fedlightning.errors import ConfigError


def run_manifest(cfg: Any, out: Path) -> TemporalProtocol:
    """``fedlightning data manifest``: materialize (or reuse) the protocol of ``cfg``, write it
    to ``out``, print the Table 1 row and the checks."""
    if "manifest" not in cfg.protocol:
        raise ConfigError("protocol", "use protocol=temporal (or an experiment=temporal_* )")
    stream = build_stream(cfg)
    _, proto, reused = materialize_checked(stream, cfg.protocol)
    existing = out / "protocol.json"
    if existing.exists() and json.loads(existing.read_text())["hashes"] != proto.hashes:
        raise ConfigError(
            "--out", f"{out} holds a different protocol; refusing to overwrite, choose another"
        )
    proto.write(out)
    print(format_table(proto.table()))
    print("tasks        " + json.dumps(proto.tasks.stats(stream)))
    for name, check in proto.negatives["checks"].items():
        print(f"collisions   {name}: " + ", ".join(f"{k} {v}" for k, v in check.items()))
    print("hashes       " + json.dumps(proto.hashes) + ("  (reused)" if reused else ""))
    print(f"written      {out}")
    return proto
