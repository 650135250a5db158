"""``fedlightning train experiment=fedtip_*`` (``task=temporal``): protocol, bank, cached
contexts, then every task of the manifest (:class:`~fedlightning.federation.fedtip.TaskLoop`),
with MLflow logging, a checkpoint per task and ``summary.json``.

Under ``runner=distributed`` rank 0 alone makes the run directory, the protocol, the bank and
the contexts (in the cache), checkpoints, logs and writes; the other ranks get its results
(:meth:`~fedlightning.federation.world.World.on_main`) and read the cached files."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from fedlightning.algorithms.fedtip import FedTIP
from fedlightning.clients.fedtip import FAMILIES
from fedlightning.config import build
from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.protocol import TemporalProtocol
from fedlightning.errors import ConfigError
from fedlightning.federation.fedtip import TaskBatches, TaskLoop, as_single
from fedlightning.federation.fulltune import FullTuneLoop
from fedlightning.temporal.bank import bank_values
from fedlightning.temporal.contexts import cached_contexts, event_batch, load_bank
from fedlightning.temporal.encoders import time_encoder
from fedlightning.temporal.run import ensure_bank, temporal_setup
from fedlightning.tracking import NullTracker, flatten
from fedlightning.tracking.plots import plot_task_metrics
from fedlightning.utils.io import write_json

log = logging.getLogger(__name__)

LOG_EVERY = 10  # tasks per batch of MLflow metrics
PAPER_MESSAGE_VALUES = 1050  # paper 001, Sec. 5.4: 0.40 MiB over 5 clients x 20 rounds


def task_batches(
    contexts: dict[str, Any], proto: TemporalProtocol, te: torch.nn.Module, limit: int | None
) -> list[TaskBatches]:
    """Every task's client batches (at most ``limit`` tasks, in manifest order)."""
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


def make_algorithm(cfg: DictConfig) -> FedTIP:
    try:
        algorithm = build(cfg.algorithm, "algorithm")
    except ValueError as e:
        raise ConfigError("algorithm", str(e)) from None
    if not isinstance(algorithm, FedTIP):
        raise ConfigError(
            "algorithm",
            f"task=temporal needs a FedTIP algorithm (fedtip, prompt_fedavg, prompt_central, "
            f"fulltune_fedavg), got {type(algorithm).__name__}",
        )
    return algorithm


def check_families(families: Any, stream: EventStream | None) -> list[str]:
    """The task families to run; node classification needs the stream's state labels."""
    fams = list(families or [])
    bad = [f for f in fams if f not in FAMILIES]
    if not fams or bad:
        raise ConfigError("families", f"a non-empty list of {list(FAMILIES)}, got {fams}")
    if stream is not None and "nc" in fams and stream.label is None:
        raise ConfigError(
            "families", f"node classification needs state labels; {stream.name} has none"
        )
    return fams


def saved_state(path: Path) -> dict[str, Any] | None:
    """The loop state checkpointed at ``path``; ``None`` before a first task ended."""
    return torch.load(path, weights_only=False) if path.exists() else None


def format_temporal_summary(summary: dict[str, Any]) -> str:
    m, c = summary["metrics"], summary["comm"]
    rows: list[tuple[str, str]] = [("experiment", summary["experiment"])]
    rows.append(("tasks", f"{summary['tasks_done']} x {summary['rounds']} rounds"))
    for k in ("auc_nc", "auc_tlp", "auc_ilp", "val_auc_nc", "val_auc_tlp"):
        if k in m:
            rows.append((k, f"{m[k]:.4f} +- {m[k + '_std']:.4f}"))
    if "uplink_mib_per_task" in m:
        rows.append(("uplink per task", f"{m['uplink_mib_per_task']:.4f} MiB"))
    for fam, n in c["message_values"].items():
        rows.append((f"message [{fam}]", f"{n} float32 values (paper: ~{PAPER_MESSAGE_VALUES})"))
    from fedlightning.train import summary_table

    return summary_table(rows, summary)


def train_fedtip(
    cfg: DictConfig,
    run_dir: Path,
    observe: Callable[[str, int, dict[str, float]], None] | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Run FedTIP (or a comparator, or an ablation) over the task manifest."""
    from fedlightning.train import (
        CHECKPOINT_FILE,
        MLFLOW_RUN_FILE,
        SUMMARY_FILE,
        json_safe,
        make_tracker,
    )

    t0 = time.perf_counter()
    if not cfg.get("resume"):  # a bad value fails before a run directory exists
        make_algorithm(cfg)
        check_families(cfg.get("families"), None)
    runner = build(cfg.runner, "runner")  # a distributed runner joins its ranks here
    world = runner.world  # only rank 0 writes files; the others get its results
    setup = world.on_main(temporal_setup, cfg, run_dir)
    cfg, run_dir, resuming, stream, bank_cfg, proto, files = setup
    world.run_dir = run_dir
    algorithm = make_algorithm(cfg)  # a resumed run's own config
    families = check_families(cfg.get("families"), stream)
    limit = cfg.get("max_tasks")
    cache_dir = OmegaConf.to_container(cfg.protocol, resolve=True)["cache_dir"]

    variant = algorithm.variant(bank_cfg.pretrained, bank_cfg.negatives == "filtered")
    tags = {
        "method": algorithm.name,
        "dataset": stream.name,
        "task": "temporal",
        "variant": variant,
        "backbone": bank_cfg.encoder,
        "seed": str(cfg.seed),
        "experiment": str(cfg.name),
        **{f"hash_{k}": v for k, v in proto.hashes.items()},
    }
    tracker = make_tracker(cfg) if world.is_main else NullTracker()
    run_id = None
    if world.is_main and resuming and (run_dir / MLFLOW_RUN_FILE).exists():
        run_id = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())["run_id"]
    parent = cfg.logger.get("parent_run_id")
    mlflow_tags = {**tags, "mlflow.parentRunId": str(parent)} if parent else tags
    params = flatten(OmegaConf.to_container(cfg, resolve=True))
    run_id = tracker.start(f"{cfg.name}-{run_dir.name}", mlflow_tags, params, run_id=run_id)
    if run_id:
        write_json(
            run_dir / MLFLOW_RUN_FILE, {"run_id": run_id, "tracking_uri": cfg.logger.tracking_uri}
        )
    try:
        bank = world.on_main(
            ensure_bank, stream, proto, bank_cfg, int(cfg.seed), cache_dir, tracker
        )
        train_mode = "unfiltered" if algorithm.negatives == "unfiltered" else None
        ctx_path, ctx_hash, _ = world.on_main(
            cached_contexts, bank["path"], bank["hash"], proto, cache_dir, train_mode
        )
        contexts = torch.load(ctx_path, weights_only=False)
        enc = load_bank(bank["path"], stream)
        te = time_encoder(enc)
        tasks = task_batches(contexts, proto, te, limit)
        evals = eval_batches(contexts, proto, te)
        d_e = 0 if stream.msg is None else stream.msg.shape[1]
        dims = (enc.out_dim, te.out_channels, d_e)
        pending: list[tuple[int, dict[str, float]]] = []

        def on_task_end(n: int, metrics: dict[str, float]) -> None:
            pending.append((n, {k: v for k, v in metrics.items() if k != "task"}))
            if len(pending) >= LOG_EVERY or n == len(tasks):
                tracker.log_metric_rows(pending)
                pending.clear()
            if observe is not None:
                observe("task", n, loop.final_metrics())

        common = dict(
            rounds=int(cfg.federation.rounds),
            epochs=int(cfg.federation.local_epochs),
            seed=int(cfg.seed),
            bank_values=bank_values(bank["path"]),
            checkpoint_path=run_dir / CHECKPOINT_FILE if world.is_main else None,
            on_task_end=on_task_end,
            progress=bool(cfg.runner.get("progress", True)) and world.is_main,
        )
        args = (algorithm, tasks, evals, families, dims, runner)
        if algorithm.mode == "fulltune":
            loop = FullTuneLoop(*args, snapshot=enc, protocol=proto, **common)
        else:
            loop = TaskLoop(*args, **common)
        state = world.on_main(saved_state, run_dir / CHECKPOINT_FILE) if resuming else None
        if state is not None:
            loop.load_state_dict(state)
            log.info("resuming %s after task %d", run_dir, len(loop.results))
        results = loop.run()
    except BaseException as e:
        tracker.end("KILLED" if type(e).__name__ == "RunStopped" else "FAILED")
        raise
    metrics = loop.final_metrics()
    adapter = algorithm.adapter(*dims)
    summary = json_safe(
        {
            "experiment": str(cfg.name),
            "seed": int(cfg.seed),
            "rounds": int(cfg.federation.rounds),
            "tasks_done": len(results),
            "families": families,
            "metrics": metrics,
            "comm": {
                **loop.comm(),
                "adapter_values": adapter.num_values(),
                "message_values_by_hand": {f: algorithm.message_size(adapter, f) for f in families},
                "paper_message_values": PAPER_MESSAGE_VALUES,
            },
            "hashes": {**proto.hashes, "bank": bank["hash"], "contexts": ctx_hash},
            "bank": {"path": str(bank["path"]), "reused": bank["reused"], **bank["metrics"]},
            "table": proto.table(),
            "wall_time_s": time.perf_counter() - t0,
            "run_dir": str(run_dir),
            "tags": tags,
            "resumed": resuming,
        }
    )
    if not world.is_main:  # the same state on every rank; rank 0 writes and logs it
        return summary
    write_json(run_dir / "task_metrics.json", json_safe(results))
    write_json(run_dir / SUMMARY_FILE, summary)
    tracker.log_metrics({f"final_{k}": v for k, v in metrics.items()}, step=len(results))
    tracker.set_tags({"hash_bank": bank["hash"], "hash_contexts": ctx_hash})
    plot = plot_task_metrics(results, run_dir / "task_auc.png", f"{cfg.name} ({variant})")
    tracker.log_artifacts(
        [
            *files,
            run_dir / SUMMARY_FILE,
            run_dir / "task_metrics.json",
            run_dir / "config.yaml",
            plot,
        ]
    )
    tracker.end("FINISHED")
    if verbose:
        print(format_temporal_summary(summary), flush=True)
    return summary
