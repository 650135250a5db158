"""Typed messages: the only things that cross the client/server boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class Message:
    """Named tensors and numeric scalars sent across the boundary, in a (1-based) ``round``;
    every tensor element and every scalar is one transmitted value."""

    round: int
    tensors: dict[str, Tensor] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)

    def field_sizes(self) -> dict[str, tuple[int, int]]:
        """Field name -> ``(values, bytes)``. A scalar is one value of 4 bytes (float32)."""
        sizes = {k: (t.numel(), t.numel() * t.element_size()) for k, t in self.tensors.items()}
        sizes.update({k: (1, 4) for k in self.scalars})
        return sizes

    def num_values(self) -> int:
        return sum(v for v, _ in self.field_sizes().values())


@dataclass
class ServerBroadcast(Message):
    """Server -> client: the global state a client starts its round from."""


@dataclass
class ClientUpdate(Message):
    """Client -> server: a client's result of one round. Its FedAvg weight travels as the
    scalar field ``num_examples``, counted like every other value."""

    client_id: int = -1

    @property
    def num_examples(self) -> float:
        return float(self.scalars["num_examples"])


def detach_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Copy a state dict so that later in-place updates on either side do not leak across."""
    return {k: v.detach().clone() for k, v in state.items()}


def prefixed(message: Message, prefix: str) -> Message:
    """The message with its fields named ``<prefix>/<field>`` (a FedTIP family's fields in
    the per-field ledger, say); ``prefix=""`` returns ``message`` itself."""
    if not prefix:
        return message
    tensors = {f"{prefix}/{k}": v for k, v in message.tensors.items()}
    scalars = {f"{prefix}/{k}": v for k, v in message.scalars.items()}
    return Message(message.round, tensors, scalars)


# Class prototypes in a message (FedOGL Eq. 11; secure sums read them too): fields
# ``proto.<c>.<q>`` (or ``proto.<modality>.<c>.<q>``) with their supports ``proto_count.<...>``.
PROTO_PREFIX, COUNT_PREFIX = "proto.", "proto_count."


def read_prototypes(update: ClientUpdate, side: str = "") -> list[tuple[int, Tensor, int]]:
    """``(class, prototype, support)`` triples of a message: fields ``proto.<c>.<q>``, or
    ``proto.<side>.<c>.<q>`` for one modality's prototypes (retrieval)."""
    prefix = PROTO_PREFIX + (f"{side}." if side else "")
    out = []
    for key, p in update.tensors.items():
        rest = key[len(prefix) :].split(".")
        if key.startswith(prefix) and rest[0].isdigit():
            count = update.scalars[COUNT_PREFIX + key[len(PROTO_PREFIX) :]]
            out.append((int(rest[0]), p, int(count)))
    return sorted(out, key=lambda x: x[0])
