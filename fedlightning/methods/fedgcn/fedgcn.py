"""FedGCN (Yao et al., NeurIPS 2023) on FedTIP's protocol (docs/fedtip.md, "FedGCN"): a one-off
exchange of neighbour sums before the first task, then a GCN per task with FedAvg;
``exchange=false``: local sums only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedlightning.federation.ledger import DOWN, CommLedger
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.task_loop import Member, TaskLoop
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fedgcn.fedgcn_model import FedGCNNet, first_layer_input, neighbour_sums
from fedlightning.methods.fedgcn.fedgcn_server import SumExchangeServer
from fedlightning.methods.history.graph_task import ClientGraph
from fedlightning.methods.history.history_baseline import HistoryBaseline, client_nodes
from fedlightning.server.validation import Field, MessageSpec, Rule

EXCHANGE = "exchange"  # the ledger prefix of the one-off exchange


@dataclass
class FedGCN(HistoryBaseline):
    """``fedgcn``: SGD at ``lr`` 0.02 (the paper's 0.5 diverges here; docs/fedtip.md)."""

    name: str = "fedgcn"
    exchange: bool = True
    hidden: int = 32
    out: int = 32
    optimizer: str = "sgd"
    lr: float = 0.02
    dropout: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.inputs: dict[int, torch.Tensor] = {}

    def model(self, d_in: int) -> nn.Module:
        return FedGCNNet(d_in, self.hidden, self.out, self.dropout)

    def client_sums(self, k: int) -> ClientUpdate:
        """Client ``k``'s ``nodes`` with a local edge, their ``sum`` and ``count``."""
        g = self.history
        s, c = neighbour_sums(g.x, self.local[k], g.num_nodes)
        nodes = client_nodes(self.local[k])
        tensors = {"nodes": nodes.int(), "sum": s[nodes], "count": c[nodes]}
        return ClientUpdate(round=0, client_id=k, tensors=tensors)

    def exchange_spec(self) -> MessageSpec:
        n, d = self.history.num_nodes, self.history.x.size(1)

        def in_range(u: ClientUpdate) -> str | None:
            nodes = u.tensors["nodes"]
            if len(nodes) and (int(nodes.min()) < 0 or int(nodes.max()) >= n):
                return f"nodes: ids must lie in [0, {n})"
            if not len(nodes) == len(u.tensors["sum"]) == len(u.tensors["count"]):
                return "sum: one row per node"
            return None

        return MessageSpec(
            (
                Field("nodes", shape=(-1,), dtype=torch.int32),
                Field("sum", shape=(-1, d)),
                Field("count", shape=(-1,)),
            ),
            rules=(Rule(in_range),),
        )

    def before_tasks(self, loop: TaskLoop, ledger: CommLedger, scope: str) -> None:
        """The exchange as round 0 of the first task's scope, the returned rows as downlink."""
        g = self.history
        server = SumExchangeServer(g.num_nodes, g.x.size(1))
        members = [Member(k) for k in self.clients]
        if self.exchange:

            def work(broadcast: ServerBroadcast) -> ClientWork:
                return ClientWork(one=lambda m: self.client_sums(m.client_id),
                                  uplink=self.exchange_spec())  # fmt: skip

            federated_round(0, server, loop.runner, members, work, ledger,
                            prefix=EXCHANGE, scope=scope)  # fmt: skip
            for k in self.clients:
                ledger.record_values(
                    DOWN, k, f"{EXCHANGE}/rows", g.num_nodes * (g.x.size(1) + 1), scope
                )
        for k in self.clients:
            if self.exchange:
                s, c = server.sums, server.counts
            else:
                s, c = neighbour_sums(g.x, self.local[k], g.num_nodes)
            self.inputs[k] = first_layer_input(g.x, s, c)
        s, c = neighbour_sums(g.x, self.everything, g.num_nodes)
        self.inputs[-1] = first_layer_input(g.x, s, c)  # the server's scorer: every edge

    def client_graph(self, k: int) -> ClientGraph:
        return ClientGraph(self.inputs[k], self.local[k])

    def server_graph(self) -> ClientGraph:
        return ClientGraph(self.inputs[-1], self.everything)

    def exchange_values(self) -> dict[int, int]:
        d = self.history.x.size(1)
        return {k: len(client_nodes(self.local[k])) * (d + 2) for k in self.clients}
