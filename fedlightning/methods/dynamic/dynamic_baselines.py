"""What Feddy, STFL and FedDGL share (docs/fedtip.md, "Published baselines"): the hashed
snapshot view of the history, per-event inputs from it, a stacked local fit, support-weighted
FedAvg of the whole model, the server's segments scored by the task's global model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning.clients.temporal_prompt import stack_batches
from fedlightning.federation.round import ClientWork
from fedlightning.federation.task_loop import Batch, TaskBatches, TaskContext, TaskLoop
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.dynamic.dynamic_client import DynamicBaselineClient
from fedlightning.methods.dynamic.dynamic_model import StackedNet
from fedlightning.methods.dynamic.snapshots import SnapshotView, snapshot_view
from fedlightning.methods.fulltune.fulltune import fedavg_server
from fedlightning.methods.history.graph_task import event_nodes
from fedlightning.methods.temporal_base.temporal_base import TemporalMethod
from fedlightning.server.reliability import FedTIPServer, unflatten
from fedlightning.utils.seeding import derive_seed, manual_seed

SIDES = {"u": "src", "i": "dst", "j": "neg"}


@dataclass
class DynamicBaseline(TemporalMethod):
    """The shared part; ``windows``, ``recent``: the snapshot view's; ``hidden``: the net's."""

    name: str = "dynamic_baseline"
    windows: int = 10
    recent: int = 5
    hidden: int = 128
    modes = ("federated",)
    flower_nodes = False  # a Flower node does not build the history view: refused up front

    def __post_init__(self) -> None:
        super().__post_init__()
        self.view: SnapshotView | None = None
        self._segments: dict[str, Batch] | None = None
        self._stacks: dict[tuple[int, ...], Batch] = {}
        self._stacks_task: int | None = None

    # ------------------------------------------------------------------ the history view
    def attach(self, snapshot: Any, protocol: Any) -> None:
        super().attach(snapshot, protocol)
        self._segments, self._stacks, self._stacks_task = None, {}, None

    def materialize_views(self, cache_dir: Any = None) -> dict[str, str]:
        """The history's snapshot view (built per run); its hash joins the protocol's."""
        self.view = snapshot_view(
            self.snapshot, self.protocol.stream, self.protocol.manifest, self.windows, self.recent
        )
        return {"history_view": self.view.hash}

    def event_inputs(self, nodes: dict[str, Tensor]) -> Batch:
        """The method's per-event inputs from the view for the sides' ``nodes``."""
        raise NotImplementedError

    def augmented(self, batch: Batch) -> Batch:
        """``batch`` with :meth:`event_inputs` of its events."""
        nodes = event_nodes(self.protocol.stream.src, self.protocol.stream.dst, batch)
        return {**batch, **self.event_inputs(dict(zip("uij", nodes, strict=True)))}

    # ------------------------------------------------------------------ task verbs
    def net(self, d_h: int) -> StackedNet:
        raise NotImplementedError

    def adapter(self, d_h: int, d_t: int, d_e: int) -> StackedNet:
        return self.net(d_h)

    def task_module(self, adapter: StackedNet, family: str) -> DynamicBaselineClient:
        return DynamicBaselineClient(
            adapter, family, tau=self.tau, lr=self.lr, weight_decay=self.weight_decay,
            **self.client_terms(),
        )  # fmt: skip

    def client_terms(self) -> dict[str, float]:
        """The method's own loss weights (:class:`DynamicBaselineClient`'s)."""
        return {}

    def task_server(self, module: DynamicBaselineClient) -> FedTIPServer:
        return fedavg_server(module.net)

    def client_extras(self, context: TaskContext, clients: list[int]) -> Batch:
        """The method's per-client inputs for a stack of ``clients`` (none by default)."""
        return {}

    def starts(
        self, broadcast: ServerBroadcast, module: DynamicBaselineClient, clients: list[int]
    ) -> list[dict[str, Tensor]]:
        """Each client's starting model: the broadcast global one (FedAvg)."""
        shapes = {n: p.shape[1:] for n, p in module.net.named_parameters()}
        omega = unflatten(broadcast.tensors["model"], {n: (1, *s) for n, s in shapes.items()})
        return [omega] * len(clients)

    def task_work(
        self,
        context: TaskContext,
        task: TaskBatches,
        family: str,
        module: DynamicBaselineClient,
        broadcast: ServerBroadcast,
    ) -> ClientWork:
        """The round's clients fitted as one stack."""

        def fit(share: range) -> list[ClientUpdate]:
            mine = [task.active[i] for i in share]
            starts = self.starts(broadcast, module, mine)
            module.receive(starts, self.client_extras(context, mine))
            stack = self.client_stack(task, mine)
            manual_seed(derive_seed(context.seed, "fit", task.task, family, broadcast.round))
            context.executor.fit(module, stack, context.epochs)
            return self.updates(module, stack, starts, broadcast, mine)

        uplink = self.task_uplink(task, family, broadcast, module.net.d_h, field="model")
        return ClientWork(share=fit, uplink=uplink)

    def client_stack(self, task: TaskBatches, clients: list[int]) -> Batch:
        """The stacked supports of ``clients`` with the method's inputs, once per task."""
        if self._stacks_task != task.task:
            self._stacks, self._stacks_task = {}, task.task
        key = tuple(clients)
        if key not in self._stacks:
            rows = [self.augmented(task.clients[k]) for k in clients]
            self._stacks[key] = stack_batches(rows, task.longest)
        return self._stacks[key]

    def updates(
        self,
        module: DynamicBaselineClient,
        stack: Batch,
        starts: list[dict[str, Tensor]],
        broadcast: ServerBroadcast,
        clients: list[int],
    ) -> list[ClientUpdate]:
        """Each client's message: the model's delta, class counts, prototypes if sent."""
        q, counts = module.prototypes(stack)
        omega = broadcast.tensors["model"]
        fields = self.message_fields(module.family)
        out = []
        for k, client in enumerate(clients):
            theta = torch.cat([p.reshape(-1) for p in module.net.copy_state(k).values()])
            observed = {c: int(n) for c, n in enumerate(counts[k].tolist()) if n > 0}
            tensors = {"delta": theta - omega}
            if "prototypes" in fields:
                tensors.update({f"proto.{c}": q[k, c].clone() for c in observed})
            scalars = {f"count.{c}": float(n) for c, n in observed.items()}
            out.append(ClientUpdate(broadcast.round, tensors, scalars, client_id=client))
        self.after_fit(module, clients)
        return out

    def after_fit(self, module: DynamicBaselineClient, clients: list[int]) -> None:
        """Client-side state kept after a fit (none by default; copy ``k`` is ``clients[k]``)."""

    def task_result(
        self, module: DynamicBaselineClient, adapter: StackedNet, server: Any
    ) -> tuple[StackedNet, dict[int, Tensor]]:
        adapter.load_copies([server.state()])
        return adapter, server.class_prototypes()

    def task_segments(self, loop: TaskLoop, segments: dict[str, Batch]) -> dict[str, Batch]:
        """The server's segments with the method's inputs (computed once per run)."""
        if self._segments is None:
            self._segments = {k: self.augmented(b) for k, b in segments.items()}
        return self._segments

    # ------------------------------------------------------------------ view lookups
    def snapshot_means(self, nodes: dict[str, Tensor], back: int) -> dict[str, Tensor]:
        """The neighbour means of the window ``back`` from the last, by side."""
        w = self.view.windows - 1 - back
        return {s: self.view.means[w][v] for s, v in nodes.items()}


def stack_rows(rows: list[Batch]) -> Batch:
    """Per-client tables [M_k, ...] zero-padded to [K, M, ...] with their ``mask``."""
    m = max(1, *(len(next(iter(r.values()))) for r in rows))
    out = {}
    for key in rows[0]:
        v = rows[0][key]
        out[key] = torch.zeros((len(rows), m, *v.shape[1:]), dtype=v.dtype)
        for k, r in enumerate(rows):
            out[key][k, : len(r[key])] = r[key]
    out["mask"] = torch.zeros(len(rows), m)
    for k, r in enumerate(rows):
        out["mask"][k, : len(next(iter(r.values())))] = 1.0
    return out


def client_nodes(owner: np.ndarray, client: int) -> np.ndarray:
    """The users client ``client`` owns."""
    return np.flatnonzero(owner == client)
