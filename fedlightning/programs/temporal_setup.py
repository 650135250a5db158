"""What a temporal run needs before it trains: its checked bank config, the stream and the
materialized protocol in the run directory (:func:`temporal_setup`), and the bank, reused
from the cache when built (:func:`ensure_bank`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedlightning.config import build_stream
from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import PRETRAIN, PREVAL
from fedlightning.data.temporal.protocol import TemporalProtocol, format_table, materialize_checked
from fedlightning.errors import ConfigError
from fedlightning.runs import check_protocol, prepare_run_dir
from fedlightning.temporal.bank import (
    BANK_VERSION,
    BankConfig,
    bank_state,
    build_snapshot,
    pretrain,
    save_bank,
)
from fedlightning.temporal.contexts import bank_size, read_bank, tensor_values
from fedlightning.utils.io import build_once, content_hash

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
    """``(cfg, run_dir, resuming, stream, bank_cfg, protocol, protocol_files)``, the protocol
    materialized into the run directory, every input checked before any training."""
    if not cfg.get("resume"):
        bank_config(cfg)  # checked before a run directory is made
    cfg, run_dir, resuming = prepare_run_dir(cfg, Path(run_dir))
    bank_cfg = bank_config(cfg)  # on resume, the saved run's bank, not this invocation's
    stream = build_stream(cfg)
    _, proto, _ = materialize_checked(stream, cfg.protocol)
    if resuming and (run_dir / "protocol.json").exists():
        check_protocol(run_dir / "protocol.json", "hashes", proto.hashes)
    files = proto.write(run_dir)
    log.info("%s\n%s", stream, format_table(proto.table()))
    return cfg, run_dir, resuming, stream, bank_cfg, proto, files


def ensure_bank(
    stream: EventStream,
    proto: TemporalProtocol,
    bank_cfg: BankConfig,
    seed: int,
    cache_dir: str | Path,
    tracker: Any,
) -> dict[str, Any]:
    r"""The bank of (stream, manifest, bank config, seed), reused from the cache or pre-trained
    (per-epoch metrics to ``tracker``), snapshotted and saved: its ``path``, ``hash``,
    ``metrics`` (pre-validation AUC/AP), ``history``, whether it was ``reused`` and its
    ``values`` :math:`|\mathcal{B}_0|` (the file is read once: :func:`read_bank`)."""
    ident = {"stream": stream.fingerprint, "manifest": proto.manifest.hash}
    key = content_hash({"version": BANK_VERSION, **ident, "bank": bank_cfg.key(), "seed": seed})
    variant = bank_variant(bank_cfg)
    path = Path(cache_dir) / "banks" / f"{stream.name}-{bank_cfg.encoder}-{variant}-{key}.pt"
    built: dict[str, Any] = {}

    def build() -> None:
        pre_idx, val_idx = proto.manifest.indices(PRETRAIN), proto.manifest.indices(PREVAL)
        t0 = time.perf_counter()
        log.info(
            "bank %s not in the cache: pre-training it (%d + %d events)",
            path,
            len(pre_idx),
            len(val_idx),
        )
        enc, history = pretrain(
            stream,
            pre_idx,
            val_idx,
            bank_cfg,
            seed,
            on_epoch=lambda e, row: tracker.log_metrics(
                {f"bank_{k}": v for k, v in row.items()}, e
            ),
        )
        metrics, negatives = build_snapshot(enc, stream, pre_idx, val_idx, bank_cfg, seed)
        meta = {
            "encoder": bank_cfg.encoder,
            "config": bank_cfg.key(),
            "variant": variant,
            **ident,
            "metrics": metrics,
            "history": history,
        }
        state = bank_state(enc, negatives)
        digest = save_bank(path, state, meta)
        log.info(
            "bank built in %.1fs: pre-validation auc %.4f  ap %.4f",
            time.perf_counter() - t0,
            metrics["auc"],
            metrics["ap"],
        )
        built.update(
            path=path, hash=digest, metrics=metrics, history=history, reused=False,
            values=tensor_values(state),
        )  # fmt: skip

    if not build_once(path, build):
        return built
    saved = read_bank(path)  # read once: the run's encoder comes from the same read
    log.info("bank %s reused", path)
    meta = saved["meta"]
    return dict(
        path=path, hash=saved["hash"], metrics=meta["metrics"], history=meta["history"],
        reused=True, values=bank_size(path),
    )  # fmt: skip
