"""One federated experiment, from a composed config to ``summary.json`` and an MLflow run."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch_geometric.data import Data

from fedlightning.algorithms.base import FederatedClient
from fedlightning.config import build, validate
from fedlightning.data.graphs.base import MultimodalGraph, apply_missing
from fedlightning.data.partition import TEST, TRAIN, VAL, Partition
from fedlightning.data.streams import ClassStream
from fedlightning.errors import ConfigError, FedLightningError, RunStopped
from fedlightning.federation.continual import ContinualLoop
from fedlightning.federation.loop import FederatedLoop
from fedlightning.tracking import MlflowTracker, NullTracker, flatten
from fedlightning.utils.io import write_json
from fedlightning.utils.seeding import derive_seed, seed_everything

log = logging.getLogger("fedlightning")

CONFIG_FILE, CHECKPOINT_FILE, SUMMARY_FILE = "config.yaml", "checkpoint.pt", "summary.json"
MLFLOW_RUN_FILE = "mlflow_run.json"


def build_client(graph: MultimodalGraph, partition: Partition, k: int) -> FederatedClient:
    """Client ``k``: its induced subgraph with its train/val/test masks."""
    nodes = partition.client_nodes(k)
    data: Data = graph.subgraph(nodes).to_data()
    split = partition.split[nodes]
    data.train_mask, data.val_mask, data.test_mask = split == TRAIN, split == VAL, split == TEST
    data.node_id = nodes  # index in the whole graph, for per-node artifacts
    return FederatedClient(k, data)


def build_clients(graph: MultimodalGraph, partition: Partition) -> list[FederatedClient]:
    """Every client's induced subgraph with its train/val/test masks."""
    return [build_client(graph, partition, k) for k in range(partition.num_clients)]


def build_model(cfg: DictConfig, in_dims: dict[str, int], num_classes: int) -> tuple[Any, Any, Any]:
    """``(net, algorithm, client module)``; the net's initial weights are seeded by
    ``(seed, "init")``, so every process that builds them gets the same."""
    torch.manual_seed(derive_seed(cfg.seed, "init"))
    net = build(cfg.model.net, "model.net")(in_dims=in_dims, num_classes=num_classes)
    optimizer = build(cfg.model.optimizer, "model.optimizer")
    algorithm = build(cfg.algorithm, "algorithm")
    return net, algorithm, algorithm.client_module(net, optimizer)


def load_graph(cfg: DictConfig) -> MultimodalGraph:
    """Build the dataset; ``dataset.missing_rate`` (if set) hides modalities, seeded by
    ``protocol.seed``. The mask reaches the model, whose fusion ignores what is missing."""
    node = OmegaConf.to_container(cfg.dataset, resolve=True)
    rate = node.pop("missing_rate", 0.0)
    graph = build(OmegaConf.create(node), "dataset")
    if rate:
        if isinstance(rate, dict):
            unknown = set(rate) - set(graph.modalities)
            if unknown:
                raise ConfigError(
                    "dataset.missing_rate",
                    f"unknown modalities {sorted(unknown)}; {graph.name!r} has {graph.modalities}",
                )
        bad = [r for r in (rate.values() if isinstance(rate, dict) else [rate]) if not 0 <= r < 1]
        if bad:
            raise ConfigError("dataset.missing_rate", f"rates must lie in [0, 1), got {rate}")
        graph = apply_missing(graph, rate, derive_seed(cfg.protocol.seed, "missing"))
    return graph


def save_protocol(obj: Any, path: Path, resuming: bool) -> None:
    """Save a protocol object; on resume, refuse if it no longer matches the saved one."""
    if resuming and path.exists():
        saved = json.loads(path.read_text()).get("hash")
        if saved != obj.hash:
            raise FedLightningError(
                f"{path}: the run was started with protocol hash {saved}, "
                f"but the same config now gives {obj.hash} (data or code "
                "changed); refusing to resume"
            )
        return
    obj.save(path)


def json_safe(obj: Any) -> Any:
    """Non-finite floats as null, so summary.json and history.json stay strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def check_algorithm_fits_protocol(algorithm: Any, stream: ClassStream | None) -> None:
    continual = hasattr(algorithm, "setup")
    if stream is not None and not continual:
        raise ConfigError(
            "algorithm",
            f"{algorithm.name!r} is not a class-incremental algorithm; "
            "with protocol=cil use algorithm=cil_* (e.g. cil_fedavg_replay)",
        )
    if stream is None and continual:
        raise ConfigError(
            "protocol",
            f"algorithm {algorithm.name!r} needs the class-incremental stream: add protocol=cil",
        )


def trained_config(cfg: DictConfig) -> DictConfig:
    """The config the run trains: ``cfg``, or on ``resume=DIR`` the saved run's."""
    saved = Path(str(cfg.get("resume") or "")) / CONFIG_FILE
    return OmegaConf.load(saved) if cfg.get("resume") and saved.is_file() else cfg


def run_task(cfg: DictConfig) -> str:
    """The task the run trains (so that ``fedlightning train resume=DIR`` needs no other
    argument, whatever the run was)."""
    return str(trained_config(cfg).get("task"))


def check_runner_fits_task(cfg: DictConfig) -> None:
    """``runner=distributed`` spreads the clients of a round (:func:`train`, FedTIP's task
    loop); the bank's pre-training (``task=bank``) is centralized and has none."""
    target = str(OmegaConf.select(cfg, "runner._target_", default=""))
    if target.endswith(".DistributedRunner") and run_task(cfg) == "bank":
        raise ConfigError(
            "runner",
            "runner=distributed does not support task=bank: the bank is pre-trained "
            "centrally, in one process; use runner=sequential",
        )


def prepare_run_dir(cfg: DictConfig, run_dir: Path) -> tuple[DictConfig, Path, bool]:
    """The config and directory to run in; on ``resume`` the earlier run's own.

    A resumed run takes its saved config whole, except ``runner`` and ``logger`` (how and
    where it runs, which cannot change results) from this invocation. A fresh run refuses
    a directory that already holds a run, so nothing saved is overwritten.
    """
    if cfg.get("resume"):
        old = Path(cfg.resume)
        if not (old / CONFIG_FILE).is_file():
            raise ConfigError(
                "resume", f"{old} holds no {CONFIG_FILE}; pass an earlier run's directory"
            )
        if (old / SUMMARY_FILE).exists():
            raise ConfigError(
                "resume", f"{old} already finished ({SUMMARY_FILE} exists); nothing to resume"
            )
        saved = OmegaConf.load(old / CONFIG_FILE)
        saved.runner, saved.logger = cfg.runner, cfg.logger
        saved.resume = str(old)
        return saved, old, True
    for name in (SUMMARY_FILE, CHECKPOINT_FILE):
        if (run_dir / name).exists():
            raise FedLightningError(
                f"run directory {run_dir} already holds a run ({name}); "
                "refusing to overwrite it: choose a new hydra.run.dir or "
                f"resume={run_dir}"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / CONFIG_FILE, resolve=True)
    return OmegaConf.load(run_dir / CONFIG_FILE), run_dir, False


def make_tracker(cfg: DictConfig) -> NullTracker:
    if not cfg.logger.get("enabled", True):
        return NullTracker()
    return MlflowTracker(cfg.logger.tracking_uri, cfg.logger.experiment_name)


def run_tags(
    cfg: DictConfig, graph: MultimodalGraph, algorithm: Any, hashes: dict[str, str]
) -> dict[str, str]:
    """The MLflow tags every run carries (DESIGN.md): reports select runs by these."""
    return {
        "method": algorithm.name,
        "dataset": graph.name,
        "task": str(cfg.task),
        "variant": str(getattr(algorithm, "variant", "full")),
        "backbone": str(cfg.model.net.get("conv", "custom")),
        "seed": str(cfg.seed),
        "experiment": str(cfg.name),
        **{f"hash_{k}": v for k, v in hashes.items()},
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The short table printed at the end of a run."""
    m, c = summary["metrics"], summary["comm"]
    rows = [("experiment", summary["experiment"]), ("rounds", summary["rounds"])]
    rows += [(k, f"{m[k]:.4f}") for k in ("test_acc", "val_acc") if m.get(k) is not None]
    if m.get("test_acc_at_best_val") is not None:
        best = f"{m['test_acc_at_best_val']:.4f} (round {m['best_val_round']})"
        rows.append(("test_acc_at_best_val", best))
    keys = ("recall_at_1", "am", "fm", "fm_diag", "fpr95", "auroc_ood", "open_acc")
    rows += [(k, f"{m[k]:.4f}") for k in keys if m.get(k) is not None]
    rows += [("uplink", f"{c['uplink_mib']:.3f} MiB"), ("downlink", f"{c['downlink_mib']:.3f} MiB")]
    return summary_table(rows, summary)


def summary_table(rows: list[tuple[str, Any]], summary: dict[str, Any]) -> str:
    """``rows`` then the hashes, wall time and run directory, as an aligned table."""
    rows = rows + [(f"hash[{k}]", v) for k, v in summary["hashes"].items()]
    rows += [("wall time", f"{summary['wall_time_s']:.1f} s"), ("run dir", summary["run_dir"])]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 40)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])


def build_protocol(
    cfg: DictConfig, graph: MultimodalGraph, run_dir: Path, resuming: bool
) -> tuple[Partition, ClassStream | None, dict[str, str]]:
    """The protocol objects (partition; class stream under ``protocol=cil``), saved, hashed."""
    partition = build(cfg.partition, "partition")(graph, cfg.federation.clients, cfg.protocol.seed)
    save_protocol(partition, run_dir / "partition.json", resuming)
    hashes = {"partition": partition.hash}
    if cfg.protocol.get("stream") is None:
        return partition, None, hashes
    if partition.meta["split_fractions"][1] <= 0:
        raise ConfigError(
            "partition.split",
            "the class-incremental protocol calibrates its "
            "rejection threshold on validation nodes: the validation fraction "
            "must be > 0",
        )
    stream = build(cfg.protocol.stream, "protocol.stream")(graph, partition, cfg.protocol.seed)
    save_protocol(stream, run_dir / "stream.json", resuming)
    hashes["stream"] = stream.hash
    log.info(
        "class stream %s, never introduced %s (stream %s)", stream.stages, stream.never, stream.hash
    )
    return partition, stream, hashes


Observer = Callable[[str, int, dict[str, float]], None]


def _report(tracker: Any, observe: Observer | None, kind: str, step: int, m: dict) -> None:
    """Log a round's metrics (or a stage's, as ``stage_<name>``), then show them to
    ``observe``."""
    if kind == "stage":
        tracker.log_metrics({f"stage_{k}": v for k, v in m.items() if k != "stage"}, step=step)
    else:
        tracker.log_metrics(m, step=step)
    if observe is not None:
        observe(kind, step, m)


def train(
    cfg: DictConfig,
    run_dir: str | Path,
    observe: Observer | None = None,
    verbose: bool = True,
    runner: Any = None,
) -> dict[str, Any]:
    """Run the experiment ``cfg`` in ``run_dir``; return the summary (also written to disk).

    ``observe(kind, step, metrics)`` sees every round's (``"round"``) and stage's
    (``"stage"``) metrics after they are checkpointed and logged; raising
    :class:`~fedlightning.errors.RunStopped` there ends the run as ``KILLED`` (a pruned
    sweep trial). ``verbose=False`` leaves out the summary table on stdout. ``runner``, when
    given, replaces the one ``cfg.runner`` builds (a Flower ServerApp passes its own).
    """
    check_runner_fits_task(cfg)
    task = run_task(cfg)
    if task == "bank":  # FedTIP's temporal bank: no federation, its own runner
        from fedlightning.temporal.run import train_bank

        return train_bank(cfg, Path(run_dir), verbose=verbose)
    if task == "temporal":  # FedTIP and its comparators over the task manifest
        from fedlightning.temporal.fedtip_run import train_fedtip

        return train_fedtip(cfg, Path(run_dir), observe=observe, verbose=verbose)
    t0 = time.perf_counter()
    validate(cfg)
    if runner is None:  # first: a distributed runner joins its ranks here
        runner = build(cfg.runner, "runner")
    world = runner.world  # only rank 0 writes files; the others get its results
    cfg, run_dir, resuming = world.on_main(prepare_run_dir, cfg, Path(run_dir))
    world.run_dir = run_dir
    seed_everything(cfg.seed)

    graph = load_graph(cfg)
    partition, stream, hashes = world.on_main(build_protocol, cfg, graph, run_dir, resuming)
    clients = build_clients(graph, partition)
    log.info("%r split into %d clients (partition %s)", graph, len(clients), partition.hash)

    in_dims = {m: x.size(1) for m, x in graph.features.items()}
    net, algorithm, module = build_model(cfg, in_dims, graph.num_classes)
    check_algorithm_fits_protocol(algorithm, stream)
    runner.begin(cfg, run_dir, hashes)
    server = algorithm.server(net.state_dict())
    tracker = make_tracker(cfg) if world.is_main else NullTracker()

    common = dict(
        participation=cfg.federation.participation,
        local_epochs=cfg.federation.local_epochs,
        seed=cfg.seed,
        checkpoint_path=run_dir / CHECKPOINT_FILE if world.is_main else None,
        on_round_end=lambda r, m: _report(tracker, observe, "round", r, m),
    )
    if stream is None:
        loop = FederatedLoop(
            algorithm, module, server, clients, runner, rounds=cfg.federation.rounds, **common
        )
    else:
        algorithm.setup(stream, cfg.federation.rounds, cfg.seed, graph.num_classes)
        loop_cls = getattr(algorithm, "loop_cls", None) or ContinualLoop
        loop = loop_cls(
            algorithm,
            module,
            server,
            clients,
            runner,
            stream=stream,
            rounds_per_stage=cfg.federation.rounds,
            num_classes=graph.num_classes,
            on_stage_end=lambda t, m: _report(tracker, observe, "stage", t, m),
            **common,
        )
    run_id = None
    if resuming:
        loop.load_state_dict(
            world.on_main(torch.load, run_dir / CHECKPOINT_FILE, weights_only=False)
        )
        log.info("resuming %s after round %d", run_dir, loop.completed_rounds)
        if (run_dir / MLFLOW_RUN_FILE).exists():
            run_id = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())["run_id"]
    tags = run_tags(cfg, graph, algorithm, hashes)
    params = flatten(OmegaConf.to_container(cfg, resolve=True))
    parent = cfg.logger.get("parent_run_id")  # a sweep trial's runs nest under the trial
    mlflow_tags = {**tags, "mlflow.parentRunId": str(parent)} if parent else tags
    run_id = tracker.start(f"{cfg.name}-{run_dir.name}", mlflow_tags, params, run_id=run_id)
    if run_id:
        write_json(
            run_dir / MLFLOW_RUN_FILE, {"run_id": run_id, "tracking_uri": cfg.logger.tracking_uri}
        )

    try:
        history = loop.run()
    except RunStopped:
        tracker.end("KILLED")
        raise
    except BaseException:
        tracker.end("FAILED")
        raise
    summary = {
        "experiment": str(cfg.name),
        "seed": int(cfg.seed),
        "rounds": loop.completed_rounds,
        "metrics": loop.final_metrics(),
        "comm": loop.ledger.summary(),
        "hashes": hashes,
        "wall_time_s": time.perf_counter() - t0,
        "run_dir": str(run_dir),
        "tags": tags,
        "resumed": resuming,
        **loop.summary_extras(),
    }
    summary = json_safe(summary)
    if not world.is_main:  # the same state on every rank; rank 0 writes and logs it
        return summary
    write_json(run_dir / "history.json", json_safe(history))
    write_json(run_dir / SUMMARY_FILE, summary)
    artifacts = loop.write_artifacts(run_dir, f"{cfg.name} ({algorithm.name}, {graph.name})")
    tracker.log_metrics(
        {f"final_{k}": v for k, v in summary["metrics"].items()}, step=loop.completed_rounds
    )
    protocol_files = [run_dir / f for f in ("partition.json", "stream.json")]
    tracker.log_artifacts(
        [
            run_dir / CONFIG_FILE,
            run_dir / SUMMARY_FILE,
            run_dir / "history.json",
            *protocol_files,
            *artifacts,
        ]
    )
    tracker.end("FINISHED")
    if verbose:
        print(format_summary(summary), flush=True)
    return summary
