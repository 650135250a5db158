"""What FedGCN and FedSage+ share (paper 001, Sec. 5.1.2; docs/fedtip.md): the history graph,
each client's part of it, a one-off exchange before the first task, then per task and family
a GNN fitted by support-weighted FedAvg and scored by the server on the whole history."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning.federation.ledger import CommLedger
from fedlightning.federation.round import ClientWork
from fedlightning.federation.task_loop import (
    Batch,
    Member,
    TaskBatches,
    TaskContext,
    TaskLoop,
)
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fulltune.fulltune import fedavg_server, model_update
from fedlightning.methods.history.graph_task import (
    ClientGraph,
    GraphTaskClient,
    SourceState,
    event_nodes,
)
from fedlightning.methods.history.history import FEATURES, HistoryGraph, cached_history
from fedlightning.methods.temporal_base.temporal_base import TemporalMethod
from fedlightning.server.reliability import FedTIPServer, unflatten
from fedlightning.temporal.bank import streaming_threads


def both_ways(edge_index: Tensor) -> Tensor:
    """Distinct undirected pairs of ``edge_index`` in both directions, no self loop."""
    ei = torch.cat([edge_index, edge_index.flip(0)], 1)
    return torch.unique(ei[:, ei[0] != ei[1]], dim=1)


@dataclass
class HistoryBaseline(TemporalMethod):
    """The shared part; ``features``, ``segments``: the history's; ``hidden``, ``out``: the
    GNN's widths; ``optimizer``, ``dropout``: the local fit's."""

    flower_nodes = False  # a Flower node holds neither the history view nor the exchange
    name: str = "history_gnn"
    mode: str = "graph"
    features: str = "bank"
    segments: list[str] = field(default_factory=lambda: ["pretrain"])
    hidden: int = 32
    out: int = 32
    optimizer: str = "adam"
    dropout: float = 0.1
    modes = ("graph",)
    pool_tasks = False  # the one-off exchange is in the first task's scope of the ledger

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.features not in FEATURES:
            raise ValueError(f"algorithm.features must be one of {FEATURES}, got {self.features!r}")
        self.history: HistoryGraph | None = None
        self.trained: nn.Module | None = None
        self.local: dict[int, Tensor] = {}

    # ------------------------------------------------------------------ the history view
    def materialize_views(self, cache_dir: Any) -> dict[str, str]:
        """The history graph and each client's edges; its hash joins the run's."""
        graph, _, _ = cached_history(
            self.protocol, self.snapshot, cache_dir, tuple(self.segments), self.features
        )
        self.use_history(graph)
        return {"history": graph.hash}

    def use_history(self, graph: HistoryGraph) -> None:
        """The history graph, its edges split by their source's owner."""
        self.history = graph
        owner = torch.from_numpy(self.protocol.ownership.owner)
        src_owner = owner[graph.edge_index[0]]
        self.local = {
            k: both_ways(graph.edge_index[:, src_owner == k])
            for k in range(self.protocol.ownership.clients)
        }
        self.everything = both_ways(graph.edge_index)

    @property
    def clients(self) -> list[int]:
        return list(range(self.protocol.ownership.clients))

    def d_in(self, d_h: int) -> int:
        return self.history.x.size(1) if self.history is not None else d_h

    # ------------------------------------------------------------------ per method
    def before_tasks(self, loop: TaskLoop, ledger: CommLedger, scope: str) -> None:
        """The one-off exchange before the first task (none here)."""

    def task_threads(self) -> Any:
        """One torch thread for the tasks (a small graph's scatter is slower on two)."""
        return streaming_threads()

    def client_graph(self, k: int) -> ClientGraph:
        return ClientGraph(self.history.x, self.local[k])

    def server_graph(self) -> ClientGraph:
        return ClientGraph(self.history.x, self.everything)

    def model(self, d_in: int) -> nn.Module:
        raise NotImplementedError

    # ------------------------------------------------------------------ task verbs
    def adapter(self, d_h: int, d_t: int, d_e: int) -> nn.Module:
        return self.model(self.d_in(d_h))

    def task_module(self, adapter: nn.Module, family: str) -> GraphTaskClient:
        return GraphTaskClient(
            adapter, self.protocol.stream, family, tau=self.tau, lr=self.lr,
            weight_decay=self.weight_decay, optimizer=self.optimizer,
        )  # fmt: skip

    def task_server(self, module: GraphTaskClient) -> FedTIPServer:
        return fedavg_server(module.model)

    def task_work(
        self,
        context: TaskContext,
        task: TaskBatches,
        family: str,
        module: GraphTaskClient,
        broadcast: ServerBroadcast,
    ) -> ClientWork:
        """Each client's fit on its own graph (:func:`model_update`)."""
        shapes = {n: p.shape for n, p in module.model.named_parameters()}
        omega = unflatten(broadcast.tensors["model"], shapes)
        r = broadcast.round

        def fit(client: Member) -> ClientUpdate:
            k = client.client_id
            module.use_graph(self.client_graph(k))
            return model_update(context, task, family, module, module.model, omega, r, k)

        uplink = self.task_uplink(task, family, broadcast, module.model.d_out, field="model")
        return ClientWork(one=fit, uplink=uplink)

    def task_result(
        self, module: GraphTaskClient, adapter: nn.Module, server: FedTIPServer
    ) -> tuple[nn.Module, dict[int, Tensor]]:
        module.model.load_state_dict(server.state())
        self.trained = module.model
        return SourceState(), server.class_prototypes()

    @torch.no_grad()
    def task_segments(self, loop: TaskLoop, segments: dict[str, Batch]) -> dict[str, Batch]:
        """The segments with the GNN's representations in ``h_u``, ``h_i``, ``h_j``."""
        self.trained.eval()
        g = self.server_graph()
        z = self.trained(g.x, g.edge_index)
        stream = self.protocol.stream
        out = {}
        for split, batch in segments.items():
            u, i, j = event_nodes(stream.src, stream.dst, batch)
            out[split] = {**batch, "h_u": z[u], "h_i": z[i], "h_j": z[j]}
        return out

    def message_size(self, adapter: nn.Module, family: str, classes: int = 2) -> int:
        """Float32 values of one message: the delta, class counts, class means (``nc``)."""
        n = adapter.num_values() + classes
        return n + (classes * adapter.d_out if family == "nc" else 0)


def client_nodes(edge_index: Tensor) -> Tensor:
    """The nodes with an edge in ``edge_index`` (sorted)."""
    return torch.unique(edge_index.flatten()) if edge_index.numel() else torch.zeros(0).long()
