"""``fedlightning train experiment=bank_*`` (``task=bank``): the protocol objects, then the
bank, reused when built, and its contexts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fedlightning.data.temporal.protocol import format_table
from fedlightning.errors import ConfigError
from fedlightning.programs import Program
from fedlightning.programs.temporal_setup import bank_variant, ensure_bank, temporal_setup
from fedlightning.runs import run_tags
from fedlightning.temporal.contexts import cached_contexts


class BankProgram(Program):
    """Materialize the protocol, build (or reuse) the bank, write ``summary.json``. The bank
    is pre-trained centrally, in one process: no runner (``observe`` sees nothing: there are
    no rounds)."""

    def check(self) -> None:
        target = str(OmegaConf.select(self.cfg, "runner._target_", default=""))
        if target.endswith(".DistributedRunner"):
            raise ConfigError(
                "runner",
                "runner=distributed does not support task=bank: the bank is pre-trained "
                "centrally, in one process; use runner=sequential",
            )
        if self.cfg.get("resume"):
            raise ConfigError("resume", "bank runs restart from scratch (a built bank is reused)")

    def make_runner(self, given: Any) -> None:
        return None

    def setup(self, cfg: DictConfig, run_dir: Path) -> tuple[Any, ...]:
        return temporal_setup(cfg, run_dir)

    def prepare(self) -> dict[str, str]:
        self.stream, self.bank_cfg, self.proto, self.files = self.made
        self.variant = bank_variant(self.bank_cfg)
        encoder = self.bank_cfg.encoder
        return run_tags(
            self.cfg,
            self.proto.hashes,
            method=encoder,
            dataset=self.stream.name,
            task="bank",
            variant=self.variant,
            backbone=encoder,
        )

    def work(self) -> None:
        cache_dir = OmegaConf.to_container(self.cfg.protocol, resolve=True)["cache_dir"]
        stream, proto = self.stream, self.proto
        self.bank = bank = ensure_bank(
            stream, proto, self.bank_cfg, int(self.cfg.seed), cache_dir, self.run.tracker
        )
        self.contexts = cached_contexts(bank["path"], bank["hash"], proto, cache_dir)

    def fields(self) -> dict[str, Any]:
        bank, proto, (ctx_path, ctx_hash, ctx_reused) = self.bank, self.proto, self.contexts
        metrics = bank["metrics"]
        return dict(
            metrics={"bank_val_auc": metrics["auc"], "bank_val_ap": metrics["ap"]},
            comm={"uplink_mib": 0.0, "downlink_mib": 0.0, "fields": {}},
            hashes={**proto.hashes, "bank": bank["hash"], "contexts": ctx_hash},
            contexts={"path": str(ctx_path), "reused": ctx_reused},
            bank={
                "path": str(bank["path"]),
                "reused": bank["reused"],
                "variant": self.variant,
                "history": bank["history"],
            },
            table=proto.table(),
            tasks=proto.tasks.stats(self.stream),
            collisions=proto.negatives["checks"],
            rounds=0,
        )

    def outputs(self) -> dict[str, Any]:
        bank, proto, encoder = self.bank, self.proto, self.bank_cfg.encoder
        path, digest, metrics = bank["path"], bank["hash"], bank["metrics"]
        self.run.tracker.set_tags({"hash_bank": digest})

        def table(summary: dict[str, Any]) -> str:
            return "\n".join(
                [
                    format_table(proto.table()),
                    f"bank             {encoder} ({self.variant})"
                    + (" reused" if bank["reused"] else "")
                    + f": {path}",
                    f"bank_val_auc     {metrics['auc']:.4f}\nbank_val_ap      {metrics['ap']:.4f}",
                    f"hash[bank]       {digest}\nwall time        {summary['wall_time_s']:.1f} s",
                ]
            )

        return dict(step=len(bank["history"]), files=[*self.files, path], table=table)


#: the name ``program._target_`` gives it (conf/program/bank.yaml, saved runs' configs)
train_bank = BankProgram
