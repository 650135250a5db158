"""FedTIP (paper 001), its comparators and Table 4's ablations, each one config of
:class:`FedTIP` (docs/fedtip.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from fedlightning.clients.temporal_prompt import (
    FedTIPClient,
    class_members,
    family_prototypes,
    family_views,
    stack_batches,
)
from fedlightning.errors import ConfigError
from fedlightning.federation.round import ClientWork
from fedlightning.federation.task_loop import TaskBatches, TaskContext
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.methods.temporal_base.temporal_base import CLASSES, TemporalMethod
from fedlightning.server.privacy import PrototypeRelease, private_prototype
from fedlightning.server.reliability import (
    PROTO_NORM_RATIO,
    FedTIPServer,
    label_coverage,
    read_broadcast,
)
from fedlightning.server.secure_sum import SecureSum, ShareSpec
from fedlightning.temporal.adapter import TEMPLATES, TIES, PromptAdapter
from fedlightning.utils.seeding import derive_seed, manual_seed, torch_generator

MODES = ("federated", "central")
AGGREGATIONS = ("reliability", "fedavg")
PROMPTS = ("interaction", "static")


@dataclass
class FedTIP(TemporalMethod):
    """One FedTIP configuration (settings: docs/fedtip.md), run by the task loop through its
    task verbs. ``mode``: ``federated`` or ``central`` (pooled); ``aggregation``:
    ``reliability`` (Eqs. 27-30) or ``fedavg``; ``anchors``: Eqs. (22)-(24); ``prompt``:
    ``interaction`` (Eqs. 14-15) or ``static``; ``negatives``: ``protocol`` (Eq. 25) or
    ``unfiltered``; ``template``, ``tie``: the readings of Eqs. (16)-(17)
    (docs/readings.md); ``dp``: Eq. (7)'s release; ``clip``, ``sigma``, ``residual``: old
    names, still read."""

    name: str = "fedtip"
    # the median-norm bound on prototype uploads (docs/security.md); None for DyGPrompt
    prototype_bound: float | None = PROTO_NORM_RATIO
    aggregation: str = "reliability"
    anchors: bool = True
    prompt: str = "interaction"
    lambda_p: float = 1e-2
    lambda_a: float = 1e-1
    beta: float = 0.1
    eta_s: float = 1.0
    bottleneck: int = 2
    rank: int = 2
    template: str = "residual"
    residual: bool | None = None
    tie: str = "none"
    dropout: float = 0.1
    dp: Any = None
    clip: float | None = None
    sigma: float = 0.0
    modes = MODES
    aggregations = AGGREGATIONS
    anchored = True
    secure_sums = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, value, allowed in (
            ("prompt", self.prompt, PROMPTS),
            ("tie", self.tie, TIES),
            ("template", self.template, TEMPLATES),
        ):
            if value not in allowed:
                raise ValueError(f"algorithm.{key} must be one of {allowed}, got {value!r}")
        if self.residual is not None:  # the old name of template
            old = "residual" if self.residual else "paper"
            if self.template not in ("residual", old):
                raise ConfigError(
                    "algorithm.residual",
                    f"contradicts algorithm.template={self.template}; set algorithm.template "
                    "only (algorithm.residual is its old name)",
                )
            self.template = old
        dp = dict(self.dp or {})
        if self.clip is not None or self.sigma:
            if dp.get("clip") is not None or dp.get("sigma"):
                raise ConfigError(
                    "algorithm.clip",
                    "set algorithm.dp.clip and algorithm.dp.sigma only "
                    "(algorithm.clip and algorithm.sigma are their old names)",
                )
            dp.update(clip=self.clip, sigma=self.sigma)
        self.release = PrototypeRelease.from_settings(dp)
        self.pooled = self.mode == "central"  # pooled training: one client per task

    def variant(self, pretrained_bank: bool = True, filtered_bank: bool = True) -> str:
        """Table 4's ablation: ``no_`` and the removed components in order, or ``full``."""
        on = {
            "tkb": pretrained_bank,
            "icp": self.prompt == "interaction",
            "pa": self.anchors or not self.name.startswith("fedtip"),
            "rwa": self.aggregation == "reliability" or not self.name.startswith("fedtip"),
            "ftn": filtered_bank and self.negatives == "protocol",
        }
        off = [k for k, v in on.items() if not v]
        return "no_" + "_".join(off) if off else "full"

    def adapter(self, d_h: int, d_t: int, d_e: int) -> PromptAdapter:
        return PromptAdapter(
            d_h,
            d_t,
            d_e,
            self.bottleneck,
            self.rank,
            self.prompt == "static",
            self.dropout,
            template=self.template,
            tie=self.tie,
        )

    # ------------------------------------------------------------------ task verbs
    def task_module(self, adapter: PromptAdapter, family: str) -> FedTIPClient:
        central = self.mode == "central"
        return FedTIPClient(
            adapter,
            family,
            tau=self.tau,
            lambda_p=0.0 if central else self.lambda_p,
            lambda_a=self.lambda_a if self.anchors and not central else 0.0,
            lr=self.lr,
            weight_decay=self.weight_decay,
        )

    def task_server(self, module: FedTIPClient) -> FedTIPServer:
        """The task's server, starting from the module's initial adapter."""
        omega = module.adapter.state_dict()
        server = FedTIPServer(
            omega,
            self.eta_s,
            self.beta,
            self.aggregation == "reliability",
            self.anchors,
            proto_norm_ratio=self.prototype_bound,
        )
        if self.secure_seed is not None:
            protos = "prototypes" in self.message_fields(module.family)
            spec = ShareSpec("fedtip", 2 if protos else 0, module.adapter.d_h, self.max_update_norm)
            server.secure = SecureSum(int(self.secure_seed), spec)
        return server

    def task_work(
        self,
        context: TaskContext,
        task: TaskBatches,
        family: str,
        module: FedTIPClient,
        broadcast: ServerBroadcast,
    ) -> ClientWork:
        """The round's clients fitted at once (:meth:`fit_clients`)."""
        shapes = {n: (1, *v.shape[1:]) for n, v in module.adapter.state_dict().items()}
        omega, anchors = read_broadcast(broadcast, shapes)
        fit = partial(self.fit_clients, context, task, family, module, broadcast.round)
        uplink = self.task_uplink(task, family, broadcast, module.adapter.d_h)
        return ClientWork(share=partial(fit, omega, anchors), uplink=uplink)

    def fit_clients(
        self,
        context: TaskContext,
        task: TaskBatches,
        family: str,
        module: FedTIPClient,
        round: int,
        omega: dict[str, Tensor],
        anchors: dict[int, Tensor],
        share: range,
    ) -> list[ClientUpdate]:
        """The updates of the clients at positions ``share`` from one stacked fit, padded as
        the whole round's: bitwise each one's update in the whole stack (on CPU)."""
        ids = task.active
        mine = [ids[i] for i in share]
        module.receive(omega, anchors, len(mine), share.start, len(ids))
        stack = self.support_stack(task, mine)
        manual_seed(derive_seed(context.seed, "fit", task.task, family, round))
        context.executor.fit(module, stack, context.epochs)
        gens = None
        if self.release.on:  # the noise of Eq. (7): one generator per client and round
            gens = [torch_generator(context.seed, "release", task.task, family, round, k)
                    for k in mine]  # fmt: skip
        return self.make_updates(module, stack, omega, round, mine, gens)

    def support_stack(self, task: TaskBatches, mine: Sequence[int]) -> dict[str, Tensor]:
        """``stack_batches`` of the clients ``mine``, padded to the task's longest support,
        kept until another task or share asks."""
        key = (id(task.clients), task.task, tuple(mine), task.longest)
        cached = getattr(self, "_stack", None)
        if cached is None or cached[0] != key:
            cached = (key, stack_batches([task.clients[k] for k in mine], task.longest))
            self._stack = cached
        return cached[1]

    def task_result(
        self, module: FedTIPClient, adapter: PromptAdapter, server: FedTIPServer
    ) -> tuple[PromptAdapter, dict[int, Tensor]]:
        """The task's global adapter and the prototypes node classification is scored by."""
        adapter.load_state_dict(server.state())
        return adapter, server.class_prototypes()

    def pooled_fit(
        self,
        context: TaskContext,
        task: TaskBatches,
        family: str,
        module: FedTIPClient,
        adapter: PromptAdapter,
        rounds: int,
    ) -> tuple[PromptAdapter, dict[int, Tensor]]:
        """Central training: the union of the supports fitted ``rounds x epochs`` steps; the
        adapter and the pooled class prototypes."""
        supports = list(task.clients.values())
        pooled = stack_batches([{k: torch.cat([b[k] for b in supports]) for k in supports[0]}])
        module.receive(adapter.state_dict(), {}, 1)
        manual_seed(derive_seed(context.seed, "fit", task.task, family))
        context.executor.fit(module, pooled, rounds * context.epochs)
        module.eval()
        with torch.no_grad():
            q, counts = family_prototypes(family_views(module.adapter, pooled, family), family)
        adapter.load_state_dict(module.adapter.state_dict())
        return adapter, {c: q[0, c] for c in range(q.size(1)) if counts[0, c] > 0}

    def make_updates(
        self,
        module: FedTIPClient,
        batch: dict[str, Tensor],
        start: dict[str, Tensor],
        round: int,
        client_ids: Sequence[int],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> list[ClientUpdate]:
        """The stacked clients' Eq. (2) messages from the trained adapter in eval mode."""
        module.eval()
        family, fields = module.family, self.message_fields(module.family)
        inputs = module.inputs_of(batch) if isinstance(module, FedTIPClient) else None
        classes = inputs["classes"] if inputs is not None else None
        with torch.no_grad():
            views = family_views(module.adapter, batch, family, inputs)
            q, counts = family_prototypes(views, family, classes)
            deltas = torch.cat(
                [(p - start[n]).flatten(1) for n, p in module.adapter.named_parameters()], 1
            )
        out, rows = [], counts.tolist()
        for k, client in enumerate(client_ids):
            observed = {c: int(n) for c, n in enumerate(rows[k]) if n > 0}
            tensors = {"delta": deltas[k].clone()}
            scalars = {f"count.{c}": float(n) for c, n in observed.items()}
            if "prototypes" in fields:
                for c in observed:
                    tensors[f"proto.{c}"] = (
                        q[k, c].clone()
                        if not self.release.on
                        else private_prototype(
                            class_members(views, family, k, c),
                            self.release.clip,
                            self.release.sigma,
                            generators[k] if generators else None,
                        )
                    )
            if "coverage" in fields:
                scalars["coverage"] = label_coverage(observed, CLASSES) if observed else 0.0
                scalars["norm"] = float(deltas[k].norm())
            out.append(ClientUpdate(round, tensors, scalars, client_id=client))
        return out
