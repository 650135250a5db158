"""Class-incremental federated baselines of the FedOGL setting, as compositions.

Following the paper's adaptation rule, every baseline trains locally and aggregates with
FedAvg; non-continual methods get the same class-balanced replay budget. They differ only
in switches: replay budget, distillation, the proximal term and the rejection score.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning.clients.continual_client import DISTILL_ON, ContinualNodeClassifier
from fedlightning.clients.replay import class_balanced_sample, stage_batch
from fedlightning.data.streams import ClassStream
from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import Algorithm, FederatedClient, check_bounds
from fedlightning.federation.stacking import (
    StackedFit,
    defined_by,
    fit_stacked,
)
from fedlightning.messages import ClientUpdate, ServerBroadcast, detach_state
from fedlightning.models.constant import graphs_identity, unchanged
from fedlightning.models.multimodal import ModalityEncoders, MultimodalGNN
from fedlightning.models.stacked import GatheredRows
from fedlightning.server.aggregate import model_state
from fedlightning.utils.seeding import torch_generator

SCORES = ("msp", "energy")


def gathered_stage_batch(data: Any, known: Tensor, supervised: Tensor, replay: Tensor) -> Any:
    """:func:`~fedlightning.clients.replay.stage_batch` whose dense floating node features
    (``[N, d]``: the modalities) are not gathered: each is
    :class:`~fedlightning.models.stacked.GatheredRows` of ``data``'s own rows at the batch's
    nodes (the nodes of ``known`` classes, in order), which :func:`with_rows` gathers."""
    keys = list(dense_features(data))
    light = copy.copy(data)  # shallow: data keeps its attributes
    for k in keys:
        del light[k]
    light.num_nodes = data.num_nodes
    batch = stage_batch(light, known, supervised, replay)
    index = torch.isin(data.y, known).nonzero().view(-1)
    for k in keys:
        batch[k] = GatheredRows([(data[k], index)])
    return batch


# a stacked fit gathers its clients' rows only when their dense features are this large: below
# it the copies cost little memory and gathering them step by step costs time (docs/scaling.md)
GATHER_MIN_BYTES = 256 * 2**20


def dense_features(data: Any) -> dict[str, Tensor]:
    """``data``'s dense floating node features (``[N, d]`` tensors that take no gradient:
    the modalities), by name."""
    return {
        k: v
        for k, v in data.items()
        if isinstance(v, Tensor)
        and v.layout == torch.strided
        and v.is_floating_point()
        and v.dim() == 2
        and v.shape[0] == data.num_nodes
        and not v.requires_grad
    }


def dense_feature_bytes(data: Any) -> int:
    """The bytes of ``data``'s dense floating node features (:func:`dense_features`)."""
    return sum(v.numel() * v.element_size() for v in dense_features(data).values())


def with_rows(batch: Any) -> Any:
    """``batch`` with every :class:`~fedlightning.models.stacked.GatheredRows` attribute
    gathered (a shallow copy; ``batch`` itself when it has none)."""
    keys = [k for k, v in batch.items() if isinstance(v, GatheredRows)]
    if not keys:
        return batch
    out = copy.copy(batch)
    for k in keys:
        out[k] = batch[k].materialize()
    return out


class ContinualFedAvg(Algorithm):
    """FedAvg in the class-incremental stream, with optional replay, distillation, FedProx.

    Args:
        name: method name for tags (``fedavg``, ``fedprox``, ``fedlwf``, ...).
        variant: variant tag (``full``, ``replay``, ``energy``, ...).
        replay_budget: class-balanced replay budget per class and stage; ``0`` = no replay.
        replay_stages: ``M``: replay the last ``q = min(M, t-1)`` stages (default: all).
        lambda_rep: replay CE weight (default ``1.0``).
        lambda_dis: distillation weight; ``0`` = no teacher (default ``0.0``).
        tau: distillation temperature (default ``2.0``).
        distill_on: nodes of the KL term: ``replay``, ``current`` or ``both``; default
            ``replay`` while replay is on, else ``current``.
        prox_mu: FedProx coefficient (default ``0.0``).
        score: rejection score, ``msp`` (Eq. (6)) or ``energy`` (default ``msp``).
        max_update_norm, max_client_weight: the server's bounds on each client's influence
            (as :class:`~fedlightning.methods.fedavg.fedavg.FedAvg`'s; ``None``: off).
    """

    continual = True

    def __init__(
        self,
        name: str = "fedavg",
        variant: str = "full",
        replay_budget: int = 0,
        replay_stages: int | None = None,
        lambda_rep: float = 1.0,
        lambda_dis: float = 0.0,
        tau: float = 2.0,
        distill_on: str | None = None,
        prox_mu: float = 0.0,
        score: str = "msp",
        max_update_norm: float | None = None,
        max_client_weight: float | None = None,
    ) -> None:
        self.max_update_norm, self.max_client_weight = check_bounds(
            max_update_norm, max_client_weight
        )
        if replay_stages is not None and replay_stages < 1:
            raise ConfigError("algorithm.replay_stages", f"must be >= 1, got {replay_stages}")
        for key, value in (
            ("replay_budget", replay_budget),
            ("lambda_rep", lambda_rep),
            ("lambda_dis", lambda_dis),
            ("prox_mu", prox_mu),
        ):
            if value < 0:
                raise ConfigError(f"algorithm.{key}", f"must be >= 0, got {value}")
        if tau <= 0:
            raise ConfigError("algorithm.tau", f"must be > 0, got {tau}")
        if distill_on is not None and distill_on not in DISTILL_ON:
            raise ConfigError(
                "algorithm.distill_on", f"must be one of {DISTILL_ON}, got {distill_on!r}"
            )
        if score not in SCORES:
            raise ConfigError("algorithm.score", f"must be one of {SCORES}, got {score!r}")
        self.name, self.variant = name, variant
        self.replay_budget, self.replay_stages = int(replay_budget), replay_stages
        self.lambda_rep, self.lambda_dis, self.tau = lambda_rep, lambda_dis, tau
        self.distill_on = distill_on or ("replay" if replay_budget > 0 else "current")
        self.prox_mu, self.score = prox_mu, score
        self.stream: ClassStream | None = None
        self.rounds_per_stage, self.seed, self.num_classes = 1, 0, 0

    def setup(
        self, stream: ClassStream, rounds_per_stage: int, seed: int, num_classes: int
    ) -> None:
        """Attach the protocol: which classes are known when, and the round schedule."""
        self.stream, self.rounds_per_stage = stream, rounds_per_stage
        self.seed, self.num_classes = seed, num_classes

    def stage_of(self, round: int) -> int:
        return (round - 1) // self.rounds_per_stage

    def client_module(self, net: nn.Module, optimizer: Any) -> ContinualNodeClassifier:
        if hasattr(net, "pair_mask"):
            raise ConfigError(
                "model",
                f"{type(net).__name__} is a retrieval model; node "
                "classification (cil_*) needs a classifier, e.g. model=multimodal_gnn",
            )
        return ContinualNodeClassifier(net, optimizer, **self.retention_kwargs())

    def retention_kwargs(self) -> dict[str, Any]:
        """The Eq. (5) settings every continual client module takes."""
        return {
            "prox_mu": self.prox_mu,
            "lambda_rep": self.lambda_rep,
            "lambda_dis": self.lambda_dis,
            "tau": self.tau,
            "distill_on": self.distill_on,
        }

    # ---------------------------------------------------------------- client side
    def supervised_classes(self, client_id: int, t: int) -> torch.Tensor:
        return torch.tensor(self.stream.observed[client_id][t], dtype=torch.long)

    def begin_stage(self, client: FederatedClient, t: int, global_state: dict) -> None:
        """At a client's first round of stage ``t``: freeze the teacher, fill the memory."""
        state = client.state
        memory: dict[int, torch.Tensor] = state.setdefault("replay", {})
        data = client.data
        for s in range(t):
            if s in memory:
                continue
            sup = data.train_mask & torch.isin(data.y, self.supervised_classes(client.client_id, s))
            nodes = sup.nonzero().squeeze(1)
            gen = torch_generator(self.seed, "replay", client.client_id, s)
            memory[s] = class_balanced_sample(nodes, data.y[nodes], self.replay_budget, gen)
        state["stage"] = t
        if self.lambda_dis > 0 and t > 0:
            state["teacher"] = detach_state(global_state)
            state["teacher_known"] = torch.tensor(self.stream.known(t - 1), dtype=torch.long)
        else:
            state.pop("teacher", None)
            state.pop("teacher_known", None)

    def replay_nodes(self, client: FederatedClient, t: int) -> torch.Tensor:
        memory = client.state.get("replay", {})
        q = t if self.replay_stages is None else min(self.replay_stages, t)
        parts = [memory[s] for s in range(t - q, t) if s in memory]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def batch_at(
        self, client: FederatedClient, t: int, replay: bool = True, rows: bool | None = None
    ) -> Any:
        """The client's training batch of stage ``t`` (:func:`stage_batch`), with its replay
        memory (``replay=False``: without). Every round of a stage asks for the same batch:
        it is built once and given again while the client's graph and memory are unchanged
        (:func:`~fedlightning.models.constant.graphs_identity`), so the work kept per graph
        tensor (GCN normalisation, the input's non-zeros) carries over from round to round.

        While a stacked fit gathers rows (:meth:`gathers_rows`), a new batch's dense
        features are :class:`~fedlightning.models.stacked.GatheredRows` of the client's own
        (:func:`gathered_stage_batch`: no copy of them is kept); such a batch is given with
        its rows gathered (a copy for this call alone) unless ``rows`` is false (``None``:
        not while a stacked fit gathers rows)."""
        batch = self._stage_batch(client, t, replay)
        if rows is None:
            rows = not self.__dict__.get("_gather_rows", False)
        return with_rows(batch) if rows else batch

    def gathers_rows(self, module: Any, executor: Any) -> bool:
        """Whether a stacked fit of ``module`` reads its stage batches' dense features as
        :class:`~fedlightning.models.stacked.GatheredRows` (issue 49's memory, docs/scaling.md
        "Memory"): the client's batch is :meth:`prepare`'s own (or an override's that sets
        ``prepare_keeps_batch = True`` in its class and returns that batch unchanged), the net a
        :class:`~fedlightning.models.multimodal.MultimodalGNN` whose features go to its
        :class:`~fedlightning.models.multimodal.ModalityEncoders` alone, on the CPU."""
        net, device = module.net, getattr(executor, "device", None)
        owner = defined_by(self, "prepare")
        return (
            (owner is ContinualFedAvg or vars(owner).get("prepare_keeps_batch", False))
            and isinstance(net, MultimodalGNN)
            and defined_by(net, "gnn_inputs") is MultimodalGNN
            and type(net.encoders) is ModalityEncoders
            and (device is None or torch.device(device).type == "cpu")
        )

    def _stage_batch(self, client: FederatedClient, t: int, replay: bool) -> Any:
        nodes = self.replay_nodes(client, t) if replay else torch.zeros(0, dtype=torch.long)
        built = self.__dict__.setdefault("_stage_batches", {})  # (client, replay) -> last one
        hit = built.get((client.client_id, replay))
        if (
            hit is not None
            and hit[0] == t
            and unchanged(hit[1], [client.data])
            and hit[2].equal(nodes)
        ):
            return hit[3]
        for key in [(client.client_id, True), (client.client_id, False)]:
            if key in built and built[key][0] != t:  # an earlier stage's: its rows go now
                del built[key]
        other = built.get((client.client_id, True))
        if (
            not replay
            and other is not None
            and other[0] == t
            and unchanged(other[1], [client.data])
        ):
            # the same nodes (replay nodes are of known classes): that batch's tensors, shared
            batch = copy.copy(other[3])
            batch.replay_mask = torch.zeros_like(batch.replay_mask)
        else:
            known = torch.tensor(self.stream.known(t), dtype=torch.long)
            sup = self.supervised_classes(client.client_id, t)
            if self.__dict__.get("_gather_rows", False):
                batch = gathered_stage_batch(client.data, known, sup, nodes)
            else:
                batch = stage_batch(client.data, known, sup, nodes)
        built[(client.client_id, replay)] = (t, graphs_identity([client.data]), nodes, batch)
        return batch

    def local_fit(
        self,
        module: ContinualNodeClassifier,
        client: FederatedClient,
        broadcast: ServerBroadcast,
        executor: Any,
        epochs: int,
    ) -> ClientUpdate:
        batch = self.prepare(module, client, broadcast)
        executor.fit(module, batch, epochs, self.callbacks())
        return self.finish(module, client, broadcast, batch)

    def local_fit_share(
        self,
        module: ContinualNodeClassifier,
        clients: Sequence[FederatedClient],
        broadcast: ServerBroadcast,
        executor: Any,
        epochs: int,
        seeds: Sequence[int],
    ) -> list[ClientUpdate]:
        """:meth:`local_fit` of ``clients`` as one stacked fit, each with its own stage
        batch, start weights (what :meth:`prepare` loads for it: a personalized client's own
        model), teacher and dropout stream (``seeds[k]``); their updates, in order, each
        from :meth:`finish` with what :meth:`from_stack` computed for it."""
        batches, starts = [], []
        self._gather_rows = self.gathers_rows(module, executor) and (
            sum(dense_feature_bytes(c.data) for c in clients) >= GATHER_MIN_BYTES
        )
        try:
            for c in clients:
                batches.append(self.prepare(module, c, broadcast))
                starts.append({n: p.detach().clone() for n, p in module.net.named_parameters()})
        finally:
            self._gather_rows = False
        teachers = [c.state.get("teacher") for c in clients] if module._teacher else None
        fitted = fit_stacked(
            module, batches, executor, epochs, self.callbacks(), seeds, teachers, starts
        )
        extra = self.from_stack(fitted)
        return [
            self.finish(fitted.load(module, k), c, broadcast, batches[k], **extra[k])
            for k, c in enumerate(clients)
        ]

    def from_stack(self, fitted: StackedFit) -> list[dict[str, Any]]:
        """Per client of a stacked fit, keyword arguments of :meth:`finish` computed from the
        fitted stack at once (:meth:`StackedFit.outputs`); none here."""
        return [{} for _ in range(fitted.segments.copies)]

    def prepare(
        self, module: ContinualNodeClassifier, client: FederatedClient, broadcast: ServerBroadcast
    ) -> Any:
        """Before a client's fit: its stage's start (:meth:`begin_stage`), the broadcast and
        the stage's classes and teacher in ``module``; returns its training batch."""
        t = self.stage_of(broadcast.round)
        global_state = model_state(broadcast.tensors)
        if client.state.get("stage") != t:
            self.begin_stage(client, t, global_state)
        module.receive(global_state)
        known = torch.tensor(self.stream.known(t), dtype=torch.long)
        module.set_stage(known, client.state.get("teacher"), client.state.get("teacher_known"))
        return self.batch_at(client, t)

    def finish(
        self,
        module: ContinualNodeClassifier,
        client: FederatedClient,
        broadcast: ServerBroadcast,
        batch: Any,
    ) -> ClientUpdate:
        """After a client's fit (its weights in ``module``): its update."""
        update = self.make_update(module, client, broadcast.round)
        examples = int(batch.sup_mask.sum()) + int(batch.replay_mask.sum())
        update.scalars["num_examples"] = float(examples)
        return update
