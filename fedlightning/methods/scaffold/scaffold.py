"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1, option II of line 12; docs/architecture.md's
worked example): corrected local gradients, control variates and their change sent with the
model; plain SGD only."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from fedlightning.federation.algorithm import FederatedClient
from fedlightning.federation.stacking import client_grads
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.fedavg.fedavg import FedAvg
from fedlightning.methods.scaffold.scaffold_server import CONTROL, CONTROL_DELTA, ControlVariates
from fedlightning.server import Server
from fedlightning.server.aggregate import MODEL_PREFIX as MODEL
from fedlightning.server.aggregate import model_state, strip_prefix
from fedlightning.server.validation import Field, MessageSpec, Rule


def client_control(ci: Tensor, c: Tensor, x: Tensor, y: Tensor, steps: int, lr: float) -> Tensor:
    """Line 12, option II: ``c_i - c + (x - y) / (K lr)``."""
    return ci - c + (x - y) / (steps * lr)


class ControlCorrection(pl.Callback):
    """Line 10: each client's gradients plus its ``c - c_i`` (``corrections[k]``), on one
    module or a stack."""

    def __init__(self, *corrections: dict[str, Tensor]) -> None:
        self.corrections = corrections

    def on_after_backward(self, trainer: Any, pl_module: pl.LightningModule) -> None:
        for grads, correction in zip(client_grads(pl_module), self.corrections, strict=True):
            for name, g in grads.items():
                if name in correction:
                    g.add_(correction[name].to(g.device))


def returns_every_control(broadcast: ServerBroadcast) -> Rule:
    """Every broadcast ``control.<key>`` comes back as ``control_delta.<key>``."""
    want = [CONTROL_DELTA + k[len(CONTROL) :] for k in broadcast.tensors if k.startswith(CONTROL)]

    def check(update: ClientUpdate) -> str | None:
        missing = [k for k in want if k not in update.tensors]
        return (
            f"{missing[0]}: missing ({len(missing)} of the control variate's fields)"
            if missing
            else None
        )

    return Rule(check)


class Scaffold(FedAvg):
    """SCAFFOLD with FedAvg's model average."""

    name = "scaffold"

    def server(self, global_state: dict) -> Server:
        return Server(global_state, modules={"control": ControlVariates()}, **self.bounds())

    def check_optimizer(self, optimizer: Any) -> str | None:
        target = str(optimizer.get("_target_", ""))
        extra = {k: optimizer.get(k) for k in ("momentum", "weight_decay") if optimizer.get(k)}
        if target != "torch.optim.SGD" or extra:
            return (
                f"SCAFFOLD's control variates assume plain SGD steps (option II), got {target}"
                f"{' with ' + str(extra) if extra else ''}; its config sets torch.optim.SGD"
            )
        return None

    def uplink(self, broadcast: ServerBroadcast) -> MessageSpec:
        """FedAvg's message and every ``control_delta.<key>`` like ``control.<key>``."""
        plain = super().uplink(broadcast)
        delta = Field(
            re.escape(CONTROL_DELTA) + r"(.+)", dtype="like", like=lambda m: CONTROL + m[1]
        )
        rules = (*plain.rules, returns_every_control(broadcast))
        return MessageSpec((*plain.fields, delta), rules=rules, reference=broadcast)

    def downlink(self, global_state: dict) -> MessageSpec:
        """FedAvg's model fields and ``control.<key>`` like each model entry."""
        plain = super().downlink(global_state)
        control = Field(re.escape(CONTROL) + r"(.+)", dtype="like", like=lambda m: MODEL + m[1])
        return replace(plain, fields=(plain.fields[0], control))

    def local_fit(
        self,
        module: pl.LightningModule,
        client: FederatedClient,
        broadcast: ServerBroadcast,
        executor: Any,
        epochs: int,
    ) -> ClientUpdate:
        """Lines 8-13: corrected SGD steps, the new control variate kept, its change sent."""
        x = model_state(broadcast.tensors)
        c = strip_prefix(broadcast.tensors, CONTROL)
        ci = client.state.get("control") or {k: torch.zeros_like(v) for k, v in c.items()}
        module.receive(x)
        trained = dict(module.net.named_parameters())
        correction = {k: c[k] - ci[k] for k in c if k in trained}
        executor.fit(
            module, client.data, epochs, [*self.callbacks(), ControlCorrection(correction)]
        )
        update = self.make_update(module, client, broadcast.round)
        y, lr = module.net.state_dict(), learning_rate(module.optimizer_factory)
        new = {
            k: client_control(ci[k], c[k], x[k], y[k].detach(), epochs, lr)
            if k in trained
            else ci[k]
            for k in c
        }
        update.tensors.update({CONTROL_DELTA + k: new[k] - ci[k] for k in c})
        client.state["control"] = new
        return update


def learning_rate(factory: Any) -> float:
    """The local optimizer's step size, read from one it builds."""
    probe = factory([torch.nn.Parameter(torch.zeros(1))])
    return float(probe.param_groups[0]["lr"])
