"""The full-model FedAvg comparator's task loop (paper 001, Table 3 and Sec. 5.4).

As :class:`~fedlightning.federation.fedtip.TaskLoop`, but every client fine-tunes the bank's
encoder with the adapter (:class:`~fedlightning.clients.fulltune.FullTuneClient`), the
server averages the whole model weighted by support size (FedAvg), and the message is the
whole model's delta with the class counts (and the prototypes node classification is
scored against). Since the encoder changes, the server re-streams its validation and test
segments from the bank's snapshot with the task's final encoder before scoring them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning.clients.fulltune import FullTuneClient
from fedlightning.data.temporal.manifest import DOWN_VAL, TEST
from fedlightning.federation.fedtip import (
    Batch,
    Member,
    TaskBatches,
    TaskLoop,
    as_single,
    members,
    prefixed,
)
from fedlightning.federation.ledger import DOWN, CommLedger
from fedlightning.federation.messages import ClientUpdate, ServerBroadcast
from fedlightning.server.fedtip import FedTIPServer
from fedlightning.temporal.adapter import PromptAdapter
from fedlightning.temporal.contexts import event_batch, fork, stream_contexts
from fedlightning.temporal.encoders import time_encoder
from fedlightning.utils.seeding import derive_seed


class FullTuneLoop(TaskLoop):
    """The task loop of ``fulltune_fedavg``.

    Args:
        snapshot: the bank's frozen snapshot encoder. protocol: the temporal protocol (the
            server's segments and their negatives). Others: as :class:`TaskLoop`.
    """

    def __init__(self, *args: Any, snapshot: Any, protocol: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.snapshot, self.protocol = snapshot, protocol
        self.tuned: Any = None

    def federate(
        self, task: TaskBatches, family: str, ledger: CommLedger
    ) -> tuple[PromptAdapter, dict[int, Tensor]]:
        alg = self.algorithm
        adapter = self.new_adapter(task, family)
        module = FullTuneClient(
            fork(self.snapshot), self.snapshot, adapter, self.protocol.stream, family,
            tau=alg.tau, lr=alg.lr, encoder_lr=alg.encoder_lr, weight_decay=alg.weight_decay,
        )  # fmt: skip
        start = {n: p.detach().clone() for n, p in module.named_parameters()}
        server = FedTIPServer(start, eta_s=1.0, reliability_weights=False, anchors=False)
        executor = self.runner.executor
        for r in range(1, self.rounds + 1):
            omega, _ = server.broadcast()
            down = prefixed(ServerBroadcast(r, {"model": server.omega}), family)
            for k in task.clients:
                ledger.record(DOWN, k, down)

            def fit(client: Member, r: int = r, omega: dict = omega) -> ClientUpdate:
                k = client.client_id
                module.receive(omega)
                torch.manual_seed(derive_seed(self.seed, "fit", task.task, family, r, k))
                executor.fit(module, task.clients[k], self.epochs)
                q, counts = module.prototypes(task.clients[k])
                delta = torch.cat(
                    [(p.detach() - omega[n]).reshape(-1) for n, p in module.named_parameters()]
                )
                observed = {c: int(n) for c, n in enumerate(counts.tolist()) if n > 0}
                tensors = {"delta": delta}
                if family == "nc":
                    tensors.update({f"proto.{c}": q[c].clone() for c in observed})
                return ClientUpdate(
                    round=r, client_id=k, tensors=tensors,
                    scalars={f"count.{c}": float(n) for c, n in observed.items()},
                )  # fmt: skip

            updates = self.runner.run_round(r, members(task.clients), fit, desc=f"round {r}")
            self.message_values[family] = updates[-1].num_values()  # the round's last
            self.server_step(server, updates, family, ledger)
        module.receive(server.state())
        self.tuned = module.encoder
        return module.adapter, server.class_prototypes()

    def segments(self) -> dict[str, Batch]:
        """The validation and test segments streamed with the task's fine-tuned encoder."""
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
