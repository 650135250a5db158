"""``fedlightning train experiment=bank_*`` (``task=bank``): the protocol objects, then the
bank, reused when built, and its contexts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedlightning.data.temporal.protocol import format_table
from fedlightning.errors import ConfigError
from fedlightning.runs import Run
from fedlightning.temporal.contexts import cached_contexts
from fedlightning.temporal.setup import bank_variant, ensure_bank, temporal_setup


def train_bank(cfg: DictConfig, run_dir: Path, verbose: bool = True) -> dict[str, Any]:
    """Materialize the protocol, build (or reuse) the bank, write ``summary.json``."""
    t0 = time.perf_counter()
    if cfg.get("resume"):
        raise ConfigError("resume", "bank runs restart from scratch (a built bank is reused)")
    cfg, run_dir, _, stream, bank_cfg, proto, files = temporal_setup(cfg, run_dir)
    params = OmegaConf.to_container(cfg.protocol, resolve=True)
    variant = bank_variant(bank_cfg)
    tags = {
        "method": bank_cfg.encoder,
        "dataset": stream.name,
        "task": "bank",
        "variant": variant,
        "backbone": bank_cfg.encoder,
        "seed": str(cfg.seed),
        "experiment": str(cfg.name),
        **{f"hash_{k}": v for k, v in proto.hashes.items()},
    }
    run = Run(cfg, run_dir)
    with run.start(tags):
        bank = ensure_bank(stream, proto, bank_cfg, int(cfg.seed), params["cache_dir"], run.tracker)
        path, digest = bank["path"], bank["hash"]
        ctx_path, ctx_hash, ctx_reused = cached_contexts(path, digest, proto, params["cache_dir"])
    metrics, reused, history = bank["metrics"], bank["reused"], bank["history"]
    summary = {
        "experiment": str(cfg.name),
        "seed": int(cfg.seed),
        "metrics": {"bank_val_auc": metrics["auc"], "bank_val_ap": metrics["ap"]},
        "comm": {"uplink_mib": 0.0, "downlink_mib": 0.0, "fields": {}},
        "hashes": {**proto.hashes, "bank": digest, "contexts": ctx_hash},
        "contexts": {"path": str(ctx_path), "reused": ctx_reused},
        "bank": {"path": str(path), "reused": reused, "variant": variant, "history": history},
        "table": proto.table(),
        "tasks": proto.tasks.stats(stream),
        "collisions": proto.negatives["checks"],
        "wall_time_s": time.perf_counter() - t0,
        "rounds": 0,
        "run_dir": str(run_dir),
        "tags": tags,
    }
    run.tracker.set_tags({"hash_bank": digest})
    table = None
    if verbose:
        table = "\n".join(
            [
                format_table(proto.table()),
                f"bank             {bank_cfg.encoder} ({variant})"
                + (" reused" if reused else "")
                + f": {path}",
                f"bank_val_auc     {metrics['auc']:.4f}\nbank_val_ap      {metrics['ap']:.4f}",
                f"hash[bank]       {digest}\nwall time        {summary['wall_time_s']:.1f} s",
            ]
        )
    return run.finish(summary, step=len(history), files=[*files, path], table=table)
