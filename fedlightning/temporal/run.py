"""``fedlightning train experiment=bank_*``: protocol objects, then the bank, reused when built."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from fedlightning.config import build
from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import PRETRAIN, PREVAL
from fedlightning.data.temporal.protocol import TemporalProtocol, format_table, materialize
from fedlightning.errors import ConfigError, FedLightningError
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


def bank_config(cfg: DictConfig) -> BankConfig:
    """``cfg.bank`` as a :class:`BankConfig`, checked."""
    if "bank" not in cfg or "manifest" not in cfg.protocol:
        raise ConfigError(
            "task",
            f"task={cfg.task} needs a bank group and protocol=temporal (see conf/experiment)",
        )
    try:
        bank_cfg = BankConfig(**OmegaConf.to_container(cfg.bank, resolve=True))
    except TypeError as e:
        raise ConfigError("bank", str(e)) from None
    if bank_cfg.negatives not in ("filtered", "unfiltered"):
        raise ConfigError("bank.negatives", f"filtered or unfiltered, got {bank_cfg.negatives!r}")
    return bank_cfg


def temporal_setup(cfg: DictConfig, run_dir: Path):
    """The run directory, the stream, the bank config and the materialized protocol
    (written into the run directory), with every input checked before any training.

    Returns ``(cfg, run_dir, resuming, stream, bank_cfg, protocol, protocol_files)``.
    """
    from fedlightning.train import prepare_run_dir

    if not cfg.get("resume"):
        bank_config(cfg)  # checked before a run directory is made
    cfg, run_dir, resuming = prepare_run_dir(cfg, Path(run_dir))
    bank_cfg = bank_config(cfg)  # on resume, the saved run's bank, not this invocation's
    stream = build(cfg.dataset, "dataset")
    if not isinstance(stream, EventStream):
        raise ConfigError("dataset", f"{type(stream).__name__} is not a temporal event stream")
    params = OmegaConf.to_container(cfg.protocol, resolve=True)
    try:
        proto, _ = materialize(stream, params, Path(params["cache_dir"]))
    except ValueError as e:
        raise ConfigError("protocol", str(e)) from None
    saved = run_dir / "protocol.json"
    if resuming and saved.exists():
        before = json.loads(saved.read_text())["hashes"]
        if before != proto.hashes:
            raise FedLightningError(
                f"{saved}: the run was started with protocol hashes {before}, but the same "
                f"config now gives {proto.hashes} (data or code changed); refusing to resume"
            )
    files = proto.write(run_dir)
    log.info("%s\n%s", stream, format_table(proto.table()))
    return cfg, run_dir, resuming, stream, bank_cfg, proto, files


def train_bank(cfg: DictConfig, run_dir: Path, verbose: bool = True) -> dict[str, Any]:
    """Materialize the protocol, build (or reuse) the bank, write ``summary.json``."""
    from fedlightning.train import SUMMARY_FILE, make_tracker

    t0 = time.perf_counter()
    if cfg.get("resume"):
        raise ConfigError("resume", "bank runs restart from scratch (a built bank is reused)")
    cfg, run_dir, _, stream, bank_cfg, proto, files = temporal_setup(cfg, run_dir)
    params = OmegaConf.to_container(cfg.protocol, resolve=True)
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

    try:
        bank = ensure_bank(stream, proto, bank_cfg, int(cfg.seed), params["cache_dir"], tracker)
    except BaseException:
        tracker.end("FAILED")
        raise
    path, digest, metrics = bank["path"], bank["hash"], bank["metrics"]
    reused, history = bank["reused"], bank["history"]
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


def ensure_bank(
    stream: EventStream,
    proto: TemporalProtocol,
    bank_cfg: BankConfig,
    seed: int,
    cache_dir: str | Path,
    tracker: Any,
) -> dict[str, Any]:
    """The bank of (stream, manifest, bank config, seed): reused from the cache, or
    pre-trained (per-epoch metrics to ``tracker``), snapshotted and saved.

    Returns ``path``, ``hash``, ``metrics`` (pre-validation AUC/AP), ``history``, ``reused``.
    """
    key = content_hash(
        {
            "version": BANK_VERSION,
            "stream": stream.fingerprint,
            "manifest": proto.manifest.hash,
            "bank": bank_cfg.key(),
            "seed": seed,
        }
    )
    variant = bank_variant(bank_cfg)
    path = Path(cache_dir) / "banks" / f"{stream.name}-{bank_cfg.encoder}-{variant}-{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=False)
        log.info("bank %s reused", path)
        meta = saved["meta"]
        return dict(
            path=path, hash=saved["hash"], metrics=meta["metrics"], history=meta["history"],
            reused=True,
        )  # fmt: skip
    pre_idx, val_idx = proto.manifest.indices(PRETRAIN), proto.manifest.indices(PREVAL)
    enc, history = pretrain(
        stream,
        pre_idx,
        val_idx,
        bank_cfg,
        seed,
        on_epoch=lambda e, row: tracker.log_metrics({f"bank_{k}": v for k, v in row.items()}, e),
    )
    metrics, negatives = build_snapshot(enc, stream, pre_idx, val_idx, bank_cfg, seed)
    meta = {
        "encoder": bank_cfg.encoder,
        "config": bank_cfg.key(),
        "variant": variant,
        "stream": stream.fingerprint,
        "manifest": proto.manifest.hash,
        "metrics": metrics,
        "history": history,
    }
    digest = save_bank(path, bank_state(enc, negatives), meta)
    return dict(path=path, hash=digest, metrics=metrics, history=history, reused=False)
