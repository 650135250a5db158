"""``fedlightning train`` for ``task=temporal`` (FedTIP and its comparators; docs/fedtip.md):
protocol, bank, cached contexts, then every task of the manifest
(:class:`~fedlightning.federation.task_loop.TaskLoop`). Under ``runner=distributed`` rank 0 alone
writes; the other ranks get its results (:meth:`~fedlightning.federation.world.World.on_main`)
and read the cache."""

from __future__ import annotations

import logging
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from fedlightning.clients.temporal_prompt import FAMILIES, as_single
from fedlightning.config import build, build_stream, plots_on
from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.noise import noise_settings
from fedlightning.data.temporal.protocol import TemporalProtocol, materialize
from fedlightning.errors import ConfigError, FedLightningError
from fedlightning.federation.task_loop import TaskBatches, TaskLoop
from fedlightning.federation.task_pool import resolve_workers
from fedlightning.federation.world import World
from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.methods.temporal_base.temporal_base import TemporalMethod
from fedlightning.programs import Program, metric_text, secure_on
from fedlightning.programs.temporal_setup import bank_config, ensure_bank, temporal_setup
from fedlightning.runs import (
    CHECKPOINT_FILE,
    load_checkpoint,
    resume_loop,
    run_tags,
    summary_table,
)
from fedlightning.server.robust import robust_setting
from fedlightning.temporal.contexts import cached_contexts, event_batch, load_bank
from fedlightning.temporal.encoders import time_encoder
from fedlightning.tracking import NullTracker

log = logging.getLogger(__name__)

AUTO = "auto"  # families: every family the stream supports
LOG_EVERY = 10  # tasks per batch of MLflow metrics
PAPER_MESSAGE_VALUES = 1050  # paper 001, Sec. 5.4: 0.40 MiB over 5 clients x 20 rounds


def task_batches(
    contexts: dict[str, Any], proto: TemporalProtocol, te: torch.nn.Module, limit: int | None
) -> list[TaskBatches]:
    """Every task's client batches (at most ``limit`` tasks, in manifest order), with the
    unreliable clients' flipped state labels when ``protocol.noise`` is on."""
    mode, stream = contexts["mode"], proto.stream
    out = []
    for task in proto.tasks.tasks[:limit]:
        negs = dict(
            zip(task.events.tolist(), proto.negatives["tasks"][mode][str(task.task)], strict=True)
        )
        clients = {}
        for k in task.clients:
            ctx = contexts["tasks"][task.task][k]
            j = np.array([negs[e] for e in ctx["events"].tolist()], dtype=np.int64)
            clients[k] = event_batch(ctx, stream, te, j)
            if proto.noise is not None:
                y = proto.noise.labels(stream.label, ctx["events"].numpy())
                clients[k]["y"] = torch.from_numpy(y)
        out.append(TaskBatches(task.task, clients))
    return out


def eval_batches(
    contexts: dict[str, Any], proto: TemporalProtocol, te: torch.nn.Module
) -> dict[str, dict[str, torch.Tensor]]:
    """The server's validation and test segments (test with its inductive flags)."""
    neg = proto.negatives["eval"]
    val = event_batch(contexts["down_val"], proto.stream, te, np.array(neg["down_val"]))
    test = event_batch(
        contexts["test"], proto.stream, te, np.array(neg["test"]), proto.manifest.inductive
    )
    return {"val": as_single(val), "test": as_single(test)}


def saved_settings(node: DictConfig) -> DictConfig:
    """A resumed run's ``algorithm`` less the keys its class does not declare that are
    FedTIP's: a baseline's config saved while every temporal config composed fedtip.yaml
    carries FedTIP's settings, which the baseline never read."""
    try:
        target = get_class(str(node.get("_target_", "")))
    except Exception:  # a bad _target_: build names it
        return node
    if not is_dataclass(target) or issubclass(target, FedTIP):
        return node
    legacy = {f.name for f in fields(FedTIP)} - {f.name for f in fields(target)}
    kept = OmegaConf.to_container(node, resolve=True)
    return OmegaConf.create({k: v for k, v in kept.items() if k not in legacy})


def make_algorithm(cfg: DictConfig) -> TemporalMethod:
    """The run's temporal method (:class:`TemporalMethod`), told the run's secure-sum and
    robust-aggregation settings; one line refusing any other algorithm."""
    node = cfg.algorithm
    try:
        if cfg.get("resume"):
            node = saved_settings(node)
        algorithm = build(node, "algorithm")
    except ValueError as e:
        raise ConfigError("algorithm", str(e)) from None
    if not isinstance(algorithm, TemporalMethod):
        got = type(algorithm).__name__
        if "_target_" not in node:  # conf/algorithm/temporal_base.yaml: shared settings
            got = "only the settings temporal methods share (no _target_)"
        raise ConfigError(
            "algorithm",
            f"task=temporal needs a temporal method (fedtip, its comparators and baselines: "
            f"docs/fedtip.md), got {got}",
        )
    flower = "flower" in str(cfg.runner.get("_target_", ""))
    if flower and not algorithm.flower_nodes:  # docs/fedtip.md
        raise ConfigError(
            "runner",
            f"runner=flower cannot run {algorithm.name} (its nodes hold neither its history "
            "view nor its one-off exchange): use runner=sequential or runner=distributed",
        )
    secure = secure_on(cfg, flower)
    if secure:
        bound = cfg.algorithm.get("max_update_norm")
        algorithm.use_secure_sum(int(cfg.seed), None if bound is None else float(bound))
    # docs/security.md: every task's server aggregates by the rule (None: the method's own)
    algorithm.task_robust = robust_setting(cfg.federation.get("robust"), True, secure, True)
    return algorithm


def check_families(families: Any, stream: EventStream | None) -> list[str]:
    """The task families to run: a non-empty list of :data:`FAMILIES`, or ``auto``: every
    family ``stream`` supports (``nc`` only if :attr:`EventStream.has_labels`), logged; every
    family before the stream is read (``stream=None``). A :class:`ConfigError` naming
    ``families`` for a bad value or ``nc`` on a stream without usable labels."""
    if isinstance(families, str) and families == AUTO:
        if stream is None:
            return list(FAMILIES)
        fams = [f for f in FAMILIES if f != "nc" or stream.has_labels]
        why = "state labels 0/1" if stream.has_labels else "no usable state labels"
        log.info("families=auto: %s on %s (%s)", ",".join(fams), stream.name, why)
        return fams
    fams = [] if isinstance(families, str) else list(families or [])
    if not fams or any(f not in FAMILIES for f in fams):
        raise ConfigError(
            "families", f"`{AUTO}` or a non-empty list of {list(FAMILIES)}, got {families!r}"
        )
    if stream is not None and "nc" in fams and not stream.has_labels:
        has = "none" if stream.label is None else "one value only"
        raise ConfigError(
            "families",
            f"node classification needs state labels 0 and 1; {stream.name} has {has}: use "
            f"families=[lp] or families={AUTO}",
        )
    return fams


def check_noise(protocol: Any, families: list[str]) -> None:
    """``protocol.noise`` flips state labels, which node classification alone trains on: a
    :class:`ConfigError` for a bad value (naming ``protocol.noise``) or for noise on with any
    family but ``nc`` (naming ``families``)."""
    try:
        on = noise_settings(protocol.get("noise")) is not None
    except ValueError as e:
        raise ConfigError("protocol.noise", str(e)) from None
    if on and families != ["nc"]:
        raise ConfigError(
            "families",
            f"protocol.noise flips state labels, which only node classification trains on "
            f"(link prediction has no label to flip): use families=[nc], got {families}",
        )


def saved_state(path: Path, identity: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The loop state checkpointed at ``path`` (``None`` before a first task ended); one
    line refusing a checkpoint of format 1 or (given ``identity``) of another run."""
    if not path.exists():
        return None
    state = load_checkpoint(path, identity)
    if "ledger" not in state:
        raise FedLightningError(
            f"{path}: written before FedTIP kept one ledger per run (checkpoint format 1); "
            "it cannot resume: start a new run"
        )
    return state


def format_temporal_summary(summary: dict[str, Any]) -> str:
    m, c = summary["metrics"], summary["comm"]
    rows: list[tuple[str, str]] = [("experiment", summary["experiment"])]
    rows.append(("tasks", f"{summary['tasks_done']} x {summary['rounds']} rounds"))
    for k in ("auc_nc", "auc_tlp", "auc_ilp", "val_auc_nc", "val_auc_tlp"):
        if k in m:
            rows.append((k, f"{metric_text(m[k])} +- {metric_text(m.get(k + '_std'))}"))
    if "uplink_mib_per_task" in m:
        rows.append(("uplink per task", f"{m['uplink_mib_per_task']:.4f} MiB"))
    if "recurrent_downlink_mib_per_task" in c and "uplink_mib_per_task" in m:
        rows.append(
            ("down per task", f"{c['recurrent_downlink_mib_per_task']:.4f} MiB (bank aside)")
        )
    for fam, n in c.get("message_values", {}).items():
        rows.append((f"message [{fam}]", f"{n} float32 values (paper: ~{PAPER_MESSAGE_VALUES})"))
    if "noise" in summary:
        z = summary["noise"]
        rows.append(("unreliable", f"clients {z['unreliable_clients']}, flipped "
                     f"{z['flipped_support_events']}/{z['unreliable_support_events']} support labels"))  # fmt: skip
    return summary_table(rows, summary)


def contexts_of(
    cfg: DictConfig, stream: EventStream, proto: TemporalProtocol, bank: dict[str, Any], world: Any
) -> dict[str, Any]:
    """What the task loop reads, from the bank's cached contexts: every task's client
    batches, the server's segments, the bank's encoder and the adapter's dims."""
    algorithm = make_algorithm(cfg)
    cache_dir = OmegaConf.to_container(cfg.protocol, resolve=True)["cache_dir"]
    train_mode = "unfiltered" if algorithm.negatives == "unfiltered" else None
    ctx_path, ctx_hash, _ = world.on_main(
        cached_contexts, bank["path"], bank["hash"], proto, cache_dir, train_mode,
        cfg.get("max_tasks"),
    )  # fmt: skip
    contexts = torch.load(ctx_path, weights_only=False)
    enc = load_bank(bank["path"], stream)
    te = time_encoder(enc)
    d_e = 0 if stream.msg is None else stream.msg.shape[1]
    return {
        "tasks": task_batches(contexts, proto, te, cfg.get("max_tasks")),
        "evals": eval_batches(contexts, proto, te),
        "encoder": enc,
        "protocol": proto,
        "dims": (enc.out_dim, te.out_channels, d_e),
        "hashes": {**proto.hashes, "bank": bank["hash"], "contexts": ctx_hash},
    }


def temporal_inputs(cfg: DictConfig) -> dict[str, Any]:
    """A Flower node's :func:`contexts_of` from its own copy of the stream: the protocol,
    bank and contexts are materialized (or reused from its cache) as the server's were."""
    stream = build_stream(cfg)
    params = OmegaConf.to_container(cfg.protocol, resolve=True)
    proto, _ = materialize(stream, params, Path(params["cache_dir"]))
    bank = ensure_bank(
        stream, proto, bank_config(cfg), int(cfg.seed), params["cache_dir"], NullTracker()
    )
    return contexts_of(cfg, stream, proto, bank, World())


class TemporalProgram(Program):
    """``task=temporal``: FedTIP (or a comparator, or an ablation) over the task manifest;
    ``observe`` sees ``"task"`` metrics."""

    poolable = True

    def check(self) -> None:
        if not self.cfg.get("resume"):  # a bad value fails before a run directory exists
            self.poolable = make_algorithm(self.cfg).pool_tasks
            check_noise(self.cfg.protocol, check_families(self.cfg.get("families"), None))

    def make_runner(self, given: Any) -> Any:
        runner = super().make_runner(given)
        resolve_workers(self.cfg.get("task_workers"), 1, runner, self.poolable)  # before training
        return runner

    def setup(self, cfg: DictConfig, run_dir: Path) -> tuple[Any, ...]:
        return temporal_setup(cfg, run_dir)

    def prepare(self) -> dict[str, str]:
        cfg = self.cfg
        self.stream, self.bank_cfg, self.proto, self.files = self.made
        self.algorithm = algorithm = make_algorithm(cfg)  # a resumed run's own config
        self.families = check_families(cfg.get("families"), self.stream)
        check_noise(cfg.protocol, self.families)
        pretrained, filtered = self.bank_cfg.pretrained, self.bank_cfg.negatives == "filtered"
        self.variant = algorithm.variant(pretrained, filtered)
        return run_tags(
            cfg,
            self.proto.hashes,
            method=algorithm.name,
            dataset=self.stream.name,
            task="temporal",
            families=",".join(self.families),
            variant=self.variant,
            backbone=self.bank_cfg.encoder,
        )

    def work(self) -> None:
        cfg, runner, algorithm, run = self.cfg, self.runner, self.algorithm, self.run
        world, stream, proto, run_dir = runner.world, self.stream, self.proto, self.run_dir
        cache_dir = OmegaConf.to_container(cfg.protocol, resolve=True)["cache_dir"]
        self.bank = bank = world.on_main(
            ensure_bank, stream, proto, self.bank_cfg, int(cfg.seed), cache_dir, run.tracker
        )
        inputs = contexts_of(cfg, stream, proto, bank, world)
        tasks, evals, enc, dims = (inputs[k] for k in ("tasks", "evals", "encoder", "dims"))
        hashes = inputs["hashes"]
        hashes.update(algorithm.attach(enc, proto) or {})  # a baseline's history graph
        # a comparator's graph view of the history, hashed
        self.hashes = hashes = {**hashes, **algorithm.materialize_views(cache_dir)}
        self.dims = dims
        runner.begin(cfg, run_dir, hashes)
        pending: list[tuple[int, dict[str, float]]] = []

        def on_task_end(n: int, metrics: dict[str, float]) -> None:
            pending.append((n, {k: v for k, v in metrics.items() if k != "task"}))
            if len(pending) >= LOG_EVERY or n == len(tasks):
                run.tracker.log_metric_rows(pending)
                pending.clear()
            if self.observe is not None:
                self.observe("task", n, loop.final_metrics())

        self.loop = loop = TaskLoop(
            algorithm,
            tasks,
            evals,
            self.families,
            dims,
            runner,
            rounds=int(cfg.federation.rounds),
            epochs=int(cfg.federation.local_epochs),
            seed=int(cfg.seed),
            bank_values=bank["values"],
            checkpoint_path=run_dir / CHECKPOINT_FILE if world.is_main else None,
            on_task_end=on_task_end,
            progress=world.is_main,  # the bar over tasks (runner.progress: the per-round bars)
            workers=resolve_workers(
                cfg.get("task_workers"), len(tasks), runner, algorithm.pool_tasks
            ),
            min_clients=cfg.federation.get("min_clients", 1),
        )
        if resume_loop(loop, world, cfg, run_dir, hashes, self.resuming, saved_state):
            log.info("resuming %s after task %d", run_dir, len(loop.results))
        self.results = loop.run()

    def fields(self) -> dict[str, Any]:
        cfg, algorithm, loop, families = self.cfg, self.algorithm, self.loop, self.families
        metrics = loop.final_metrics()
        privacy = algorithm.privacy_budget(len(self.results), int(cfg.federation.rounds), families)
        if algorithm.release.on:
            metrics["dp_epsilon"] = privacy["epsilon"]
        adapter = algorithm.adapter(*self.dims)
        proto, bank = self.proto, self.bank
        return dict(
            rounds=int(cfg.federation.rounds),
            tasks_done=len(self.results),
            families=families,
            metrics=metrics,
            timing=loop.timing(),
            comm={
                **loop.comm(),
                "adapter_values": adapter.num_values(),
                "message_values_by_hand": {f: algorithm.message_size(adapter, f) for f in families},
                "paper_message_values": PAPER_MESSAGE_VALUES,
            },
            hashes=self.hashes,
            bank={"path": str(bank["path"]), "reused": bank["reused"], **bank["metrics"]},
            table=proto.table(),
            privacy=privacy,
            resumed=self.resuming,
            **({} if proto.noise is None else {"noise": proto.noise.stats(proto.tasks)}),
        )

    def outputs(self) -> dict[str, Any]:
        plots, world, hashes = [], self.runner.world, self.hashes
        if world.is_main:
            self.run.tracker.set_tags(
                {"hash_bank": hashes["bank"], "hash_contexts": hashes["contexts"]}
            )
        if world.is_main and plots_on(self.cfg):
            from fedlightning.tracking.plots import plot_task_metrics

            title = f"{self.cfg.name} ({self.variant})"
            plots = [plot_task_metrics(self.results, self.run_dir / "task_auc.png", title)]
        return dict(
            step=len(self.results),
            files=[*self.files, *plots],
            table=format_temporal_summary,
            extra={"task_metrics.json": self.results},
        )


#: the name ``program._target_`` gives it (conf/program/temporal.yaml, saved runs' configs)
train_temporal = TemporalProgram
