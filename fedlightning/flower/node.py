"""A Flower node's side of a run (docs/scaling.md): one folder per run and client on the
node's own disk, ``<root>/<run key>/client_<k>/``, holding ``config.yaml`` (the run's
resolved config), ``client.pt`` (the client built at set-up from the node's data: a graph
client's subgraph, input sizes and class stream, or a FedTIP client's support per task),
``state_<round>.pt`` (:class:`StateFiles`) and ``sent.jsonl`` (an audit log of every reply),
from which a deployment's fresh ClientApp process per message reads everything."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict
from omegaconf import DictConfig, OmegaConf

from fedlightning.config import build
from fedlightning.errors import DataError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.federation.loop import LocalEvaluate, local_fit
from fedlightning.federation.task_loop import Member, TaskBatches, TaskContext
from fedlightning.flower.records import (
    COUNTS,
    TENSORS,
    content_fields,
    message_records,
    record_tensors,
    records_message,
)
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.server.aggregate import model_state
from fedlightning.utils.io import save_torch

CONFIG, CLIENT, AUDIT = "config.yaml", "client.pt", "sent.jsonl"


def node_folder(root: str | Path, run: str, client_id: int) -> Path:
    return Path(root).expanduser() / run / f"client_{client_id}"


def remap_data_root(cfg: DictConfig, data_root: str | None) -> DictConfig:
    """The server's resolved config with its ``data_root`` prefix in ``dataset.*`` paths
    replaced by this node's (``None``: keep the server's)."""
    server_root = str(cfg.get("data_root") or "")
    if not data_root or not server_root or data_root == server_root:
        return cfg
    cfg = cfg.copy()
    for key, value in cfg.dataset.items():
        if isinstance(value, str) and value.startswith(server_root):
            cfg.dataset[key] = data_root + value[len(server_root) :]
    cfg.data_root = data_root
    return cfg


def setup_node(
    folder: Path, client_id: int, config_yaml: str, hashes: dict[str, str], data_root: str | None
) -> None:
    """Build client ``client_id``'s data from this node's copy of the dataset and save it;
    the node's protocol objects must have the server's ``hashes``."""
    cfg = remap_data_root(OmegaConf.create(config_yaml), data_root)
    if str(cfg.get("task")) == "temporal":
        saved = _temporal_client(cfg, client_id, hashes)
    else:
        saved = _graph_client(config_yaml, data_root, client_id, hashes)
    save_torch(folder / CLIENT, saved)
    OmegaConf.save(cfg, folder / CONFIG)
    open_node.cache_clear()


def check_hashes(cfg: DictConfig, ours: dict[str, str], server: dict[str, str]) -> None:
    """Refuse a node whose data (or code) gives other protocol objects than the server's."""
    for k, mine in ours.items():
        if k in server and server[k] != mine:
            raise DataError(
                cfg.dataset.get("root") or cfg.dataset.get("path") or cfg.dataset.get("name"),
                f"this node's data gives {k} hash {mine}, the server's run has {server[k]}: "
                "the node holds other data (or code) than the server",
            )


def _graph_client(
    config_yaml: str, data_root: str | None, client_id: int, hashes: dict[str, str]
) -> dict[str, Any]:
    """A graph client's subgraph, model input sizes and (class-incremental runs) stream."""
    from fedlightning.programs.graph_program import build_client

    cfg, graph, partition = _protocol(config_yaml, data_root)
    ours = {"partition": partition.hash}
    stream = None
    if cfg.protocol.get("stream") is not None:
        stream = build(cfg.protocol.stream, "protocol.stream")(graph, partition, cfg.protocol.seed)
        ours["stream"] = stream.hash
    check_hashes(cfg, ours, hashes)
    return {
        "data": build_client(graph, partition, client_id).data,
        "in_dims": {m: x.size(1) for m, x in graph.features.items()},
        "num_classes": graph.num_classes,
        "stream": stream,
    }


def _temporal_client(cfg: DictConfig, client_id: int, hashes: dict[str, str]) -> dict[str, Any]:
    """A FedTIP client's support batch in every task it takes part in, from the node's own
    protocol, bank and contexts (built, or reused from the node's cache)."""
    from fedlightning.programs.temporal_program import temporal_inputs

    inputs = temporal_inputs(cfg)
    check_hashes(cfg, inputs["hashes"], hashes)
    tasks = {t.task: t.clients[client_id] for t in inputs["tasks"] if client_id in t.clients}
    return {"tasks": tasks, "dims": inputs["dims"]}


@functools.lru_cache(maxsize=2)
def _protocol(config_yaml: str, data_root: str | None) -> tuple[DictConfig, Any, Any]:
    """The config, graph and partition of a run (cached: a simulation's process sets up
    several virtual nodes)."""
    from fedlightning.programs.graph_program import load_graph

    cfg = remap_data_root(OmegaConf.create(config_yaml), data_root)
    graph = load_graph(cfg)
    partition = build(cfg.partition, "partition")(graph, cfg.federation.clients, cfg.protocol.seed)
    return cfg, graph, partition


class StateFiles:
    """A client's persistent state on its node's disk, one ``state_<round>.pt`` per fit. A
    round that a resumed run repeats starts from the same state as the first time: :meth:`save`
    keeps the newest earlier state beside the new one."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def rounds(self) -> dict[int, Path]:
        return {int(p.stem.split("_")[1]): p for p in self.folder.glob("state_*.pt")}

    def load(self, round: int, inclusive: bool = False) -> dict[str, Any]:
        """The state after the newest fit before ``round`` (``{}`` before the first;
        ``inclusive``: up to and with ``round``, for the stage-end exchange)."""
        earlier = [r for r in self.rounds() if r < round or (inclusive and r == round)]
        if not earlier:
            return {}
        return torch.load(self.rounds()[max(earlier)], weights_only=False)

    def save(self, round: int, state: dict[str, Any]) -> None:
        save_torch(self.folder / f"state_{round}.pt", state)
        files = self.rounds()
        for r in sorted(r for r in files if r < round)[:-1]:
            files[r].unlink(missing_ok=True)


class NodeClient:
    """Client ``client_id`` of one run on this node: its data, model and executor, rebuilt
    from its ``folder`` (made by :func:`setup_node`)."""

    def __init__(self, folder: Path, client_id: int) -> None:
        if not (folder / CLIENT).is_file():
            raise DataError(folder / CLIENT, "missing: this node was not set up for the run")
        self.folder, self.client_id = folder, client_id
        self.states = StateFiles(folder)
        self.cfg = OmegaConf.load(folder / CONFIG)
        saved = torch.load(folder / CLIENT, weights_only=False)
        self.executor = build(self.cfg.runner.executor, "runner.executor")
        if "tasks" in saved:  # a FedTIP client: its support per task
            from fedlightning.programs.temporal_program import make_algorithm, temporal_inputs

            self.tasks, self.dims = saved["tasks"], saved["dims"]
            self.algorithm = make_algorithm(self.cfg)
            if self.algorithm.mode == "fulltune":  # the bank's snapshot, to tune the encoder
                inputs = temporal_inputs(self.cfg)
                self.algorithm.attach(inputs["encoder"], inputs["protocol"])
            return
        from fedlightning.programs.graph_program import build_model

        self.data = saved["data"]
        _, self.algorithm, self.module = build_model(
            self.cfg, saved["in_dims"], saved["num_classes"]
        )
        if saved.get("stream") is not None:
            self.algorithm.setup(
                saved["stream"], int(self.cfg.federation.rounds), int(self.cfg.seed),
                saved["num_classes"],
            )  # fmt: skip

    def answer(self, kind: str, content: RecordDict, task: dict[str, Any]) -> RecordDict:
        """The reply to a ``train`` message (:meth:`work`'s update; no record for ``None``)
        or an ``evaluate`` one (correct and total nodes per split of the global model on this
        client's data), appended to ``sent.jsonl``."""
        round = int(task["round"])
        if kind == "evaluate":
            evaluate = LocalEvaluate(self.module, model_state(record_tensors(content[TENSORS])))
            counts = evaluate(FederatedClient(self.client_id, self.data))
            reply = RecordDict({COUNTS: MetricRecord(counts)})
        else:
            broadcast = records_message(content, round=round)
            reply = message_records(self.work(str(task["kind"]), broadcast, task))
        entry = {"time": time.time(), "kind": kind, "round": round}
        entry["records"] = content_fields(reply)
        with open(self.folder / AUDIT, "a") as f:
            f.write(json.dumps(entry) + "\n")
        return reply

    def work(self, kind: str, broadcast: ServerBroadcast, task: dict[str, Any]) -> Any:
        """The client's part of a round of ``kind``, as the same round in one process gives
        it: ``fit`` (:func:`local_fit` from the state saved after this client's newest
        earlier fit; the new state is saved for the next), ``stage_end`` (from the state
        after this round) or ``task_fit``. The update, or ``None``."""
        if kind == "task_fit":
            return self.task_fit(broadcast, task)
        if kind not in ("fit", "stage_end"):
            raise ValueError(f"unknown work {kind!r}")
        state = self.states.load(broadcast.round, inclusive=kind == "stage_end")
        client = FederatedClient(self.client_id, self.data, state)
        if kind == "stage_end":
            stage = int(task["stage"])
            return self.algorithm.stage_end_update(self.module, client, broadcast, stage)
        epochs, seed = int(task["epochs"]), int(self.cfg.seed)
        update = local_fit(
            self.algorithm, self.module, broadcast, self.executor, epochs, seed, client
        )
        self.states.save(broadcast.round, client.state)
        return update

    def task_fit(self, broadcast: ServerBroadcast, task: dict[str, Any]) -> ClientUpdate:
        """A FedTIP client's fit in one round of a task and family: its own row of the
        round's stack (position ``position`` of the task's clients), as a rank holding only
        this client fits it."""
        alg, k, family = self.algorithm, self.client_id, str(task["family"])
        module = alg.task_module(alg.adapter(*self.dims), family)
        batches = TaskBatches(
            int(task["task"]),
            {k: self.tasks[int(task["task"])]},
            ids=[int(i) for i in task["ids"]],
            length=int(task["length"]),
        )
        context = TaskContext(int(self.cfg.seed), int(task["epochs"]), self.executor)
        work = alg.task_work(context, batches, family, module, broadcast)
        if work.share is not None:
            position = int(task["position"])
            (update,) = work.share(range(position, position + 1))
            return update
        return work.one(Member(k))


@functools.lru_cache(maxsize=8)
def open_node(folder: Path, client_id: int) -> NodeClient:
    """The :class:`NodeClient` of ``folder`` (cached: a simulation's processes serve many
    messages)."""
    return NodeClient(folder, client_id)
