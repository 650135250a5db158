"""FedGCN (Yao et al., NeurIPS 2023) on FedTIP's protocol (docs/fedtip.md, "FedGCN").

Before the first task every client uploads, once, the neighbour-feature sums of its own
history edges (:func:`~fedlightning.methods.fedgcn.fedgcn_model.neighbour_sums`, rows of the nodes it has
an edge at, with their counts); the server adds them and returns the global rows. Then, per
task and family, a 2-layer GCN (:class:`~fedlightning.methods.fedgcn.fedgcn_model.FedGCNNet`) whose first
layer reads the global :math:`\\hat{A}X` and whose second layer aggregates over the client's
own edges is trained with FedAvg. ``exchange=false`` is the 0-hop reading (local sums only).
"""

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
    """``fedgcn`` (module docstring). ``hidden``/``out``: the GCN's widths; SGD as the
    paper's, at ``lr`` 0.02 (the paper's 0.5 diverges here; docs/fedtip.md)."""

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
        """Client ``k``'s upload: ``nodes`` (int32) with a local edge, their ``sum`` and
        ``count`` over the client's own edges."""
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
        """The one-off exchange (module docstring), as round 0 of the first task's scope;
        the returned rows (every node's sum and count) are counted as downlink."""
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
        """Float32 values of each client's exchange upload (nodes, sums, counts)."""
        d = self.history.x.size(1)
        return {k: len(client_nodes(self.local[k])) * (d + 2) for k in self.clients}
