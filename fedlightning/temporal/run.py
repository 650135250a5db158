"""``fedlightning train experiment=bank_*``: protocol objects, then the bank, reused when built."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from fedlightning.config import build
from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import PRETRAIN, PREVAL
from fedlightning.data.temporal.protocol import format_table, materialize
from fedlightning.errors import ConfigError
from fedlightning.temporal.bank import (
    BANK_VERSION,
    BankConfig,
    bank_state,
    build_snapshot,
    pretrain,
    save_bank,
)
from fedlightning.temporal.contexts import cached_contexts
from fedlightning.tracking import flatten
from fedlightning.utils.io import content_hash, write_json

log = logging.getLogger(__name__)


def bank_variant(cfg: BankConfig) -> str:
    if not cfg.pretrained:
        return "untrained"
    return "unfiltered" if cfg.negatives == "unfiltered" else "full"


def train_bank(cfg: DictConfig, run_dir: Path, verbose: bool = True) -> dict[str, Any]:
    """Materialize the protocol, build (or reuse) the bank, write ``summary.json``."""
    from fedlightning.train import SUMMARY_FILE, make_tracker, prepare_run_dir

    t0 = time.perf_counter()
    if cfg.get("resume"):
        raise ConfigError("resume", "bank runs restart from scratch (a built bank is reused)")
    if "bank" not in cfg or "manifest" not in cfg.protocol:
        raise ConfigError("task", "task=bank needs a bank group and protocol=temporal")
    cfg, run_dir, _ = prepare_run_dir(cfg, Path(run_dir))
    stream = build(cfg.dataset, "dataset")
    if not isinstance(stream, EventStream):
        raise ConfigError("dataset", f"{type(stream).__name__} is not a temporal event stream")
    params = OmegaConf.to_container(cfg.protocol, resolve=True)
    try:
        bank_cfg = BankConfig(**OmegaConf.to_container(cfg.bank, resolve=True))
    except TypeError as e:
        raise ConfigError("bank", str(e)) from None
    if bank_cfg.negatives not in ("filtered", "unfiltered"):
        raise ConfigError("bank.negatives", f"filtered or unfiltered, got {bank_cfg.negatives!r}")
    try:
        proto, _ = materialize(stream, params, Path(params["cache_dir"]))
    except ValueError as e:
        raise ConfigError("protocol", str(e)) from None
    files = proto.write(run_dir)
    log.info("%s\n%s", stream, format_table(proto.table()))

    tracker = make_tracker(cfg)
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
    tracker.start(
        f"{cfg.name}-{run_dir.name}", tags, flatten(OmegaConf.to_container(cfg, resolve=True))
    )

    key = content_hash(
        {
            "version": BANK_VERSION,
            "stream": stream.fingerprint,
            "manifest": proto.manifest.hash,
            "bank": bank_cfg.key(),
            "seed": int(cfg.seed),
        }
    )
    path = (
        Path(params["cache_dir"]) / "banks" / f"{stream.name}-{bank_cfg.encoder}-{variant}-{key}.pt"
    )
    pre_idx, val_idx = proto.manifest.indices(PRETRAIN), proto.manifest.indices(PREVAL)
    history: list[dict[str, float]] = []
    if path.exists():
        saved = torch.load(path, weights_only=False)
        metrics, digest, reused = saved["meta"]["metrics"], saved["hash"], True
        history = saved["meta"]["history"]
        log.info("bank %s reused", path)
    else:
        try:
            enc, history = pretrain(
                stream,
                pre_idx,
                val_idx,
                bank_cfg,
                int(cfg.seed),
                on_epoch=lambda e, row: tracker.log_metrics(
                    {f"bank_{k}": v for k, v in row.items()}, step=e
                ),
            )
            metrics, negatives = build_snapshot(
                enc, stream, pre_idx, val_idx, bank_cfg, int(cfg.seed)
            )
        except BaseException:
            tracker.end("FAILED")
            raise
        meta = {
            "encoder": bank_cfg.encoder,
            "config": bank_cfg.key(),
            "variant": variant,
            "stream": stream.fingerprint,
            "manifest": proto.manifest.hash,
            "metrics": metrics,
            "history": history,
        }
        digest, reused = save_bank(path, bank_state(enc, negatives), meta), False
    ctx_path, ctx_hash, ctx_reused = cached_contexts(path, digest, proto, params["cache_dir"])
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
    write_json(run_dir / SUMMARY_FILE, summary)
    tracker.log_metrics({f"final_{k}": v for k, v in summary["metrics"].items()}, step=len(history))
    tracker.set_tags({"hash_bank": digest})
    tracker.log_artifacts([*files, run_dir / SUMMARY_FILE, run_dir / "config.yaml", path])
    tracker.end()
    if verbose:
        print(format_table(proto.table()))
        print(
            f"bank             {bank_cfg.encoder} ({variant}){' reused' if reused else ''}: {path}"
        )
        print(f"bank_val_auc     {metrics['auc']:.4f}\nbank_val_ap      {metrics['ap']:.4f}")
        print(f"hash[bank]       {digest}\nwall time        {summary['wall_time_s']:.1f} s")
    return summary
