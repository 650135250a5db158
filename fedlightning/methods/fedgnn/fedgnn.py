"""FedGNN (Wu et al., arXiv 2102.04925) on FedTIP's protocol (docs/fedtip.md, "FedGNN"):
each client (a set of users) fits a GNN over its users' history graph and the item
embeddings, and uploads the GNN's update and the rows of the items it touched plus
pseudo-interacted items with fake gradients, all with Laplace noise (local DP). The server
averages the gradients (a table row over the clients that sent it) and scores its segments
with the global model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedlightning.federation.round import ClientWork
from fedlightning.federation.task_loop import Batch, Member, TaskBatches, TaskContext, TaskLoop
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fedgnn.fedgnn_client import FAMILY_KEYS, FedGNNClient, fedgnn_forward
from fedlightning.methods.fedgnn.fedgnn_model import (
    FedGNNModel,
    HistoryGraph,
    ScoreView,
    fake_gradients,
    history_graph,
    ldp_update,
    pseudo_items,
    scored_segment,
)
from fedlightning.methods.fedgnn.fedgnn_server import (
    RowSparseServer,
    row_upload_problem,
    unflatten_keys,
)
from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.server.validation import Field, MessageSpec, Rule
from fedlightning.utils.seeding import derive_seed, manual_seed, torch_generator


def event_rows(graph: HistoryGraph, stream: Any, batch: Batch) -> dict[str, Tensor]:
    """A client's (``[n]``) or a segment's (``[1, n]``) event batch as graph rows: ``u``
    (source), ``i`` (destination), ``j`` (negative, row 0 where it failed), ``ok``, ``y``,
    ``h_u`` (the event-time bank state), flattened to ``[n]``."""
    events = batch["events"].reshape(-1).numpy()
    neg = batch["neg_id"].reshape(-1).numpy()
    u, i = graph.rows(stream.src[events], stream.dst[events])
    j = torch.from_numpy(graph.item_row[np.clip(neg, 0, None)])
    ok = batch["neg_ok"].reshape(-1) & (j >= 0)
    h_u = batch["h_u"].reshape(len(events), -1)
    return {"u": u, "i": i, "j": j.clamp(min=0), "ok": ok, "y": batch["y"].reshape(-1), "h_u": h_u}


@dataclass
class FedGNN(FedTIP):
    """FedGNN (module docstring); :meth:`attach` builds the history graph.

    Args:
        lr: SGD's step (paper: 0.01). ldp_clip: :math:`\\delta`, the gradient norm bound
            (0.1). epsilon: the LDP budget :math:`\\epsilon` (1; ``0``: no noise).
        pseudo_items: pseudo-interacted items per upload (1000; at most the untouched).
        init: the item embeddings' start, ``bank`` (the frozen bank's states) or ``random``.
    """

    name: str = "fedgnn"
    prototype_bound = None  # a published baseline: without FedTIP's prototype bound
    mode: str = "fedgnn"
    aggregation: str = "fedavg"
    anchors: bool = False
    lambda_p: float = 0.0
    lr: float = 0.01
    ldp_clip: float = 0.1
    epsilon: float = 1.0
    pseudo_items: int = 1000
    init: str = "bank"
    modes = ("fedgnn",)
    tables = ("items",)  # the embedding tables the broadcast sends whole
    flower_nodes = False  # a Flower node would need the history graph: refused (ConfigError)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init not in ("bank", "random"):
            raise ValueError(f"algorithm.init must be bank or random, got {self.init!r}")
        self.graph: HistoryGraph | None = None
        self.stream: Any = None
        self.trained: tuple[str, Any] | None = None

    def attach(self, snapshot: Any, protocol: Any) -> dict[str, str]:
        """The history graph of the protocol's pre-training history, with the bank's states;
        returns its hash (recorded with the protocol's)."""
        self.graph, self.stream = history_graph(protocol, snapshot), protocol.stream
        return {"history_graph": self.graph.hash}

    def adapter(self, d_h: int, d_t: int, d_e: int) -> FedGNNModel:
        """The task's initial model (seeded by the task loop)."""
        return FedGNNModel(self.graph, self.init)

    def task_module(self, adapter: FedGNNModel, family: str) -> FedGNNClient:
        return FedGNNClient(adapter, family, lr=self.lr, clip=self.ldp_clip)

    def task_server(self, module: FedGNNClient) -> RowSparseServer:
        state = dict(module.model.named_parameters())
        return RowSparseServer(state, FAMILY_KEYS[module.family], ["items"], weighted=False)

    def dense_keys(self, model: nn.Module, family: str) -> tuple[str, ...]:
        """The dense parameters a family trains and sends (:data:`FAMILY_KEYS`)."""
        return FAMILY_KEYS[family]

    def start_state(
        self, model: nn.Module, family: str, broadcast: ServerBroadcast
    ) -> dict[str, Tensor]:
        """The round's global parameters: the dense ones (:meth:`dense_keys`, flattened in
        the broadcast's ``dense``) and the :attr:`tables`."""
        like = dict(model.named_parameters())
        dense = unflatten_keys(broadcast.tensors["dense"], like, self.dense_keys(model, family))
        return {**dense, **{t: broadcast.tensors[t] for t in self.tables}}

    def dense_size(self, family: str) -> int:
        """Values of the family's dense update (:data:`FAMILY_KEYS`)."""
        d = self.graph.item_state.size(1)
        return {"lp": 2 * (2 * d * d + d), "nc": 2 * d * d + d + d + 1}[family]

    def task_work(
        self,
        context: TaskContext,
        task: TaskBatches,
        family: str,
        module: FedGNNClient,
        broadcast: ServerBroadcast,
    ) -> ClientWork:
        """Each client's fit on its own, then its noisy upload (:meth:`upload`)."""
        r, start = broadcast.round, self.start_state(module.model, family, broadcast)

        def fit(client: Member) -> ClientUpdate:
            k = client.client_id
            module.receive(start)
            batch = event_rows(self.graph, self.stream, task.clients[k])
            manual_seed(derive_seed(context.seed, "fit", task.task, family, r, k))
            context.executor.fit(module, batch, context.epochs)
            gen = torch_generator(context.seed, "ldp", task.task, family, r, k)
            return self.upload(module, batch, start, r, k, gen)

        return ClientWork(one=fit, uplink=self.task_uplink(task, family, broadcast, 0))

    def touched(self, model: FedGNNModel, batch: dict[str, Tensor], family: str) -> Tensor:
        """The item rows a fit reads: the users' history items (and for link prediction the
        events' items and negatives)."""
        cols = model.user_items.neighbours(batch["u"])
        if family == "lp":
            cols = torch.cat([cols, batch["i"], batch["j"][batch["ok"]]])
        return torch.unique(cols)

    def upload(
        self,
        module: FedGNNClient,
        batch: dict[str, Tensor],
        start: dict[str, Tensor],
        round: int,
        client: int,
        gen: torch.Generator,
    ) -> ClientUpdate:
        """FedGNN's message: the dense update, the touched and pseudo-item rows (fake
        Gaussian updates for the pseudo ones), every value with Laplace noise; in round 1
        also ``expansion.idx``, the item ids sent for the graph expansion."""
        model, family = module.model, module.family
        keys = FAMILY_KEYS[family]
        with torch.no_grad():
            params = dict(model.named_parameters())
            dense = torch.cat([(params[k] - start[k]).reshape(-1) for k in keys])
            real = self.touched(model, batch, family)
            fake = pseudo_items(real, self.graph.num_items, self.pseudo_items, gen)
            rows_real = (params["items"] - start["items"])[real]
            rows = torch.cat([real, fake])
            order = rows.argsort()
            delta = torch.cat([rows_real, fake_gradients(rows_real, len(fake), gen)])[order]
            noisy = [
                ldp_update(x, self.lr, self.ldp_clip, self.epsilon, gen) for x in (dense, delta)
            ]
        tensors = {"dense": noisy[0], "items.idx": rows[order], "items.delta": noisy[1]}
        if round == 1:
            tensors["expansion.idx"] = real.clone()
        return ClientUpdate(
            round=round,
            client_id=client,
            tensors=tensors,
            scalars={"count": float(len(batch["u"]))},
        )

    def task_uplink(
        self,
        task: TaskBatches,
        family: str,
        broadcast: ServerBroadcast,
        width: int,
        field: str = "",
    ) -> MessageSpec:
        """``dense`` as the broadcast's; the table rows of :meth:`row_fields`; ``count`` the
        client's support size."""
        table, rows, also = self.row_fields(broadcast)

        def support(k: int) -> float:
            b = task.clients.get(k)
            return float(len(b["h_u"])) if b is not None else float("inf")

        declared = (
            Field("dense", dtype="like", like=lambda m: "dense"),
            *rows,
            Field("count", tensor=False, low=1.0, high=support, integral=True),
        )
        n_rows = broadcast.tensors[table].shape[0]

        def rows_fit(u: ClientUpdate) -> str | None:
            return row_upload_problem(u, table, n_rows, also=also)

        return MessageSpec(declared, rules=(Rule(rows_fit),), reference=broadcast)

    def row_fields(
        self, broadcast: ServerBroadcast
    ) -> tuple[str, tuple[Field, ...], tuple[str, ...]]:
        """The table whose rows a client sends, their fields, and the other index fields
        into it: ``items.idx`` distinct rows of the table with one ``items.delta`` row
        each; ``expansion.idx`` (round 1) rows of the table."""
        d = broadcast.tensors["items"].shape[1]
        fields = (
            Field("items.idx", shape=(-1,), dtype=torch.int64),
            Field("items.delta", shape=(-1, d)),
            Field("expansion.idx", shape=(-1,), dtype=torch.int64, required=False),
        )
        return "items", fields, ("expansion.idx",)

    def task_result(
        self, module: FedGNNClient, adapter: FedGNNModel, server: RowSparseServer
    ) -> tuple[ScoreView, dict[int, Tensor]]:
        """The global model (kept for :meth:`task_segments`) and the score view."""
        module.receive(server.state())
        self.trained = (module.family, module.model)
        return ScoreView(), ScoreView.prototypes()

    @torch.no_grad()
    def scores(self, model: FedGNNModel, batch: Batch, family: str) -> tuple[Tensor, Tensor | None]:
        model.eval()
        rows = event_rows(self.graph, self.stream, batch)
        out = fedgnn_forward(model, rows, family)
        return (out[0], None) if family == "nc" else (out[0], out[1])

    def task_segments(self, loop: TaskLoop, segments: dict[str, Batch]) -> dict[str, Batch]:
        """The server's segments scored by the task's global model (:class:`ScoreView`)."""
        family, model = self.trained
        return {s: scored_segment(b, *self.scores(model, b, family)) for s, b in segments.items()}

    def message_size(self, adapter: Any, family: str, classes: int = 2) -> int:
        """Float32 values of a message whose item rows cover the table (the pseudo-items
        reach every untouched row once ``pseudo_items`` >= the table): the dense update, a
        row id and ``d`` values per item, the count."""
        d = self.graph.item_state.size(1)
        rows = min(self.graph.num_items, self.pseudo_items)
        return self.dense_size(family) + rows * (d + 1) + 1
