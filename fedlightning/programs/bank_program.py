"""``fedlightning train experiment=bank_*`` (``task=bank``): the protocol objects, then the
bank, reused when built, and its contexts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedlightning.data.temporal.protocol import format_table
from fedlightning.errors import ConfigError
from fedlightning.programs.temporal_setup import bank_variant, ensure_bank, temporal_setup
from fedlightning.runs import Run, run_tags
from fedlightning.temporal.contexts import cached_contexts


def train_bank(
    cfg: DictConfig,
    run_dir: Path,
    observe: Any = None,
    verbose: bool = True,
    runner: Any = None,
) -> dict[str, Any]:
    """Materialize the protocol, build (or reuse) the bank, write ``summary.json``. The bank
    is pre-trained centrally, in one process: no runner but the sequential one (``observe``
    sees nothing: there are no rounds)."""
    t0 = time.perf_counter()
    target = str(OmegaConf.select(cfg, "runner._target_", default=""))
    if target.endswith(".DistributedRunner"):
        raise ConfigError(
            "runner",
            "runner=distributed does not support task=bank: the bank is pre-trained "
            "centrally, in one process; use runner=sequential",
        )
    if cfg.get("resume"):
        raise ConfigError("resume", "bank runs restart from scratch (a built bank is reused)")
    cfg, run_dir, _, stream, bank_cfg, proto, files = temporal_setup(cfg, run_dir)
    params = OmegaConf.to_container(cfg.protocol, resolve=True)
    variant = bank_variant(bank_cfg)
    tags = run_tags(
        cfg,
        proto.hashes,
        method=bank_cfg.encoder,
        dataset=stream.name,
        task="bank",
        variant=variant,
        backbone=bank_cfg.encoder,
    )
    run = Run(cfg, run_dir)
    with run.start(tags):
        bank = ensure_bank(stream, proto, bank_cfg, int(cfg.seed), params["cache_dir"], run.tracker)
        path, digest = bank["path"], bank["hash"]
        ctx_path, ctx_hash, ctx_reused = cached_contexts(path, digest, proto, params["cache_dir"])
    metrics, reused, history = bank["metrics"], bank["reused"], bank["history"]
    summary = run.summary(
        t0,
        metrics={"bank_val_auc": metrics["auc"], "bank_val_ap": metrics["ap"]},
        comm={"uplink_mib": 0.0, "downlink_mib": 0.0, "fields": {}},
        hashes={**proto.hashes, "bank": digest, "contexts": ctx_hash},
        contexts={"path": str(ctx_path), "reused": ctx_reused},
        bank={"path": str(path), "reused": reused, "variant": variant, "history": history},
        table=proto.table(),
        tasks=proto.tasks.stats(stream),
        collisions=proto.negatives["checks"],
        rounds=0,
    )
    run.tracker.set_tags({"hash_bank": digest})

    def table(summary: dict[str, Any]) -> str:
        return "\n".join(
            [
                format_table(proto.table()),
                f"bank             {bank_cfg.encoder} ({variant})"
                + (" reused" if reused else "")
                + f": {path}",
                f"bank_val_auc     {metrics['auc']:.4f}\nbank_val_ap      {metrics['ap']:.4f}",
                f"hash[bank]       {digest}\nwall time        {summary['wall_time_s']:.1f} s",
            ]
        )

    return run.finish(
        summary, step=len(history), files=[*files, path], table=table if verbose else None
    )
