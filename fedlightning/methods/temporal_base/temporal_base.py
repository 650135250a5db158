"""The base of every method on FedTIP's task protocol (paper 001, Sec. 3.2-3.3 and 5.1):
FedTIP itself and its baselines subclass :class:`TemporalMethod`, which declares, with their
defaults, the hooks :mod:`~fedlightning.programs.temporal_program` reads (the task verbs the
task loop calls are :class:`~fedlightning.federation.algorithm.Algorithm`'s)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fedlightning.clients.temporal_prompt import score_segment
from fedlightning.errors import ConfigError
from fedlightning.federation.algorithm import Algorithm
from fedlightning.federation.task_loop import Batch, TaskBatches
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.server.privacy import PrototypeRelease
from fedlightning.server.reliability import coverage_of, update_norm
from fedlightning.server.validation import Field, MessageSpec, Rule, close

NEGATIVES = ("protocol", "unfiltered")
CLASSES = (0, 1)  # the label set of Eq. (27): node states, or negative/positive links


def support_size(task: TaskBatches) -> Callable[[int], float]:
    """A client's support size in ``task`` (the server knows it from the task manifest)."""

    def support(k: int) -> float:
        batch = task.clients.get(k)
        return float(len(batch["h_u"])) if batch is not None else math.inf

    return support


@dataclass
class TemporalMethod(Algorithm):
    """The settings every temporal method reads (conf/algorithm/temporal_base.yaml):
    ``mode`` (one of :attr:`modes`), ``aggregation`` (one of :attr:`aggregations`),
    ``anchors`` (only where :attr:`anchored`), ``negatives``: the training negatives,
    ``protocol`` (Eq. 25) or ``unfiltered``; ``tau``: the temperature of the task losses
    (Eqs. 19-21); ``lr``, ``weight_decay``: the local optimizer's.

    Hooks the temporal program reads, each with its default here:
    :meth:`attach` (before anything else), :meth:`materialize_views`, :meth:`variant` (the
    run's tag, which depends on the bank: a verb here where a graph method's is a fixed name), :meth:`use_secure_sum` (``federation.secure_sum``), :attr:`release` and
    :meth:`privacy_budget` (summary.json's ``privacy``), :meth:`message_size` (the message
    counted by hand), :attr:`flower_nodes`, :attr:`task_robust`, :attr:`pool_tasks`."""

    name: str = "temporal"
    mode: str = "federated"
    aggregation: str = "fedavg"
    anchors: bool = False
    negatives: str = "protocol"
    tau: float = 0.1
    lr: float = 1e-3
    weight_decay: float = 1e-5
    modes: ClassVar[tuple[str, ...]] = ("federated",)
    aggregations: ClassVar[tuple[str, ...]] = ("fedavg",)
    anchored: ClassVar[bool] = False  # the method has anchor prototypes (FedTIP)
    secure_sums: ClassVar[bool] = False  # its task server sums masked shares (FedTIP's)
    secure_seed = None  # federation.secure_sum: the run's seed (use_secure_sum)
    snapshot = protocol = None  # the bank's snapshot encoder and the protocol (attach)

    def __post_init__(self) -> None:
        for key, value, allowed in (
            ("mode", self.mode, self.modes),
            ("aggregation", self.aggregation, self.aggregations),
            ("negatives", self.negatives, NEGATIVES),
        ):
            if value not in allowed:
                raise ValueError(f"algorithm.{key} must be one of {allowed}, got {value!r}")
        if self.anchors and not self.anchored:
            raise ConfigError("algorithm.anchors", f"{self.name} has no anchor prototypes")
        self.release = PrototypeRelease.from_settings(None)  # no release (FedTIP's: Eq. 7)

    def attach(self, snapshot: Any, protocol: Any) -> dict[str, str] | None:
        """The bank's snapshot encoder and the protocol, before the first task; the hashes of
        what the method derives from them (``None``: nothing)."""
        self.snapshot, self.protocol = snapshot, protocol
        return None

    def variant(self, pretrained_bank: bool = True, filtered_bank: bool = True) -> str:
        """The run's ``variant`` tag: ``no_`` and the components off (``tkb``: a pre-trained
        bank; ``ftn``: filtered training negatives), or ``full``."""
        on = {"tkb": pretrained_bank, "ftn": filtered_bank and self.negatives == "protocol"}
        off = [k for k, v in on.items() if not v]
        return "no_" + "_".join(off) if off else "full"

    def use_secure_sum(self, seed: int, max_update_norm: float | None = None) -> None:
        """``federation.secure_sum``: the run's seed and each client's clip of its delta,
        kept for a task server that sums masked shares (:attr:`secure_sums`: FedTIP's); a
        method whose server aggregates in the clear is refused in one line, before any
        data loads."""
        if not self.secure_sums:
            raise ConfigError(
                "federation.secure_sum",
                f"{self.name}'s task server aggregates the clients' messages in the clear; "
                "only FedTIP's sums masked shares (docs/security.md): set "
                "federation.secure_sum=false",
            )
        self.secure_seed, self.max_update_norm = int(seed), max_update_norm

    def privacy_budget(self, tasks: int, rounds: int, families: Sequence[str]) -> dict[str, Any]:
        """The budget of one release per task, prototype-sending family and round (none
        without :attr:`release` or with pooled supports)."""
        sending = [f for f in families if "prototypes" in self.message_fields(f)]
        released = self.release.on and not self.pooled
        return self.release.budget(tasks * rounds * len(sending) if released else 0)

    def message_fields(self, family: str) -> tuple[str, ...]:
        """Delta and counts; prototypes for anchors or ``nc``; coverage, norm for reliability."""
        fields = ["delta", "counts"]
        if self.anchors or family == "nc":
            fields.append("prototypes")
        if self.aggregation == "reliability":
            fields += ["coverage", "norm"]
        return tuple(fields)

    def message_size(self, adapter: Any, family: str, classes: int = 2) -> int:
        """Float32 values of one Eq. (2) message with :meth:`message_fields`."""
        fields = self.message_fields(family)
        n = adapter.num_values() + classes
        n += classes * adapter.d_h if "prototypes" in fields else 0
        return n + (2 if "coverage" in fields else 0)

    def task_scores(
        self, adapter: Any, prototypes: dict[int, Any], batch: Batch, family: str
    ) -> dict[str, float]:
        """The server's AUC-ROC of one segment (:func:`score_segment`)."""
        return score_segment(adapter, prototypes, batch, family)

    def task_uplink(
        self,
        task: TaskBatches,
        family: str,
        broadcast: ServerBroadcast,
        width: int,
        field: str = "adapter",
    ) -> MessageSpec:
        """Eq. (2)'s declared message (:meth:`message_fields`): ``delta`` like ``field``;
        whole ``count.<c>`` within the support (twice it for ``lp``); ``proto.<c>`` with its
        count; ``coverage`` and ``norm`` as the server recomputes them (Eq. 27)."""
        fields = self.message_fields(family)
        classes, support = frozenset(CLASSES), support_size(task)
        declared = [
            Field("delta", dtype="like", like=lambda m: field),
            Field(r"count\.(?P<c>\d+)", tensor=False, low=1.0, high=support, integral=True,
                  classes=classes, required=False),
        ]  # fmt: skip
        if "prototypes" in fields:
            declared.append(Field(r"proto\.(?P<c>\d+)", shape=(width,), classes=classes,
                                  required=False))  # fmt: skip
        if "coverage" in fields:
            declared += [
                Field("coverage", tensor=False, low=0.0, high=1.0),
                Field("norm", tensor=False, low=0.0),
            ]
        per_event = 1 if family == "nc" else 2

        def counts_fit(u: ClientUpdate) -> str | None:
            total = sum(v for k, v in u.scalars.items() if k.startswith("count."))
            cap = per_event * support(u.client_id)
            return (
                f"count.*: counts sum to {total:g}, the support holds {cap:g}"
                if total > cap
                else None
            )

        def paired(u: ClientUpdate) -> str | None:
            if "prototypes" not in fields:
                return None
            protos = {k.split(".")[1] for k in u.tensors if k.startswith("proto.")}
            counts = {k.split(".")[1] for k in u.scalars if k.startswith("count.")}
            for c in sorted(protos ^ counts):
                name = f"proto.{c}" if c in protos else f"count.{c}"
                return f"{name}: a prototype and its count travel together"
            return None

        def reported(u: ClientUpdate) -> str | None:
            if "coverage" not in fields:
                return None
            counts = {int(k[6:]): int(v) for k, v in u.scalars.items() if k.startswith("count.")}
            for name, mine in (
                ("coverage", coverage_of(counts, CLASSES)),
                ("norm", update_norm(u.tensors["delta"])),
            ):
                if not close(float(u.scalars[name]), mine):
                    return f"{name}: reports {u.scalars[name]:g}, the server recomputes {mine:g}"
            return None

        rules = (
            Rule(counts_fit, reads=(r"count\..+",)),
            Rule(paired),
            Rule(reported, reads=("coverage", "norm", "delta", r"count\..+")),
        )
        return MessageSpec(tuple(declared), rules=rules, reference=broadcast)
