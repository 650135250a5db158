"""FedLink (Yao et al., NeurIPS 2025 workshop) on FedTIP's protocol (docs/fedtip.md,
"FedLink"): a heterogeneous GraphSAGE over chronological buffers, FedAvg of every parameter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning.federation.round import ClientWork
from fedlightning.federation.task_loop import Batch, Member, TaskBatches, TaskContext
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fedgnn.fedgnn import FedGNN, event_rows
from fedlightning.methods.fedgnn.fedgnn_server import RowSparseServer
from fedlightning.methods.fedlink.fedlink_client import FedLinkClient, dense_keys, fedlink_forward
from fedlightning.methods.fedlink.fedlink_model import (
    FedLinkModel,
    chronological_buffers,
    local_adjacency,
)
from fedlightning.server.validation import Field
from fedlightning.utils.seeding import derive_seed, manual_seed


@dataclass
class FedLink(FedGNN):
    """FedLink; ``buffer_size``: events per buffer; ``layers``: GraphSAGE's."""

    name: str = "fedlink"
    mode: str = "fedlink"
    lr: float = 1e-3
    buffer_size: int = 2
    layers: int = 2
    modes = ("fedlink",)
    tables = ("items", "users")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.buffer_size < 1:
            raise ValueError(f"algorithm.buffer_size must be >= 1, got {self.buffer_size}")
        self._buffers: tuple[Any, dict[int, Any]] = (None, {})  # task -> client -> buffers

    def adapter(self, d_h: int, d_t: int, d_e: int) -> FedLinkModel:
        return FedLinkModel(self.graph, self.init, self.layers)

    def task_module(self, adapter: FedLinkModel, family: str) -> FedLinkClient:
        return FedLinkClient(adapter, family, lr=self.lr)

    def dense_keys(self, model: FedLinkModel, family: str) -> tuple[str, ...]:
        return dense_keys(model, family)

    def task_server(self, module: FedLinkClient) -> RowSparseServer:
        state = dict(module.model.named_parameters())
        keys = dense_keys(module.model, module.family)
        return RowSparseServer(state, keys, ["items", "users"], weighted=True)

    def local_users(self, client: int) -> Tensor:
        owner = np.asarray(self.protocol_owner)[self.graph.user_ids]
        return torch.from_numpy(np.flatnonzero(owner == client))

    def attach(self, snapshot: Any, protocol: Any) -> dict[str, str]:
        out = super().attach(snapshot, protocol)
        self.protocol_owner = protocol.ownership.owner
        return out

    def client_buffers(self, client: int, batch: Batch) -> tuple[Tensor, list[dict[str, Tensor]]]:
        """The client's user rows and its buffers, each with its local graph so far."""
        g = self.graph
        rows = self.local_users(client)
        ev = event_rows(g, self.stream, batch)
        local = torch.full((g.num_users,), -1, dtype=torch.long)
        extra = ev["u"][local[ev["u"]] < 0] if len(rows) else ev["u"]
        rows = torch.unique(torch.cat([rows, extra]))  # a support user it does not own: kept
        local[rows] = torch.arange(len(rows))
        mine = g.owner == client
        hist_u, hist_i = local[torch.from_numpy(g.edge_u[mine])].numpy(), g.edge_i[mine]
        keep = hist_u >= 0
        hist_u, hist_i = hist_u[keep], hist_i[keep]
        u_loc = local[ev["u"]]
        out = []
        for pos in chronological_buffers(len(u_loc), self.buffer_size):
            before = slice(0, int(pos[0]))
            a_ui, a_iu = local_adjacency(
                hist_u,
                hist_i,
                u_loc[before].numpy(),
                ev["i"][before].numpy(),
                len(rows),
                g.num_items,
            )
            p = torch.from_numpy(pos)
            out.append({"a_ui": a_ui, "a_iu": a_iu, "rows": rows, "u": u_loc[p], "i": ev["i"][p],
                        "j": ev["j"][p], "ok": ev["ok"][p], "y": ev["y"][p]})  # fmt: skip
        return rows, out

    def task_work(
        self,
        context: TaskContext,
        task: TaskBatches,
        family: str,
        module: FedLinkClient,
        broadcast: ServerBroadcast,
    ) -> ClientWork:
        r, model = broadcast.round, module.model
        keys, start = self.dense_keys(model, family), self.start_state(model, family, broadcast)

        def fit(client: Member) -> ClientUpdate:
            k = client.client_id
            module.receive(start)
            if self._buffers[0] != task.task:  # the same every round and family of a task
                self._buffers = (task.task, {})
            kept = self._buffers[1]
            if k not in kept:
                kept[k] = self.client_buffers(k, task.clients[k])
            rows, buffers = kept[k]
            manual_seed(derive_seed(context.seed, "fit", task.task, family, r, k))
            context.executor.fit(module, {"buffers": buffers}, context.epochs)
            with torch.no_grad():
                p = dict(model.named_parameters())
                dense = torch.cat([(p[n] - start[n]).reshape(-1) for n in keys])
                tensors = {
                    "dense": dense,
                    "items.delta": p["items"] - start["items"],
                    "users.idx": rows.clone(),
                    "users.delta": (p["users"] - start["users"])[rows],
                }
            n = float(len(task.clients[k]["h_u"]))
            return ClientUpdate(round=r, client_id=k, tensors=tensors, scalars={"count": n})

        return ClientWork(one=fit, uplink=self.task_uplink(task, family, broadcast, 0))

    def row_fields(
        self, broadcast: ServerBroadcast
    ) -> tuple[str, tuple[Field, ...], tuple[str, ...]]:
        d = broadcast.tensors["users"].shape[1]
        fields = (
            Field("items.delta", dtype="like", like=lambda m: "items"),
            Field("users.idx", shape=(-1,), dtype=torch.int64),
            Field("users.delta", shape=(-1, d)),
        )
        return "users", fields, ()

    @torch.no_grad()
    def scores(
        self, model: FedLinkModel, batch: Batch, family: str
    ) -> tuple[Tensor, Tensor | None]:
        model.eval()
        g = self.graph
        full = {"a_ui": g.adjacency().all(), "a_iu": g.adjacency(items_to_users=True).all()}
        rows = event_rows(g, self.stream, batch)
        out = fedlink_forward(model, {**full, **rows}, family)
        return (out[0], None) if family == "nc" else (out[0], out[1])

    def dense_size(self, family: str) -> int:
        d, layers = self.graph.item_state.size(1), self.layers
        return layers * 2 * (2 * d * d + d) + (d + 1 if family == "nc" else 0)

    def message_size(self, adapter: Any, family: str, classes: int = 2) -> int:
        """Float32 values of the largest client's message."""
        d = self.graph.item_state.size(1)
        owner = np.asarray(self.protocol_owner)[self.graph.user_ids]
        most = int(np.bincount(owner[owner >= 0]).max()) if (owner >= 0).any() else 0
        return self.dense_size(family) + self.graph.num_items * d + most * (d + 1) + 1
