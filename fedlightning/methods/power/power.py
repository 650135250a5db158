"""POWER (Zhu, Hu and Wu, KDD 2025; docs/fedogl.md, "POWER"): coverage replay and class
gradients of a shared encoder on the clients, reconstruction and distillation on the server."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning.clients.replay import class_balanced_sample
from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.continual.continual import ContinualFedAvg
from fedlightning.methods.power.power_client import (
    PowerNodeClassifier,
    coverage_max,
    fused_input,
    pseudo_graph,
)
from fedlightning.methods.power.power_server import (
    COUNT_PREFIX,
    GRAD_PREFIX,
    PowerMemory,
    class_gradient,
    ge_parameters,
)
from fedlightning.server import Server
from fedlightning.server.aggregate import model_state
from fedlightning.server.validation import Field, MessageSpec, Rule
from fedlightning.utils.seeding import torch_generator


class POWER(ContinualFedAvg):
    """POWER; ``coverage`` and ``server_kd`` switch coverage replay and the server's
    reconstruction and distillation (settings: docs/fedogl.md, "POWER")."""

    RECON_DEFAULTS = {"steps": 20, "max_iter": 20, "lr": 1.0, "keep": 1}

    def __init__(
        self,
        replay_per_class: int = 1,
        coverage: bool = True,
        eta: float = 0.1,
        alpha: float = 0.5,
        beta: float = 0.01,
        server_kd: bool = True,
        decay: float = 0.3,
        server_lr: float = 0.01,
        server_epochs: int = 3,
        server_weight_decay: float = 5e-4,
        recon: dict | None = None,
        score: str = "msp",
        max_update_norm: float | None = None,
        max_client_weight: float | None = None,
    ) -> None:
        off = [n for n, on in (("coverage", coverage), ("server_kd", server_kd)) if not on]
        super().__init__(
            name="power",
            variant="full" if not off else "no_" + "_no_".join(off),
            replay_budget=replay_per_class,
            score=score,
            max_update_norm=max_update_norm,
            max_client_weight=max_client_weight,
        )
        for key, value, low, high in (
            ("eta", eta, 0.0, None),
            ("alpha", alpha, 0.0, 1.0),
            ("beta", beta, 0.0, 1.0),
            ("decay", decay, 0.0, None),
            ("server_lr", server_lr, 0.0, None),
            ("server_epochs", server_epochs, 0.0, None),
        ):
            if value < low or (high is not None and value > high):
                want = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
                raise ConfigError(f"algorithm.{key}", f"must be {want}, got {value}")
        self.recon = {**self.RECON_DEFAULTS, **dict(recon or {})}
        unknown = sorted(set(self.recon) - set(self.RECON_DEFAULTS))
        if unknown:
            raise ConfigError(f"algorithm.recon.{unknown[0]}", f"unknown; keys: {sorted(self.RECON_DEFAULTS)}")  # fmt: skip
        if int(self.recon["keep"]) < 1 or int(self.recon["keep"]) > int(self.recon["steps"]):
            raise ConfigError("algorithm.recon.keep", "must be in [1, recon.steps]")
        self.coverage, self.eta, self.alpha, self.beta = coverage, eta, alpha, beta
        self.server_kd, self.decay = server_kd, decay
        self.server_lr, self.server_epochs = server_lr, int(server_epochs)
        self.server_weight_decay = server_weight_decay
        self.dims: dict[str, int] = {}
        self.classes = 0
        self._net: nn.Module | None = None  # the architecture, for the server and selection
        self._ge: tuple[int, dict[str, Tensor]] | None = None

    # ---------------------------------------------------------------- wiring
    def client_module(self, net: nn.Module, optimizer: Any) -> PowerNodeClassifier:
        encoders = getattr(getattr(net, "encoders", None), "encoders", None)
        if encoders is None or not hasattr(net, "head") or not hasattr(net, "embed"):
            raise ConfigError(
                "model",
                f"POWER needs a multimodal node classifier (model=multimodal_gnn), got "
                f"{type(net).__name__}",
            )
        self.dims = {m: int(encoders[m].in_features) for m in net.modalities}
        self.classes = int(net.head.out_features)
        self._net = copy.deepcopy(net)
        return PowerNodeClassifier(net, optimizer, beta=self.beta)

    def ge(self) -> dict[str, Tensor]:
        """The run's shared gradient encoder, drawn from ``(seed, "power_ge")``."""
        if self._ge is None or self._ge[0] != self.seed:
            g = torch_generator(self.seed, "power_ge")
            self._ge = (self.seed, ge_parameters(sum(self.dims.values()), self.classes, g))
        return self._ge[1]

    def server(self, global_state: dict) -> Server:
        if not self.server_kd:
            return Server(global_state, **self.bounds())
        if self._net is None:
            raise RuntimeError("client_module(net, ...) names the architecture; call it first")
        memory = PowerMemory(
            self._net,
            lambda x: pseudo_graph(x, self.dims),
            self.ge,
            self.stage_of,
            lambda r, k, j: torch_generator(self.seed, "power_recon", r, k, j),
            decay=self.decay,
            lr=self.server_lr,
            epochs=self.server_epochs,
            weight_decay=self.server_weight_decay,
            recon=self.recon,
        )
        return Server(global_state, modules={"power": memory}, **self.bounds())

    def stage_start(self, round: int) -> bool:
        """The first round of a stage: the round of the gradient upload."""
        return (round - 1) % self.rounds_per_stage == 0

    # ---------------------------------------------------------------- declared messages
    def uplink(self, broadcast: ServerBroadcast) -> MessageSpec:
        """FedAvg's fields and, in a stage's first round, whole slots ``power_grad.<j>.*`` with
        ``power_count.<j>`` summing to at most ``num_examples``."""
        spec = super().uplink(broadcast)
        if not self.server_kd or not self.stage_start(broadcast.round):
            return spec
        fields = [
            Field(
                re.escape(f"{GRAD_PREFIX}") + r"\d+\." + re.escape(k),
                shape=tuple(v.shape),
                required=False,
            )  # fmt: skip
            for k, v in self.ge().items()
        ]
        fields.append(Field(re.escape(COUNT_PREFIX) + r"\d+", tensor=False, low=1.0,
                            integral=True, required=False))  # fmt: skip
        names = tuple(self.ge())
        rule = Rule(lambda u: _whole_slots(u, names), reads=(r"power_count\..+", "num_examples"))
        return MessageSpec((*spec.fields, *fields), rules=(*spec.rules, rule), reference=broadcast)

    # ---------------------------------------------------------------- client side
    def begin_stage(self, client: FederatedClient, t: int, global_state: dict) -> None:
        """A past stage without a buffer gets one selected on the global model alone."""
        memory: dict[int, Tensor] = client.state.setdefault("replay", {})
        for s in range(t):
            if s not in memory:
                memory[s] = self.select(client, s, global_state, None)
        client.state["stage"] = t

    def finish(
        self, module: Any, client: FederatedClient, broadcast: ServerBroadcast, batch: Any
    ) -> ClientUpdate:
        """The FedAvg update; a stage's first round adds the class gradients, its last
        selects the stage's buffer."""
        update = super().finish(module, client, broadcast, batch)
        t = self.stage_of(broadcast.round)
        if self.server_kd and self.stage_start(broadcast.round):
            self.add_gradients(client, t, update)
        if broadcast.round % self.rounds_per_stage == 0:
            global_state = model_state(broadcast.tensors)
            client.state.setdefault("replay", {})[t] = self.select(
                client, t, global_state, module.net
            )
        return update

    def add_gradients(self, client: FederatedClient, t: int, update: ClientUpdate) -> None:
        """Per observed class (slot ``j``): GE's gradient at its fused-input mean, its count."""
        data = client.data
        sup = data.train_mask & torch.isin(data.y, self.supervised_classes(client.client_id, t))
        j = 0
        for c in sorted(self.stream.observed[client.client_id][t]):
            nodes = (sup & (data.y == c)).nonzero().view(-1)
            if nodes.numel() == 0:
                continue
            proto = fused_input(data, list(self.dims), nodes).mean(0)
            for k, g in class_gradient(self.ge(), proto, int(c)).items():
                update.tensors[f"{GRAD_PREFIX}{j}.{k}"] = g.detach().clone()
            update.scalars[f"{COUNT_PREFIX}{j}"] = float(nodes.numel())
            j += 1

    @torch.no_grad()
    def embed(self, state: dict, batch: Any) -> Tensor:
        """The fused representation ``z`` of ``batch`` under weights ``state`` (eval mode)."""
        net = self._net
        net.load_state_dict(state)
        net.eval()
        return net.embed(batch)

    def select(
        self, client: FederatedClient, s: int, global_state: dict, local: nn.Module | None
    ) -> Tensor:
        """Stage ``s``'s buffer (node ids): per class, ``replay_budget`` nodes by
        :func:`coverage_max` on the ``alpha``-mixed local and global embeddings."""
        data = client.data
        batch = self.batch_at(client, s, replay=False)
        ids = torch.isin(data.y, torch.tensor(self.stream.known(s))).nonzero().view(-1)
        nodes = batch.sup_mask.nonzero().view(-1)
        if not self.coverage or nodes.numel() == 0:
            gen = torch_generator(self.seed, "replay", client.client_id, s)
            return class_balanced_sample(ids[nodes], batch.y[nodes], self.replay_budget, gen)
        emb = self.embed(global_state, batch)
        if local is not None:
            was = local.training
            local.eval()
            with torch.no_grad():
                emb = self.alpha * local.embed(batch) + (1 - self.alpha) * emb
            local.train(was)
        picks = []
        for c in batch.y[nodes].unique(sorted=True).tolist():
            pos = nodes[batch.y[nodes] == c]
            picks.append(ids[pos[coverage_max(emb[pos], self.replay_budget, self.eta)]])
        return torch.cat(picks).sort().values


def _whole_slots(update: ClientUpdate, names: tuple[str, ...]) -> str | None:
    """Whole slots with counts summing to at most ``num_examples``."""
    slots: dict[str, set[str]] = {}
    for k in update.tensors:
        if k.startswith(GRAD_PREFIX):
            j, _, name = k[len(GRAD_PREFIX) :].partition(".")
            slots.setdefault(j, set()).add(name)
    counts = {k[len(COUNT_PREFIX) :] for k in update.scalars if k.startswith(COUNT_PREFIX)}
    for j in sorted(set(slots) | counts):
        if j not in counts:
            return f"{COUNT_PREFIX}{j}: a class gradient travels with its count"
        missing = sorted(set(names) - slots.get(j, set()))
        if missing:
            return f"{GRAD_PREFIX}{j}.{missing[0]}: missing (a slot carries all of GE's gradient)"
    total = sum(update.scalars[COUNT_PREFIX + j] for j in counts)
    if total > update.scalars.get("num_examples", 0.0):
        return f"{COUNT_PREFIX}*: counts sum to {total:g}, more than num_examples"
    return None
