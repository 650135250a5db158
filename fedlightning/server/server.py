"""The server: global model state, aggregation, broadcast. No Lightning here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from fedlightning.messages import ClientUpdate, ServerBroadcast, detach_state
from fedlightning.server.aggregate import as_model_fields, bound_update, fedavg
from fedlightning.server.robust import RobustRule, global_update, robust_aggregate

Aggregator = Callable[[Sequence[ClientUpdate]], dict[str, Tensor]]


class ServerModule:
    """Method-specific server memory (bases, prototype banks) that plugs into a :class:`Server`.

    A module sees messages only; every verb defaults to doing nothing.

    ``secure_sum``: whether a secure sum (``federation.secure_sum=true``) can carry what the
    module reads, ``None`` when it can, else why not (one line, refused before training)."""

    secure_sum: str | None = None

    def setup(self, global_state: dict[str, Tensor], num_clients: int) -> None:
        """Before the first round (and before a resume loads its state): the initial global
        model and the number of clients ``N`` of the federation (SCAFFOLD's ``1/N``)."""

    def summed_prototypes(self, global_state: dict[str, Tensor]) -> tuple[int, int] | None:
        """``(classes, dim)`` of the per-class prototype sums a secure sum must carry for
        this module (FedOGL's prototype bank), or ``None`` when it reads none."""
        return None

    def summed_fields(self) -> tuple[str, ...]:
        """The prefixes of the extra uplink fields this module reads only as their plain sum
        over the round's clients (SCAFFOLD's ``control_delta.``): a secure sum carries them
        masked and hands :meth:`aggregate` one update holding each field's sum. Default:
        none. A module that reads its fields otherwise sets :attr:`secure_sum` instead."""
        return ()

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        """Take in one round's updates (after the model aggregation)."""

    def update_global(self, round: int, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The global state after this module's refinement (default: unchanged)."""
        return state

    def end_stage(self, stage: int, updates: Sequence[ClientUpdate]) -> None:
        """Take in a stage-end exchange's updates (FedOGL's residual bases, say)."""

    def broadcast_fields(self) -> dict[str, Tensor]:
        """Fields this module adds to every broadcast."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Server:
    """Holds the global model and turns client updates into the next global model.

    ``aggregator`` maps ``updates -> new global state``; named ``modules`` (method-specific
    memory) run after it in order. Every server, FedTIP's included, answers the same verbs:
    :meth:`broadcast`, :meth:`aggregate`, :meth:`end_stage`, :meth:`state_dict`.

    ``max_update_norm`` and ``max_client_weight`` bound each client's influence before the
    aggregator and the modules see its update (:func:`bound_update`; ``None``: off).
    :attr:`weight_bounds` (client id -> the most examples it can hold: its subgraph's node
    count, set by the program that made the partition) caps each client's weight too, and
    the round refuses a message that claims more (docs/security.md, "Bounded influence")."""

    def __init__(
        self,
        global_state: dict[str, Tensor],
        aggregator: Aggregator = fedavg,
        modules: dict[str, ServerModule] | None = None,
        max_update_norm: float | None = None,
        max_client_weight: float | None = None,
    ) -> None:
        self.global_state = detach_state(global_state)
        self.aggregator = aggregator
        self.modules = dict(modules or {})
        self.max_update_norm, self.max_client_weight = max_update_norm, max_client_weight
        self.weight_bounds: dict[int, float] = {}
        # ``federation.robust`` (set by the program that builds the run): the model is then
        # aggregated by a robust rule; ``flagged``: the last round's suspicious clients
        self.robust: RobustRule | None = None
        self.flagged: list[tuple[int, str]] = []
        self.previous: Tensor | None = None  # the last global update, the rule's reference

    def setup(self, num_clients: int) -> None:
        """Tell every module the initial global model and the number of clients."""
        for mod in self.modules.values():
            mod.setup(self.global_state, num_clients)

    def broadcast(self, round: int) -> ServerBroadcast:
        """The message every sampled client receives at the start of ``round``."""
        tensors = as_model_fields(self.global_state)
        for mod in self.modules.values():
            tensors.update(mod.broadcast_fields())
        return ServerBroadcast(round=round, tensors=detach_state(tensors))

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        """Aggregate one round's client updates into the global state."""
        if not updates:
            raise ValueError(f"round {round}: no client updates to aggregate")
        if self.max_update_norm is not None or self.max_client_weight is not None:
            updates = [
                bound_update(u, self.global_state, self.max_update_norm, self.weight_cap(u))
                for u in updates
            ]
        elif self.weight_bounds:
            updates = [
                bound_update(u, self.global_state, None, self.weight_cap(u)) for u in updates
            ]
        before, robust = self.global_state, self.robust is not None and self.robust.on
        if robust:
            self.global_state, updates, self.flagged = robust_aggregate(
                self.robust, updates, self.global_state, self.previous
            )
        else:
            self.global_state = self.aggregator(updates)
        for mod in self.modules.values():
            mod.aggregate(round, updates)
            self.global_state = mod.update_global(round, self.global_state)
        if robust and self.robust.remembers:
            self.previous = global_update(self.global_state, before)

    def weight_cap(self, update: ClientUpdate) -> float | None:
        """The most weight ``update``'s client may have: ``max_client_weight`` and its bound
        in :attr:`weight_bounds`, the smaller (``None``: unbounded). A secure sum's
        aggregate (no client) is left alone: its clients capped their weights before
        masking."""
        if update.client_id < 0:
            return None
        caps = [self.max_client_weight, self.weight_bounds.get(update.client_id)]
        known = [float(c) for c in caps if c is not None]
        return min(known) if known else None

    def end_stage(self, stage: int, updates: Sequence[ClientUpdate]) -> None:
        """A stage-end exchange (e.g. FedOGL's residual bases) reaches the server modules."""
        for mod in self.modules.values():
            mod.end_stage(stage, updates)

    def state_dict(self) -> dict[str, Any]:
        robust = {} if self.previous is None else {"robust_previous": self.previous}
        return {
            "global_state": self.global_state,
            "modules": {k: m.state_dict() for k, m in self.modules.items()},
            **robust,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_state = detach_state(state["global_state"])
        self.previous = state.get("robust_previous")
        for k, m in self.modules.items():
            m.load_state_dict(state["modules"][k])
