"""FedGNN (Wu et al., arXiv 2102.04925) on FedTIP's protocol (docs/fedtip.md, "FedGNN"): the
GNN's update and touched plus pseudo item rows uploaded with Laplace noise, averaged row by
row; the server scores with the global model."""

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
from fedlightning.methods.temporal_base.temporal_base import TemporalMethod, support_size
from fedlightning.server.validation import Field, MessageSpec, Rule
from fedlightning.utils.seeding import derive_seed, manual_seed, torch_generator


def event_rows(graph: HistoryGraph, stream: Any, batch: Batch) -> dict[str, Tensor]:
    """An event batch as flat graph rows ``u``, ``i``, ``j`` (0 if failed), ``ok``, ``y``, ``h_u``."""
    events = batch["events"].reshape(-1).numpy()
    neg = batch["neg_id"].reshape(-1).numpy()
    u, i = graph.rows(stream.src[events], stream.dst[events])
    j = torch.from_numpy(graph.item_row[np.clip(neg, 0, None)])
    ok = batch["neg_ok"].reshape(-1) & (j >= 0)
    h_u = batch["h_u"].reshape(len(events), -1)
    return {"u": u, "i": i, "j": j.clamp(min=0), "ok": ok, "y": batch["y"].reshape(-1), "h_u": h_u}


@dataclass
class FedGNN(TemporalMethod):
    """FedGNN; ``ldp_clip``, ``epsilon``: the local DP (``0``: no noise); ``pseudo_items`` per
    upload; ``init``: the item table from the ``bank`` or ``random``."""

    name: str = "fedgnn"
    mode: str = "fedgnn"
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
        """The history graph; its hash joins the protocol's."""
        self.graph, self.stream = history_graph(protocol, snapshot), protocol.stream
        return {"history_graph": self.graph.hash}

    def adapter(self, d_h: int, d_t: int, d_e: int) -> FedGNNModel:
        return FedGNNModel(self.graph, self.init)

    def task_module(self, adapter: FedGNNModel, family: str) -> FedGNNClient:
        return FedGNNClient(adapter, family, lr=self.lr, clip=self.ldp_clip)

    def task_server(self, module: FedGNNClient) -> RowSparseServer:
        state = dict(module.model.named_parameters())
        return RowSparseServer(state, FAMILY_KEYS[module.family], ["items"], weighted=False)

    def dense_keys(self, model: nn.Module, family: str) -> tuple[str, ...]:
        return FAMILY_KEYS[family]

    def start_state(
        self, model: nn.Module, family: str, broadcast: ServerBroadcast
    ) -> dict[str, Tensor]:
        """The round's global dense parameters and :attr:`tables`."""
        like = dict(model.named_parameters())
        dense = unflatten_keys(broadcast.tensors["dense"], like, self.dense_keys(model, family))
        return {**dense, **{t: broadcast.tensors[t] for t in self.tables}}

    def dense_size(self, family: str) -> int:
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
        """The item rows a fit reads."""
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
        """FedGNN's noisy message: the dense update, the touched and pseudo-item rows; in
        round 1 also ``expansion.idx`` (the graph expansion's items)."""
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
        return ClientUpdate(round, tensors, {"count": float(len(batch["u"]))}, client_id=client)

    def task_uplink(
        self,
        task: TaskBatches,
        family: str,
        broadcast: ServerBroadcast,
        width: int,
        field: str = "",
    ) -> MessageSpec:
        """``dense``, the rows of :meth:`row_fields`, ``count`` within the support."""
        table, rows, also = self.row_fields(broadcast)
        declared = (
            Field("dense", dtype="like", like=lambda m: "dense"),
            *rows,
            Field("count", tensor=False, low=1.0, high=support_size(task), integral=True),
        )
        n_rows = broadcast.tensors[table].shape[0]

        def rows_fit(u: ClientUpdate) -> str | None:
            return row_upload_problem(u, table, n_rows, also=also)

        return MessageSpec(declared, rules=(Rule(rows_fit),), reference=broadcast)

    def row_fields(
        self, broadcast: ServerBroadcast
    ) -> tuple[str, tuple[Field, ...], tuple[str, ...]]:
        """The table whose rows a client sends, their fields, the other index fields."""
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
        family, model = self.trained
        return {s: scored_segment(b, *self.scores(model, b, family)) for s, b in segments.items()}

    def message_size(self, adapter: Any, family: str, classes: int = 2) -> int:
        """Float32 values of a message: the dense update, up to ``pseudo_items`` rows, count."""
        d = self.graph.item_state.size(1)
        rows = min(self.graph.num_items, self.pseudo_items)
        return self.dense_size(family) + rows * (d + 1) + 1
