"""Full-model FedAvg, FedTIP's uplink comparator (paper 001, Table 3 and Sec. 5.4): the bank's
encoder fine-tuned with the adapter, the segments re-streamed with the task's encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedlightning.clients.temporal_prompt import as_single
from fedlightning.data.temporal.manifest import DOWN_VAL, TEST
from fedlightning.federation.round import ClientWork
from fedlightning.federation.task_loop import (
    Batch,
    Member,
    TaskBatches,
    TaskContext,
    TaskLoop,
)
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.methods.fulltune.fulltune_client import FullTuneClient
from fedlightning.server.reliability import FedTIPServer, unflatten
from fedlightning.temporal.adapter import PromptAdapter
from fedlightning.temporal.contexts import event_batch, fork, stream_contexts
from fedlightning.temporal.encoders import time_encoder
from fedlightning.utils.seeding import derive_seed, manual_seed


def model_update(
    context: TaskContext,
    task: TaskBatches,
    family: str,
    module: Any,
    model: nn.Module,
    omega: dict[str, Tensor],
    round: int,
    client: int,
) -> ClientUpdate:
    """One client's whole-model Eq. (2) message after its fit from ``omega``: ``model``'s
    delta, class counts, class means (``nc``)."""
    module.receive(omega)
    manual_seed(derive_seed(context.seed, "fit", task.task, family, round, client))
    context.executor.fit(module, task.clients[client], context.epochs)
    q, counts = module.prototypes(task.clients[client])
    delta = torch.cat([(p.detach() - omega[n]).reshape(-1) for n, p in model.named_parameters()])
    observed = {c: int(n) for c, n in enumerate(counts.tolist()) if n > 0}
    tensors = {"delta": delta}
    if family == "nc":
        tensors.update({f"proto.{c}": q[c].clone() for c in observed})
    scalars = {f"count.{c}": float(n) for c, n in observed.items()}
    return ClientUpdate(round, tensors, scalars, client_id=client)


def fedavg_server(model: nn.Module) -> FedTIPServer:
    """Support-weighted FedAvg of ``model``'s parameters, sent whole as ``model``."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    return FedTIPServer(start, 1.0, reliability_weights=False, anchors=False, field="model")


@dataclass
class FullTuneFedAvg(FedTIP):
    """``fulltune_fedavg``: FedTIP's adapter (its settings: ``bottleneck``, ``rank``,
    ``template``, ...) fitted with the bank's encoder; ``encoder_lr``: the encoder's step."""

    name: str = "fulltune_fedavg"
    mode: str = "fulltune"
    aggregation: str = "fedavg"
    anchors: bool = False
    lambda_p: float = 0.0
    encoder_lr: float = 1e-4
    modes = ("fulltune",)
    secure_sums = False  # its task server is a plain FedAvg of the whole model

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tuned: Any = None

    def task_module(self, adapter: PromptAdapter, family: str) -> FullTuneClient:
        return FullTuneClient(
            fork(self.snapshot), self.snapshot, adapter, self.protocol.stream, family,
            tau=self.tau, lr=self.lr, encoder_lr=self.encoder_lr, weight_decay=self.weight_decay,
        )  # fmt: skip

    def task_server(self, module: FullTuneClient) -> FedTIPServer:
        return fedavg_server(module)

    def task_work(
        self,
        context: TaskContext,
        task: TaskBatches,
        family: str,
        module: FullTuneClient,
        broadcast: ServerBroadcast,
    ) -> ClientWork:
        shapes = {n: p.shape for n, p in module.named_parameters()}
        omega = unflatten(broadcast.tensors["model"], shapes)
        r = broadcast.round

        def fit(client: Member) -> ClientUpdate:
            return model_update(context, task, family, module, module, omega, r, client.client_id)

        uplink = self.task_uplink(task, family, broadcast, module.adapter.d_h, field="model")
        return ClientWork(one=fit, uplink=uplink)

    def task_result(
        self, module: FullTuneClient, adapter: PromptAdapter, server: FedTIPServer
    ) -> tuple[PromptAdapter, dict[int, Tensor]]:
        module.receive(server.state())
        self.tuned = module.encoder
        return module.adapter, server.class_prototypes()

    def task_segments(self, loop: TaskLoop, segments: dict[str, Batch]) -> dict[str, Batch]:
        enc = fork(self.snapshot)
        enc.load_state_dict(
            {k: v for k, v in self.tuned.state_dict().items() if k in dict(enc.named_parameters())},
            strict=False,
        )
        enc.eval()
        te, neg, stream = time_encoder(enc), self.protocol.negatives["eval"], self.protocol.stream
        out = {}
        for split, name, outcome in (("val", "down_val", DOWN_VAL), ("test", "test", TEST)):
            events = self.protocol.manifest.indices(outcome)
            ctx = stream_contexts(enc, stream, events, np.asarray(neg[name]))
            inductive = self.protocol.manifest.inductive if split == "test" else None
            out[split] = as_single(event_batch(ctx, stream, te, np.asarray(neg[name]), inductive))
        return out
