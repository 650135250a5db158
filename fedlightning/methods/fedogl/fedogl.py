"""FedOGL: federated open-world multimodal graph learning (paper 000), node classification,
as a composition (docs/fedogl.md): retention, Eq. (5); structure-basis shielding, Eqs.
(7)-(9); prototype memory, Eqs. (10)-(14); MSP rejection, Eq. (6); each with an ablation
switch (paper Table 2).
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch

from fedlightning.clients.minibatch import node_outputs
from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import FederatedClient
from fedlightning.federation.stacking import StackedFit
from fedlightning.messages import COUNT_PREFIX, PROTO_PREFIX, ClientUpdate, ServerBroadcast
from fedlightning.methods.continual.continual import ContinualFedAvg
from fedlightning.methods.continual.retrieval_baselines import ContinualRetrieval
from fedlightning.methods.fedogl.basis import class_balanced_weights, residual_basis
from fedlightning.methods.fedogl.fedogl_server import (
    BASIS_PREFIX,
    AlignmentMemory,
    BasisMemory,
    PrototypeMemory,
)
from fedlightning.methods.fedogl.projection import GradientProjection
from fedlightning.methods.fedogl.prototypes import local_prototypes
from fedlightning.methods.fedogl.structure import protected_biases, protected_inputs
from fedlightning.server import Server
from fedlightning.server.aggregate import model_state, strip_prefix
from fedlightning.server.privacy import PrototypeRelease, private_prototype
from fedlightning.server.validation import Field, MessageSpec, Rule
from fedlightning.utils.seeding import torch_generator


class FedOGL(ContinualFedAvg):
    """FedOGL; ``replay, distill, projection, prototypes`` switch its modules (Table 2);
    ``basis``, ``proto`` override :attr:`BASIS_DEFAULTS`, :attr:`PROTO_DEFAULTS`; ``dp`` the
    prototype release (FedTIP's Eq. 7 on Eq. 11's means); the rest as ContinualFedAvg."""

    stage_end_exchange = True
    prepare_keeps_batch = True  # its prepare sets the bases and returns the stage's batch
    BASIS_DEFAULTS = {
        "rank_local": 8,
        "rank": 16,
        "rho": 1.0,
        "include_mean": True,
        "class_balanced": True,
        "project_update": True,
    }
    PROTO_DEFAULTS = {
        "modes": 1,
        "slots": 4,
        "eta": 0.8,
        "kappa": 3,
        "gamma": 0.5,
        "lambda_lab": 1.0,
        "lambda_tr": 1.0,
        "steps": 5,
        "lr": 0.05,
        "window": 3,
    }

    def __init__(
        self,
        replay: bool = True,
        distill: bool = True,
        projection: bool = True,
        prototypes: bool = True,
        replay_budget: int = 20,
        lambda_dis: float = 1.0,
        basis: dict | None = None,
        proto: dict | None = None,
        dp: dict | None = None,
        **kw: Any,
    ) -> None:
        modules = dict(replay=replay, distill=distill, projection=projection, prototypes=prototypes)
        off = [n for n, on in modules.items() if not on]
        super().__init__(
            name="fedogl",
            variant="full" if not off else "no_" + "_no_".join(off),
            replay_budget=replay_budget if replay else 0,
            lambda_dis=lambda_dis if distill else 0.0,
            **kw,
        )
        self.projection, self.use_prototypes = projection, prototypes
        self.basis = {**self.BASIS_DEFAULTS, **dict(basis or {})}
        self.proto = {**self.PROTO_DEFAULTS, **dict(proto or {})}
        self.projector = GradientProjection(project_update=self.basis["project_update"])
        self.release = PrototypeRelease.from_settings(dp)
        if self.release.on and self.proto["modes"] != 1:
            raise ConfigError(
                "algorithm.dp.clip",
                "the release's sensitivity holds for one mean per class: "
                f"needs algorithm.proto.modes=1, got {self.proto['modes']}",
            )

    def privacy_budget(self, rounds: int) -> dict[str, Any]:
        """The budget of one prototype release per round, composed over ``rounds``."""
        return self.release.budget(rounds if self.use_prototypes and self.release.on else 0)

    def server(self, global_state: dict) -> Server:
        modules: dict[str, Any] = {}
        if self.projection:
            modules["basis"] = BasisMemory(self.basis["rank"], self.basis["rho"])
        if self.use_prototypes:
            mem = self.prototype_memory()
            mem.schedule = self.schedule
            modules["prototypes"] = mem
        return Server(global_state, modules=modules, **self.bounds())

    def prototype_memory(self) -> PrototypeMemory:
        """The server's prototype module, Eqs. (12)-(14)."""
        return PrototypeMemory(**self.memory_kwargs())

    def memory_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.proto.items() if k != "modes"}  # modes is the client's

    def schedule(self, round: int) -> tuple[list[int], bool]:
        """Known classes at ``round`` and whether an old class exists (``gamma_t > 0``)."""
        t = self.stage_of(round)
        return self.stream.known(t), t > 0

    # ---------------------------------------------------------------- declared messages
    proto_sides: tuple[str, ...] = ("",)  # the prototype banks' names ("": node classification)

    def proto_width(self, side: str) -> str:
        """The broadcast field whose second axis is a prototype's width (the head's input)."""
        return "model.head.weight"

    def uplink(self, broadcast: ServerBroadcast) -> MessageSpec:
        """FedAvg's fields and, with prototypes, ``proto.[<bank>.]<c>.<q>`` (a known class,
        ``q < modes``) each with its whole ``proto_count.`` >= 1, summing to at most
        ``num_examples`` (Eq. 11)."""
        spec = super().uplink(broadcast)
        if not self.use_prototypes:
            return spec
        known = frozenset(self.stream.known(self.stage_of(broadcast.round)))
        modes = "|".join(str(q) for q in range(int(self.proto["modes"])))
        fields = []
        for side in self.proto_sides:
            pre = re.escape(f"{side}.") if side else ""
            width = self.proto_width(side)

            def shape(m: re.Match, ref: Any, width: str = width) -> tuple[int, ...] | None:
                return (ref.tensors[width].shape[1],) if width in ref.tensors else None

            name = rf"{pre}(?P<c>\d+)\.(?:{modes})"
            fields.append(Field(re.escape(PROTO_PREFIX) + name, shape=shape, classes=known,
                                required=False))  # fmt: skip
            fields.append(Field(re.escape(COUNT_PREFIX) + name, tensor=False, low=1.0,
                                integral=True, classes=known, required=False))  # fmt: skip
        return MessageSpec(
            (*spec.fields, *fields),
            rules=(
                *spec.rules,
                Rule(_paired_prototypes, reads=(r"proto_count\..+", "num_examples")),
            ),
            reference=broadcast,
        )

    def stage_end_uplink(self, broadcast: ServerBroadcast) -> MessageSpec | None:
        """Eq. (7)'s optional message: ``basis.<weight>`` (rows as the broadcast's) and
        ``basis_nodes``."""
        if not self.projection:
            return None

        def rows(m: re.Match, ref: Any) -> tuple[int, ...]:
            prev = ref.tensors.get(m[0]) if ref is not None else None
            return (prev.shape[0] if prev is not None else -1, -1)

        fields = (
            Field(re.escape(BASIS_PREFIX) + r".+", shape=rows),
            Field("basis_nodes", tensor=False, low=0.0, integral=True),
        )
        return MessageSpec(fields, optional=True, reference=broadcast)

    # ---------------------------------------------------------------- client side
    def callbacks(self) -> list:
        return [self.projector] if self.projection and self.projector.bases else []

    def prepare(self, module: Any, client: FederatedClient, broadcast: ServerBroadcast) -> Any:
        """Before a client's fit: the round's bases (Eq. 9) and frozen biases into the
        gradient projection, then the stage's preparation."""
        bases = {"net." + k: v for k, v in strip_prefix(broadcast.tensors, BASIS_PREFIX).items()}
        self.projector.set_bases(bases)
        self.projector.frozen_biases = (
            ["net." + n for n in protected_biases(module.net)] if bases else []
        )
        return super().prepare(module, client, broadcast)

    def from_stack(self, fitted: StackedFit) -> list[dict[str, Any]]:
        """Every client's :meth:`descriptors` as ``banks``, from one pass of the fitted stack."""
        if not self.use_prototypes:
            return super().from_stack(fitted)
        return [{"banks": b} for b in fitted.outputs(self.descriptors)]

    def finish(
        self,
        module: Any,
        client: FederatedClient,
        broadcast: ServerBroadcast,
        batch: Any,
        banks: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> ClientUpdate:
        """:meth:`ContinualFedAvg.finish`'s update with Eq. (11)'s prototypes (of ``banks``)."""
        update = super().finish(module, client, broadcast, batch)
        if self.use_prototypes:
            self.add_prototypes(module, client, broadcast.round, update, banks)
        return update

    def descriptors(self, net: Any, batch: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Memory descriptors by bank: ``{"": (z, sup_mask)}``, the fused ``z`` of Eq. (10)."""
        return {"": (net.representations(batch)["z"], batch.sup_mask)}

    @torch.no_grad()
    def add_prototypes(
        self,
        module: Any,
        client: FederatedClient,
        round: int,
        update: ClientUpdate,
        banks: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """Eq. (11): each bank's prototypes per observed class of the stage as
        ``proto.[<bank>.]<c>.<q>`` and ``proto_count.``; ``banks`` computed if not given."""
        t = self.stage_of(round)
        batch = self.batch_at(client, t, replay=False, rows=banks is None)  # labels alone
        if banks is None:
            module.net.eval()  # batched beyond federation.minibatch's budget
            fn, sup = partial(self.descriptors, module.net), batch.sup_mask
            banks = node_outputs(fn, batch, getattr(module, "minibatch", None), sup)
            module.net.train()
        for side, (x, m) in banks.items():
            if self.release.on:
                self.add_released(update, client, round, side, x[m], batch.y[m], t)
                continue
            protos = local_prototypes(
                x[m],
                batch.y[m],
                self.stream.observed[client.client_id][t],
                modes=self.proto["modes"],
                seed=self.seed,
            )
            pre = f"{side}." if side else ""
            for c, items in protos.items():
                for q, (p, n) in enumerate(items):
                    update.tensors[f"{PROTO_PREFIX}{pre}{c}.{q}"] = p.detach().clone()
                    update.scalars[f"{COUNT_PREFIX}{pre}{c}.{q}"] = float(n)

    def add_released(
        self,
        update: ClientUpdate,
        client: FederatedClient,
        round: int,
        side: str,
        x: Any,
        y: Any,
        t: int,
    ) -> None:
        """Eq. (11) through Eq. (7): each observed class's clipped, noised mean."""
        pre = f"{side}." if side else ""
        for c in self.stream.observed[client.client_id][t]:
            h = x[y == c]
            if h.size(0) == 0:
                continue
            g = torch_generator(self.seed, "release", round, client.client_id, side or "z", c)
            p = private_prototype(h.detach().cpu(), self.release.clip, self.release.sigma, g)
            update.tensors[f"{PROTO_PREFIX}{pre}{c}.0"] = p
            update.scalars[f"{COUNT_PREFIX}{pre}{c}.0"] = float(h.size(0))

    @torch.no_grad()
    def stage_end_update(
        self, module: Any, client: FederatedClient, broadcast: ServerBroadcast, t: int
    ) -> ClientUpdate | None:
        """Eq. (7): the residual basis of the stage's training nodes on the final global model."""
        if not self.projection:
            return None
        module.receive(model_state(broadcast.tensors))
        batch = self.batch_at(client, t, replay=False)
        if int(batch.sup_mask.sum()) == 0:
            return None
        module.net.eval()  # batched beyond federation.minibatch's budget
        fn, mb = partial(protected_inputs, module.net), getattr(module, "minibatch", None)
        inputs = node_outputs(fn, batch, mb, batch.sup_mask)
        module.net.train()
        m, y = batch.sup_mask, batch.y[batch.sup_mask]
        weights = class_balanced_weights(y) if self.basis["class_balanced"] else None
        tensors = {}
        for name, x in inputs.items():
            prev = broadcast.tensors.get(BASIS_PREFIX + name)
            u = residual_basis(
                x[m], prev, self.basis["rank_local"], weights, self.basis["include_mean"]
            )
            if u.size(1):
                tensors[BASIS_PREFIX + name] = u
        if not tensors:
            return None
        scalars = {"basis_nodes": float(m.sum())}
        return ClientUpdate(broadcast.round, tensors, scalars, client_id=client.client_id)


def _paired_prototypes(update: ClientUpdate) -> str | None:
    """Prototypes and counts come in pairs; the counts sum to at most ``num_examples``."""
    protos = {k[len(PROTO_PREFIX) :] for k in update.tensors if k.startswith(PROTO_PREFIX)}
    counts = {k[len(COUNT_PREFIX) :] for k in update.scalars if k.startswith(COUNT_PREFIX)}
    for name in sorted(protos ^ counts):
        field = PROTO_PREFIX + name if name in protos else COUNT_PREFIX + name
        return f"{field}: a prototype and its count travel together"
    sides: dict[str, float] = {}
    for name in counts:
        side = name.rsplit(".", 2)[0] if name.count(".") > 1 else ""
        sides[side] = sides.get(side, 0.0) + update.scalars[COUNT_PREFIX + name]
    for side, total in sorted(sides.items()):
        if total > update.scalars.get("num_examples", 0.0):
            field = f"{COUNT_PREFIX}{side}{'.' if side else ''}*"
            return f"{field}: counts sum to {total:g}, more than num_examples"
    return None


class RetrievalFedOGL(ContinualRetrieval, FedOGL):
    """FedOGL for class-incremental cross-modal retrieval (docs/fedogl.md, "Retrieval"):
    prototypes per class and modality aligned on the server (:class:`AlignmentMemory`)."""

    def descriptors(self, net: Any, batch: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per modality ``m``: the tower output ``g_m`` and the stage's nodes that have ``m``."""
        return {
            m: (net.tower(batch, m), batch.sup_mask & net.availability(batch, m)) for m in net.sides
        }

    sides: tuple[str, str] | None = None  # (query, item), known once the net is

    def client_module(self, net: Any, optimizer: Any) -> Any:
        module = super().client_module(net, optimizer)
        self.sides = tuple(net.sides)
        self.proto_sides = self.sides
        return module

    def proto_width(self, side: str) -> str:
        """A modality's prototypes are as wide as its projection head's input."""
        return f"model.heads.{side}.weight"

    def prototype_memory(self) -> AlignmentMemory:
        if self.sides is None:
            raise RuntimeError("client_module(net, ...) names the modalities; call it first")
        return AlignmentMemory(self.sides, self.temperature, **self.memory_kwargs())
