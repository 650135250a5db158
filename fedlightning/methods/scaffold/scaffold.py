r"""SCAFFOLD: Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning, ICML 2020 (Algorithm 1, option II of line 12).

A client corrects every local gradient by :math:`c - c_i` (line 10), then updates its control
variate from the distance it travelled (line 12) and sends the change :math:`\Delta c_i` with
its model; the server averages the models (FedAvg's weighting, :math:`\eta_g = 1`) and moves
:math:`c` by :math:`\frac{1}{N}\sum_{i \in S} \Delta c_i` (line 17). Option II assumes plain SGD
steps, so the method refuses another local optimizer before any data loads.
"""

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
    r"""Option II of line 12: :math:`c_i^+ = c_i - c + \frac{1}{K \eta_l}(x - y_i)`, from the
    global weights ``x`` the client started at and its weights ``y`` after ``K`` local steps of
    size :math:`\eta_l`."""
    return ci - c + (x - y) / (steps * lr)


class ControlCorrection(pl.Callback):
    r"""Line 10: every local gradient :math:`g_i(y)` becomes :math:`g_i(y) - c_i + c`
    (``corrections[k]`` maps a parameter's name to client ``k``'s :math:`c - c_i`), before
    the optimizer step; on one client's module or, through :func:`client_grads`, on a stack
    of clients."""

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
    """SCAFFOLD with FedAvg's model average. Args: as :class:`FedAvg`'s (the bounds)."""

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
        """FedAvg's message and ``control_delta.<key>``, each as the broadcast's
        ``control.<key>`` (shape and dtype), every one of them."""
        plain = super().uplink(broadcast)
        delta = Field(
            re.escape(CONTROL_DELTA) + r"(.+)", dtype="like", like=lambda m: CONTROL + m[1]
        )
        rules = (*plain.rules, returns_every_control(broadcast))
        return MessageSpec((*plain.fields, delta), rules=rules, reference=broadcast)

    def downlink(self, global_state: dict) -> MessageSpec:
        """FedAvg's model fields and ``control.<key>``, one for each floating model entry,
        shaped and typed as it; nothing else."""
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
        """Lines 8-13: ``epochs`` corrected full-batch SGD steps from the global model, the new
        control variate (kept in the client's state) and its change sent with the model."""
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
    """The step size :math:`\\eta_l` of the local optimizer ``factory`` (``model.optimizer``,
    as the client module holds it), read from the optimizer it builds."""
    probe = factory([torch.nn.Parameter(torch.zeros(1))])
    return float(probe.param_groups[0]["lr"])
