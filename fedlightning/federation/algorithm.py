"""What a federated method declares (:class:`Algorithm`), and a client's persistent state."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import lightning.pytorch as pl
from torch import nn
from torch_geometric.data import Data

from fedlightning.errors import ConfigError
from fedlightning.messages import ClientUpdate, ServerBroadcast, detach_state
from fedlightning.server import Server
from fedlightning.server.aggregate import as_model_fields, model_state
from fedlightning.server.validation import (
    NUM_EXAMPLES,
    TRAIN_LOSS,
    Field,
    MessageSpec,
    complete,
    model_fields,
)


def check_bounds(
    max_update_norm: float | None, max_client_weight: float | None
) -> tuple[float | None, float | None]:
    """``algorithm.max_update_norm`` and ``algorithm.max_client_weight``: ``None`` or > 0."""
    out = []
    for key, value in (
        ("max_update_norm", max_update_norm),
        ("max_client_weight", max_client_weight),
    ):
        if value is None:
            out.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"algorithm.{key}", f"must be a number > 0 or null, got {value!r}")
        if not math.isfinite(float(value)):
            raise ConfigError(f"algorithm.{key}", f"must be finite, got {value!r}")
        out.append(float(value))
    return out[0], out[1]


@dataclass
class FederatedClient:
    """Client ``client_id`` (``0..K-1``): its subgraph ``data`` (with ``train_mask``,
    ``val_mask``, ``test_mask``) and the ``state`` it keeps between rounds, checkpointed
    whole (methods add entries: replay memory, teacher weights, ...)."""

    client_id: int
    data: Data
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_train(self) -> int:
        return int(self.data.train_mask.sum())


class Algorithm:
    """The verbs a federated method declares; the schedules and the round call only these.

    Every verb has a default, so a method overrides what it changes (docs/architecture.md,
    "Adding a method"); :meth:`stage_end_update` is asked only when :attr:`stage_end_exchange`.

    Attributes:
        name, variant: the ``method`` and ``variant`` tags of a run.
        continual: the method needs the class-incremental stream (``protocol=cil``).
        stage_end_exchange: the method exchanges messages after every stage.
        evaluation: what a stage's end measures (``classes``: accuracy and rejection of the
            logits; ``retrieval``: :mod:`~fedlightning.federation.retrieval_stages`).
        personalized: every client is evaluated with its own weights (:meth:`eval_state`).
        pooled: the clients' supports are pooled on one client (FedTIP's ``central``): no
            messages are counted.
        pool_tasks: the tasks may run on forked processes (``task_workers``): nothing but the
            ledger carries between tasks (false with a one-off :meth:`before_tasks`).
        report_train_loss: clients also send ``train_loss`` (``federation.report_train_loss``).
        max_update_norm, max_client_weight: the FedAvg-family server's bounds (``None``: off;
            docs/security.md), checked by :func:`check_bounds`.
        score: the rejection score of the logits (``msp``, ``energy``; ``None``: the method's).
        calibrate_direction: the score's sign is set on validation (TopoOOD, GRASP, CLIPN).
        release: the differentially private prototype release (``None``: none).
        flower_nodes: the method's clients can run on Flower nodes.
        local_fit_share: the stacked form of :meth:`local_fit`, ``(module, clients,
            broadcast, executor, epochs, seeds) -> updates`` (``None``: one client at a time,
            :func:`~fedlightning.federation.stacking.why_not_stacked`).
        task_robust: ``federation.robust`` on a temporal run (``None``: the method's own
            aggregation; docs/security.md, "FedTIP's adapter")."""

    name = "base"
    variant = "full"
    continual: ClassVar[bool] = False
    stage_end_exchange: ClassVar[bool] = False
    evaluation: ClassVar[str] = "classes"
    personalized: ClassVar[bool] = False
    pooled: bool = False
    pool_tasks: ClassVar[bool] = True
    report_train_loss: bool = False
    max_update_norm: float | None = None
    max_client_weight: float | None = None
    score: str | None = None
    calibrate_direction: ClassVar[bool] = False
    release: Any = None
    flower_nodes: ClassVar[bool] = True
    local_fit_share: Any = None
    task_robust: Any = None

    def client_module(self, net: nn.Module, optimizer: Any) -> pl.LightningModule:
        raise NotImplementedError

    def callbacks(self) -> list[pl.Callback]:
        return []

    def server(self, global_state: dict) -> Server:
        """The method's server; by default FedAvg aggregation (with the method's bounds) and
        no modules."""
        return Server(global_state, **self.bounds())

    def bounds(self) -> dict[str, float | None]:
        """The server's bounds on each client's influence (:class:`Server`'s arguments)."""
        return {
            "max_update_norm": self.max_update_norm,
            "max_client_weight": self.max_client_weight,
        }

    def setup(self, stream: Any, rounds_per_stage: int, seed: int, num_classes: int) -> None:
        """Learn the stream's schedule before the first round (class-incremental methods)."""

    def class_incremental(self) -> Algorithm | None:
        """The method as it runs in the class-incremental stream (``protocol=cil``): itself
        when :attr:`continual`, else a composition with the stream's stage wiring (the FedAvg
        family: ``fedlightning/methods/fedavg/class_incremental.py``), or ``None``: it has
        no class-incremental form and the run is refused before any data loads."""
        return self if self.continual else None

    def prepare_clients(self, clients: list[FederatedClient]) -> None:
        """Adjust the run's clients once, when the schedule is built (PRISM hides the
        deficient clients' modality); may refuse the run with a ``ConfigError``."""

    def eval_state(self, client: FederatedClient, broadcast: ServerBroadcast) -> dict:
        """With :attr:`personalized`: the weights ``client`` is evaluated with, given the
        server's next broadcast (default: the broadcast's model)."""
        return model_state(broadcast.tensors)

    # ------------------------------------------------------------------ task verbs
    # What :class:`~fedlightning.federation.task_loop.TaskLoop` calls per task and family
    # (FedTIP and its comparators: ``fedlightning/methods/fedtip/``); a graph method
    # declares none of them.

    def adapter(self, d_h: int, d_t: int, d_e: int) -> nn.Module:
        """A task's fresh trainable model (FedTIP's prompt adapter), its initial weights
        drawn under the loop's seed for the task and family."""
        raise NotImplementedError(f"{type(self).__name__} runs no tasks")

    def task_module(self, adapter: nn.Module, family: str) -> pl.LightningModule:
        """The client LightningModule that fits ``adapter`` on a family's supports."""
        raise NotImplementedError(f"{type(self).__name__} runs no tasks")

    def task_server(self, module: pl.LightningModule) -> Any:
        """The task's server, starting from ``module``'s initial weights. With
        :attr:`task_robust` set, the task loop hands it the rule
        (:func:`~fedlightning.server.reliability.with_robust`)."""
        raise NotImplementedError(f"{type(self).__name__} runs no tasks")

    def task_work(
        self, context: Any, task: Any, family: str, module: Any, broadcast: ServerBroadcast
    ) -> Any:
        """A round's client work (a :class:`~fedlightning.federation.round.ClientWork`):
        the task's clients' fits on ``broadcast``, with the declared uplink."""
        raise NotImplementedError(f"{type(self).__name__} runs no tasks")

    def task_result(self, module: Any, adapter: nn.Module, server: Any) -> tuple[nn.Module, dict]:
        """After a task's rounds: the global adapter and the class prototypes it is scored by."""
        raise NotImplementedError(f"{type(self).__name__} runs no tasks")

    def pooled_fit(
        self, context: Any, task: Any, family: str, module: Any, adapter: nn.Module, rounds: int
    ) -> tuple[nn.Module, dict]:
        """With :attr:`pooled`: one fit on the union of the task's supports, and its class
        prototypes, in place of the rounds."""
        raise NotImplementedError(f"{type(self).__name__} has no pooled training")

    def task_segments(self, loop: Any, segments: dict) -> dict:
        """The server's evaluation batches for the task just run (default: ``segments``)."""
        return segments

    def task_scores(
        self, adapter: nn.Module, prototypes: dict, batch: dict, family: str
    ) -> dict[str, float]:
        """The server's metrics of one evaluation segment (FedTIP: its AUC-ROCs)."""
        raise NotImplementedError(f"{type(self).__name__} runs no tasks")

    def before_tasks(self, loop: Any, ledger: Any, scope: str) -> None:
        """A one-off exchange before the first task a run runs, counted in ``ledger`` under
        ``scope`` (the history baselines' graph view; default: none)."""

    def task_threads(self) -> Any:
        """The context the tasks run in (the history baselines: one torch thread);
        default: as they are."""
        return contextlib.nullcontext()

    def uplink(self, broadcast: ServerBroadcast) -> MessageSpec:
        """The declared uplink of a round (docs/security.md): every ``model.<key>`` as the
        broadcast's field of that name (shape and dtype), ``num_examples`` (a whole number
        >= 0) and, with :attr:`report_train_loss`, ``train_loss``."""
        fields = (model_fields(), NUM_EXAMPLES, *((TRAIN_LOSS,) if self.report_train_loss else ()))
        return MessageSpec(fields, rules=(complete(broadcast),), reference=broadcast)

    def downlink(self, global_state: dict) -> MessageSpec:
        """The declared broadcast, checked every round before a client sees it: the global
        model's fields as the server holds them (each present, shaped and typed as its
        ``global_state`` entry, finite), and any field a server module adds (finite, any
        dtype). A method with its own broadcast fields declares them (SCAFFOLD's
        ``control.<key>``)."""
        reference = ServerBroadcast(0, as_model_fields(global_state))
        modules = Field(r"(?!model\.).+", dtype="any", required=False)
        return MessageSpec(
            (model_fields(), modules), rules=(complete(reference),), reference=reference
        )

    def stage_end_uplink(self, broadcast: ServerBroadcast) -> MessageSpec | None:
        """The declared stage-end message (``None``: the method sends none)."""
        return None

    def make_update(
        self, module: pl.LightningModule, client: FederatedClient, round: int
    ) -> ClientUpdate:
        """The uplink message: the model (parameters and buffers) and its FedAvg weight,
        ``num_examples`` (and the local loss with :attr:`report_train_loss`)."""
        scalars = {"num_examples": float(client.num_train)}
        if self.report_train_loss:
            scalars["train_loss"] = module.last_loss
        return ClientUpdate(
            round=round,
            client_id=client.client_id,
            tensors=as_model_fields(detach_state(module.net.state_dict())),
            scalars=scalars,
        )

    def local_fit(
        self,
        module: pl.LightningModule,
        client: FederatedClient,
        broadcast: ServerBroadcast,
        executor: Any,
        epochs: int,
    ) -> ClientUpdate:
        """Receive the broadcast, train locally for ``epochs`` steps, return the update."""
        module.receive(model_state(broadcast.tensors))
        executor.fit(module, client.data, epochs, self.callbacks())
        return self.make_update(module, client, broadcast.round)

    def stage_end_update(
        self, module: Any, client: FederatedClient, broadcast: ServerBroadcast, stage: int
    ) -> ClientUpdate | None:
        """A client's stage-end message (``None``: it sends nothing)."""
        return None

    def check_optimizer(self, optimizer: Any) -> str | None:
        """Why the local optimizer ``optimizer`` (the ``model.optimizer`` config) does not suit
        the method, or ``None`` (default: any). Asked with the config, before data loads."""
        return None

    def node_score(
        self, logits: Any, known: Any, data: Any, reps: Any, global_state: dict
    ) -> Any | None:
        """Every node's rejection score ``[N]`` by the method's own rule (TopoOOD, GRASP,
        CLIPN), or ``None``: the schedule scores the logits by :attr:`score`."""
        return None

    def query_scores(
        self, net: Any, q: Any, k: Any, data: Any, is_known: Any, global_state: dict
    ) -> Any | None:
        """Every retrieval query's rejection score ``[N]`` by the method's own rule
        (``cir_grasp``, ``cir_clipn``), or ``None``: the top-1 similarity."""
        return None

    def materialize_views(self, cache_dir: Any = None) -> dict[str, str]:
        """Build the method's derived views of the protocol's data once, before the tasks
        (the history baselines' graph), and return their hashes (``{}``: none)."""
        return {}
