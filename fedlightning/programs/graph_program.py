"""A graph federation (``task=fl``, ``cil``, ``cir``), from a composed config to ``summary.json``
and an MLflow run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch_geometric.data import Data

from fedlightning.clients.minibatch import MiniBatch, applies
from fedlightning.config import build, dataset_node, plots_on, validate
from fedlightning.data.graphs.base import MultimodalGraph, apply_missing
from fedlightning.data.partition import TEST, TRAIN, VAL, Partition, check_trainable
from fedlightning.data.streams import ClassStream
from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.federation.executors import with_foreach
from fedlightning.federation.loop import FederatedLoop
from fedlightning.federation.retrieval_stages import RetrievalEvaluation
from fedlightning.federation.stages import ClassEvaluation, ContinualLoop
from fedlightning.programs import Program, metric_text, secure_on
from fedlightning.runs import (
    CHECKPOINT_FILE,
    check_protocol,
    feature_hashes,
    resume_loop,
    run_tags,
    summary_table,
)
from fedlightning.server.aggregate import fedavg
from fedlightning.server.robust import RobustRule, robust_setting
from fedlightning.server.secure_sum import enabled, graph_secure_sum
from fedlightning.utils.io import write_json
from fedlightning.utils.seeding import derive_seed, seed_everything

#: what a stage's end measures, by ``Algorithm.evaluation``
EVALUATIONS = {"classes": ClassEvaluation, "retrieval": RetrievalEvaluation}
log = logging.getLogger("fedlightning")
CLASS_NAMES_FILE = "class_names.json"


def build_client(
    graph: MultimodalGraph, partition: Partition, k: int, sub: MultimodalGraph | None = None
) -> FederatedClient:
    """Client ``k``: its induced subgraph (``sub``, when already cut) with its train/val/test
    masks."""
    nodes = partition.client_nodes(k)
    data: Data = (graph.subgraph(nodes) if sub is None else sub).to_data()
    split = partition.split[nodes]
    data.train_mask, data.val_mask, data.test_mask = split == TRAIN, split == VAL, split == TEST
    data.node_id = nodes  # index in the whole graph, for per-node artifacts
    return FederatedClient(k, data)


def build_clients(
    graph: MultimodalGraph, partition: Partition, release: bool = False
) -> list[FederatedClient]:
    """Every client's induced subgraph with its train/val/test masks (cut in one pass:
    :meth:`~fedlightning.data.graphs.base.MultimodalGraph.split`; ``release``: the graph's
    dense modalities are dropped from it as the clients' rows are gathered)."""
    subs = graph.split(partition.assignment, partition.num_clients, release)
    return [build_client(graph, partition, k, subs[k]) for k in range(partition.num_clients)]


def build_model(cfg: DictConfig, in_dims: dict[str, int], num_classes: int) -> tuple[Any, Any, Any]:
    """``(net, algorithm, client module)``; the net's initial weights are seeded by
    ``(seed, "init")``, so every process that builds them gets the same."""
    torch.manual_seed(derive_seed(cfg.seed, "init"))
    net = build(cfg.model.net, "model.net")(in_dims=in_dims, num_classes=num_classes)
    optimizer = with_foreach(build(cfg.model.optimizer, "model.optimizer"))
    algorithm = build(cfg.algorithm, "algorithm")
    algorithm.report_train_loss = bool(cfg.federation.get("report_train_loss", False))
    algorithm = fit_protocol(algorithm, cfg.protocol.get("stream"))
    return net, algorithm, algorithm.client_module(net, optimizer)


def load_graph(cfg: DictConfig) -> MultimodalGraph:
    """Build the dataset; ``dataset.sparse_modalities`` (names) are stored sparse, and
    ``dataset.missing_rate`` (if set) hides modalities, seeded by ``protocol.seed``. The mask
    reaches the model, whose fusion ignores what is missing."""
    node, taken = dataset_node(cfg)
    rate = taken.get("missing_rate") or 0.0
    graph = build(node, "dataset")
    sparse = list(taken.get("sparse_modalities") or [])
    unknown = sorted(set(sparse) - set(graph.modalities))
    if unknown:
        raise ConfigError(
            "dataset.sparse_modalities",
            f"unknown modalities {unknown}; {graph.name!r} has {graph.modalities}",
        )
    for m in sparse:
        graph.features[m] = graph.features[m].to_sparse_coo().coalesce()
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
        # in place: the graph was just built, and a second copy of its features is the peak
        graph = apply_missing(graph, rate, derive_seed(cfg.protocol.seed, "missing"), inplace=True)
    return graph


def save_protocol(obj: Any, path: Path, resuming: bool) -> None:
    """Save a protocol object; on resume, refuse if it no longer matches the saved one."""
    if resuming and path.exists():
        check_protocol(path, "hash", obj.hash)
        return
    obj.save(path)


def fit_protocol(algorithm: Any, stream: Any) -> Any:
    """The method as it runs under the protocol: in the class-incremental stream (``stream``,
    the class stream or its config: only whether there is one matters) its
    ``class_incremental`` form, refused in one line where it has none; without one, a
    method that needs the stream is refused."""
    if stream is not None:
        staged = algorithm.class_incremental()
        if staged is None:
            raise ConfigError(
                "algorithm",
                f"{algorithm.name!r} has no class-incremental form; "
                "with protocol=cil use a cil_* algorithm (e.g. cil_fedavg_replay)",
            )
        return staged
    if algorithm.continual:
        raise ConfigError(
            "protocol",
            f"algorithm {algorithm.name!r} needs the class-incremental stream: add protocol=cil",
        )
    return algorithm


def format_summary(summary: dict[str, Any]) -> str:
    """The short table printed at the end of a run."""
    m, c = summary["metrics"], summary["comm"]
    rows = [("experiment", summary["experiment"]), ("rounds", summary["rounds"])]
    rows += [(k, f"{m[k]:.4f}") for k in ("test_acc", "val_acc") if m.get(k) is not None]
    if m.get("test_acc_at_best_val") is not None:
        best = f"{m['test_acc_at_best_val']:.4f} (round {m['best_val_round']})"
        rows.append(("test_acc_at_best_val", best))
    keys = ("recall_at_1", "am", "fm", "fm_diag", "fpr95", "auroc_ood", "open_acc")
    rows += [(k, metric_text(m[k])) for k in keys if k in m]
    rows += [("uplink", f"{c['uplink_mib']:.3f} MiB"), ("downlink", f"{c['downlink_mib']:.3f} MiB")]
    return summary_table(rows, summary)


def build_protocol(
    cfg: DictConfig, graph: MultimodalGraph, run_dir: Path, resuming: bool
) -> tuple[Partition, ClassStream | None, dict[str, str]]:
    """The protocol objects (partition; class stream under ``protocol=cil``), saved, hashed;
    beside them ``class_names.json``, the name of class ``0``, ``1``, ... (the folder
    format's file), so that a run's label ids read back as the data's own classes."""
    partition = build(cfg.partition, "partition")(graph, cfg.federation.clients, cfg.protocol.seed)
    check_trainable(partition, graph.y, graph.name)
    save_protocol(partition, run_dir / "partition.json", resuming)
    write_json(run_dir / CLASS_NAMES_FILE, list(graph.class_names), indent=None)
    hashes = {"partition": partition.hash}
    if cfg.protocol.get("stream") is None:
        return partition, None, hashes
    if partition.meta["split_fractions"][1] <= 0:
        raise ConfigError(
            "partition.split",
            "the class-incremental protocol calibrates its rejection threshold on validation "
            "nodes: the validation fraction must be > 0",
        )
    stream = build(cfg.protocol.stream, "protocol.stream")(graph, partition, cfg.protocol.seed)
    save_protocol(stream, run_dir / "stream.json", resuming)
    hashes["stream"] = stream.hash
    log.info(
        "class stream %s, never introduced %s (stream %s)", stream.stages, stream.never, stream.hash
    )
    return partition, stream, hashes


def secure_sum_of(cfg: DictConfig, server: Any) -> Any:
    """``federation.secure_sum=true``: the server's protocol (docs/security.md), refused with
    one line for an aggregation it does not cover."""
    bound, cap = cfg.algorithm.get("max_update_norm"), cfg.algorithm.get("max_client_weight")
    try:
        return graph_secure_sum(
            server,
            cfg.seed,
            None if bound is None else float(bound),
            None if cap is None else float(cap),
        )
    except ValueError as e:
        raise ConfigError("federation.secure_sum", str(e)) from None


def robust_of(cfg: DictConfig, server: Any) -> RobustRule | None:
    """``federation.robust``: the server's robust rule (``None``: off, or the default stepping
    aside), refused in one line for an aggregation that is not FedAvg's or under secure sums
    (the rules read each client's update, which a secure sum hides)."""
    raw = cfg.federation.get("robust")
    raw = OmegaConf.to_container(raw) if isinstance(raw, DictConfig) else raw
    plain = getattr(server, "aggregator", None) is fedavg
    return robust_setting(raw, plain, enabled(cfg.federation.get("secure_sum", False)))


class GraphProgram(Program):
    """``task=fl``, ``cil``, ``cir``: graph -> partition (+ class stream) -> clients -> model
    -> algorithm -> server -> the schedule; ``observe`` sees ``"round"`` and ``"stage"``
    metrics."""

    def check(self) -> None:
        cfg = self.cfg
        if cfg.get("resume"):  # a fresh run's config was checked by train(), before any import
            validate(cfg)  # every rule the config alone decides, before any data is read
            return
        method = fit_protocol(build(cfg.algorithm, "algorithm"), cfg.protocol.get("stream"))
        why = method.check_optimizer(cfg.model.optimizer)
        if why:
            raise ConfigError("model.optimizer", why)

    def prepare(self) -> dict[str, str]:
        cfg, run_dir, runner, world = self.cfg, self.run_dir, self.runner, self.runner.world
        seed_everything(cfg.seed)
        graph = load_graph(cfg)
        features = feature_hashes(graph.features)  # once, at load: a resume compares them
        partition, stream, hashes = world.on_main(
            build_protocol, cfg, graph, run_dir, self.resuming
        )
        described = repr(graph)
        in_dims = {m: x.size(1) for m, x in graph.features.items()}
        # each client holds its own rows; the whole copy is not read again (issue 49's peak)
        clients = build_clients(graph, partition, release=True)
        log.info("%s split into %d clients (partition %s)", described, len(clients), partition.hash)
        graph.features.clear()
        net, algorithm, module = build_model(cfg, in_dims, graph.num_classes)
        module.minibatch = MiniBatch.from_config(cfg.federation.get("minibatch"))  # scaling.md
        if large := sum(applies(module.minibatch, c.data) for c in clients):  # one at a time
            log.info("federation.minibatch: %d clients train by mini-batches, unstacked", large)
            runner.stack_clients = False
        runner.begin(cfg, run_dir, hashes)
        server = algorithm.server(net.state_dict())
        server.setup(len(clients))
        server.weight_bounds = {c.client_id: float(c.data.num_nodes) for c in clients}
        server.robust = robust_of(cfg, server)
        if secure_on(cfg, getattr(runner, "name", "") == "flower"):
            server.secure = secure_sum_of(cfg, server)
        self.loop = loop = self.schedule(
            algorithm, module, server, clients, stream=stream, num_classes=graph.num_classes
        )
        if resume_loop(loop, world, cfg, run_dir, hashes, self.resuming, features=features):
            log.info("resuming %s after round %d", run_dir, loop.completed_rounds)
        self.algorithm, self.graph, self.hashes = algorithm, graph, hashes
        return run_tags(
            cfg,
            hashes,
            method=algorithm.name,
            dataset=graph.name,
            task=str(cfg.task),
            variant=str(algorithm.variant),
            backbone=str(cfg.model.net.get("conv", "custom")),
        )

    def report(self, kind: str, step: int, m: dict, at: int | None = None) -> None:
        """Log a round's metrics (or a stage's, as ``stage/<name>`` at round ``at``, where
        the stage ends), then show them to ``observe``."""
        logged = {f"stage/{k}": v for k, v in m.items() if k != "stage"} if kind == "stage" else m
        self.run.tracker.log_metrics(logged, step=step if at is None else at)
        if self.observe is not None:
            self.observe(kind, step, m)

    def schedule(self, algorithm: Any, *parts: Any, stream: Any, num_classes: int) -> Any:
        """The run's schedule over ``parts`` (module, server, clients): plain rounds, or the
        stages of the class ``stream``."""
        cfg, rounds = self.cfg, self.cfg.federation.rounds
        kw: dict[str, Any] = dict(
            participation=cfg.federation.participation,
            local_epochs=cfg.federation.local_epochs,
            seed=cfg.seed,
            checkpoint_path=self.run_dir / CHECKPOINT_FILE if self.runner.world.is_main else None,
            on_round_end=lambda r, m: self.report("round", r, m),
            min_clients=cfg.federation.get("min_clients", 1),
        )
        if stream is None:
            return FederatedLoop(algorithm, *parts, self.runner, rounds=rounds, **kw)
        algorithm.setup(stream, rounds, cfg.seed, num_classes)
        kw.update(
            evaluation=EVALUATIONS[algorithm.evaluation](),
            on_stage_end=lambda t, m: self.report("stage", t, m, at=t * rounds),
        )
        return ContinualLoop(
            algorithm, *parts, self.runner, stream=stream, rounds_per_stage=rounds,
            num_classes=num_classes, **kw,
        )  # fmt: skip

    def work(self) -> None:
        self.history = self.loop.run()

    def fields(self) -> dict[str, Any]:
        loop, algorithm = self.loop, self.algorithm
        extras = loop.summary_extras()
        metrics = loop.final_metrics()
        release = algorithm.release
        if release is not None:  # FedOGL's prototype release and its budget (docs/security.md)
            extras["privacy"] = algorithm.privacy_budget(loop.completed_rounds)
            if release.on:
                metrics["dp_epsilon"] = extras["privacy"]["epsilon"]
        return dict(
            rounds=loop.completed_rounds,
            metrics=metrics,
            comm=loop.ledger.summary(),
            timing=loop.timing(),
            hashes=self.hashes,
            resumed=self.resuming,
            **extras,
        )

    def outputs(self) -> dict[str, Any]:
        artifacts, run_dir = [], self.run_dir
        if self.runner.world.is_main:
            title = f"{self.cfg.name} ({self.algorithm.name}, {self.graph.name})"
            artifacts = self.loop.write_artifacts(run_dir, title, plots_on(self.cfg))
        protocol_files = [run_dir / f for f in ("partition.json", "stream.json", CLASS_NAMES_FILE)]
        return dict(
            step=self.loop.completed_rounds,
            files=[*protocol_files, *artifacts],
            table=format_summary,
            extra={"history.json": self.history},
        )


#: the name ``program._target_`` gives it (conf/program/graph.yaml, and saved runs' configs)
train_graph = GraphProgram
