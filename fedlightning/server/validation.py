"""Declared messages and the one check every incoming message goes through (docs/security.md).

An algorithm declares its uplink (and downlink) as a :class:`MessageSpec`: the fields it may
carry (exact names or patterns), each one's kind (tensor or scalar), shape rule, dtype and
valid range, plus the message-wide rules that tie fields together (:class:`Rule`: a
prototype needs its count, a reported norm must match the delta's). :func:`screen` checks
one round's updates against it before aggregation and returns the ones kept and one
:class:`Rejection` per message dropped, naming the client, the field and the rule. No
Lightning here.

Under secure sums some fields arrive masked (:attr:`MessageSpec.masked`): their shapes and
dtypes are still checked, their values (finiteness, ranges, rules that read them) are not."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from fedlightning.messages import ClientUpdate, Message

# a shape rule: a fixed shape (``-1``: any length on that axis), or
# ``(match, reference message) -> shape`` (``None``: the field is not allowed here)
ShapeRule = tuple[int, ...] | Callable[[re.Match, Message | None], tuple[int, ...] | None] | None
Bound = float | Callable[[int], float]  # a number, or ``client id -> number``


@dataclass(frozen=True)
class Field:
    """One declared field (or family of fields).

    Attributes:
        name: the field's name, or a regular expression (full match) for a family of fields
            such as ``proto\\.(?P<c>\\d+)``; a named group ``c`` is a class id.
        tensor: a tensor field (else a scalar).
        shape: tensors: a fixed shape (``-1`` on an axis: any length), or a rule
            ``(match, reference) -> shape`` (e.g. "the broadcast's field of the same name").
        dtype: tensors: the required dtype; ``"like"``: the reference field's (with
            ``like``); ``None``: any floating dtype; ``"any"``: any dtype.
        like: ``match -> name`` of the reference message's field whose shape and dtype this
            one must have (the global model's ``model.<key>``, say).
        low, high: the valid range, inclusive (scalars); a bound may depend on the client.
        integral: the scalar is a whole number (a count).
        required: the message must carry it (a pattern: at least one field matching it).
        classes: the allowed values of the name's ``c`` group (``None``: any)."""

    name: str
    tensor: bool = True
    shape: ShapeRule = None
    dtype: torch.dtype | str | None = None
    like: Callable[[re.Match], str] | None = None
    low: Bound = -math.inf
    high: Bound = math.inf
    integral: bool = False
    required: bool = True
    classes: frozenset[int] | None = None

    def match(self, name: str) -> re.Match | None:
        return re.fullmatch(self.name, name)


@dataclass(frozen=True)
class Rule:
    """A message-wide rule: ``check(update) -> violation`` (``"<field>: <rule>"``) or
    ``None``. ``reads``: the fields whose values it reads (patterns): skipped when one of
    them arrives masked."""

    check: Callable[[ClientUpdate], str | None]
    reads: tuple[str, ...] = ()


@dataclass(frozen=True)
class MessageSpec:
    """What one kind of message may carry.

    Attributes:
        fields: the declared fields; a field no declaration matches is refused.
        rules: message-wide rules (:class:`Rule`).
        optional: a client may send nothing (a stage-end exchange); otherwise a client
            that sends nothing is recorded as dropped.
        masked: patterns of the fields that arrive masked (secure sums): shape and dtype
            are checked, values are not.
        reference: the message the ``like`` and shape rules read (the round's broadcast)."""

    fields: tuple[Field, ...]
    rules: tuple[Rule, ...] = ()
    optional: bool = False
    masked: tuple[str, ...] = ()
    reference: Message | None = None

    def with_masked(self, *patterns: str) -> MessageSpec:
        """The same declaration with ``patterns`` arriving masked (secure sums)."""
        return replace(self, masked=(*self.masked, *patterns))

    def is_masked(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.masked)


@dataclass(frozen=True)
class Rejection:
    """A message the server dropped (or a client that sent none): ``field`` and ``rule``
    say why (``field`` is empty for a client dropped as a whole)."""

    round: int
    client: int
    field: str
    rule: str
    values: int = 0  # the values the refused message carried

    def line(self) -> str:
        where = f" field `{self.field}`" if self.field else ""
        return f"round {self.round}: client {self.client}{where} rejected: {self.rule}"


def _bound(bound: Bound, client: int) -> float:
    return float(bound(client) if callable(bound) else bound)


def _shape_ok(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    return len(shape) == len(want) and all(w in (-1, s) for s, w in zip(shape, want, strict=True))


def check_field(
    spec: Field, m: re.Match, name: str, value: Any, client: int, masked: bool, ref: Any
) -> str | None:
    """The rule ``value`` breaks as field ``name`` of client ``client`` (``None``: none)."""
    if m.groupdict().get("c") is not None and m["c"] != str(int(m["c"])):
        return f"class id `{m['c']}` is not canonical: write it `{int(m['c'])}` (one name a class)"
    if spec.classes is not None and "c" in m.groupdict() and int(m["c"]) not in spec.classes:
        return f"class {m['c']} is not one of this round's classes {sorted(spec.classes)}"
    if spec.tensor:
        if not isinstance(value, Tensor):
            return f"must be a tensor, got a {type(value).__name__}"
        odd = _odd_tensor(value)
        if odd:
            return odd
        other = ref.tensors.get(spec.like(m)) if spec.like is not None and ref else None
        if spec.like is not None and ref is not None and other is None:
            return f"no field `{spec.like(m)}` in the broadcast to match"
        if other is not None and value.device != other.device:
            return f"on device {value.device}, expected {other.device}"
        want = tuple(other.shape) if other is not None else spec.shape
        if callable(want):
            want = want(m, ref)
            if want is None:
                return "not allowed in this round"
        if want is not None and not _shape_ok(tuple(value.shape), tuple(want)):
            return f"shape {list(value.shape)}, expected {list(want)}"
        dtype = other.dtype if spec.dtype == "like" and other is not None else spec.dtype
        if isinstance(dtype, torch.dtype) and value.dtype != dtype:
            return f"dtype {value.dtype}, expected {dtype}"
        if dtype is None and not value.dtype.is_floating_point:
            return f"dtype {value.dtype}, expected a floating dtype"
        if not masked and value.dtype.is_floating_point and not bool(torch.isfinite(value).all()):
            return "non-finite values (NaN or Inf)"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got a {type(value).__name__}"
    if masked:
        return None
    try:
        x = float(value)
    except OverflowError:
        return "a whole number beyond any float (more than 1.8e308 in size)"
    if not math.isfinite(x):
        return f"non-finite value {x}"
    low, high = _bound(spec.low, client), _bound(spec.high, client)
    if not low <= x <= high:
        return f"{x:g} is outside [{low:g}, {high:g}]"
    if spec.integral and x != int(x):
        return f"{x:g} is not a whole number"
    return None


def _odd_tensor(value: Tensor) -> str | None:
    """Why ``value`` is not a plain dense tensor with data (``None``: it is one)."""
    if type(value) not in (Tensor, torch.nn.Parameter):
        return f"must be a plain tensor, got a {type(value).__name__}"
    if value.is_meta:
        return "a meta tensor (no data)"
    if value.is_nested or value.is_quantized or value.layout != torch.strided:
        kind = "nested" if value.is_nested else "quantized" if value.is_quantized else "sparse"
        return f"a {kind} tensor, expected a dense one"
    return None


def validate(update: ClientUpdate, spec: MessageSpec) -> tuple[str, str] | None:
    """``(field, rule)`` of the first declared rule ``update`` breaks, else ``None``."""
    seen: dict[int, int] = {}
    ref = spec.reference
    for kind, fields in (("tensor", update.tensors), ("scalar", update.scalars)):
        if not isinstance(fields, dict):
            return "", f"{kind}s must be a mapping of names to values"
        for name, value in fields.items():
            if not isinstance(name, str):
                return _name(name), f"a {kind} field name must be text"
            found = [
                (i, f, m)
                for i, f in enumerate(spec.fields)
                if f.tensor == (kind == "tensor") and (m := f.match(str(name)))
            ]
            if not found:
                return str(name), f"undeclared {kind} field"
            i, f, m = found[0]
            seen[i] = seen.get(i, 0) + 1
            broken = check_field(
                f, m, name, value, update.client_id, spec.is_masked(str(name)), ref
            )
            if broken:
                return str(name), broken
    for i, f in enumerate(spec.fields):
        if f.required and i not in seen:
            return f.name, f"missing required {'tensor' if f.tensor else 'scalar'} field"
    names = [*update.tensors, *update.scalars]
    for rule in spec.rules:
        if any(spec.is_masked(n) for n in names for p in rule.reads if re.fullmatch(p, n)):
            continue
        broken = rule.check(update)
        if broken:
            name, _, why = broken.partition(": ")
            return name, why
    return None


def screen(
    round: int,
    client_ids: Sequence[int],
    updates: Iterable[tuple[int, ClientUpdate]],
    spec: MessageSpec | None,
) -> tuple[list[ClientUpdate], list[Rejection]]:
    """The updates of ``round`` that the server keeps, and one :class:`Rejection` per
    message dropped. ``updates``: ``(position, update)`` with ``position`` the client's
    place in ``client_ids`` (who was asked). Every message must name the current round and
    the client it came from, once; with a ``spec`` it must match the declaration, and
    without one its values must still be finite."""
    kept, rejected = [], []
    seen: set[int] = set()
    spec = spec or ANY
    for pos, u in updates:
        asked = client_ids[pos]
        why = _checked(u, round, asked, seen, spec)
        if why is not None:
            field, rule = _name(why[0]), _one_line(why[1])
            rejected.append(Rejection(round, asked, field, rule, _values(u)))
            continue
        seen.add(u.client_id)
        kept.append(u)
    return kept, rejected


def _checked(
    u: Any, round: int, asked: int, seen: set[int], spec: MessageSpec
) -> tuple[str, str] | None:
    """The identity checks, then the declaration: the first ``(field, rule)`` broken. Never
    raises: a value no rule foresaw that makes a check fail is itself a broken rule."""
    try:
        return _identity(u, round, asked, seen) or validate(u, spec)
    except Exception as e:  # a client's object must not end the run; its message is dropped
        return "", f"message could not be checked ({type(e).__name__})"


def _one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line, at most ``limit`` characters (a rule may quote client data)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _name(name: Any) -> str:
    """A field name as the rejection line shows it: text, one line, short."""
    return _one_line(name if isinstance(name, str) else repr(name), 80)


def _values(u: Any) -> int:
    """The values a refused message carried (whatever its fields hold; 0 when unknown)."""
    try:
        tensors, scalars = getattr(u, "tensors", {}), getattr(u, "scalars", {})
        if not isinstance(tensors, dict) or not isinstance(scalars, dict):
            return 0
        sizes = (t.numel() if isinstance(t, Tensor) else 1 for t in tensors.values())
        return int(sum(sizes)) + len(scalars)
    except Exception:  # a tensor that cannot say its size (a broken subclass): none counted
        return 0


def _identity(u: Any, round: int, asked: int, seen: set[int]) -> tuple[str, str] | None:
    if not isinstance(u, ClientUpdate):
        return "", f"not a ClientUpdate ({type(u).__name__})"
    if isinstance(u.round, bool) or not isinstance(u.round, int) or u.round != round:
        return "round", f"message of round {_short(u.round)}, the current round is {round}"
    if isinstance(u.client_id, bool) or not isinstance(u.client_id, int):
        return "client_id", f"must be a whole number, got a {type(u.client_id).__name__}"
    if u.client_id != asked:
        return "client_id", f"message names client {_short(u.client_id)}, sent for client {asked}"
    if u.client_id in seen:
        return "client_id", f"a second message from client {u.client_id} this round"
    return None


def _short(value: Any) -> str:
    """``repr(value)`` cut short (a client may send a 10**400-digit round)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge number"
    return _one_line(text, 40)


# ---------------------------------------------------------------- shared declarations
ANY = MessageSpec(
    fields=(Field(r".+", dtype="any", required=False), Field(r".+", tensor=False, required=False)),
    optional=True,
)  # an undeclared kind of message: any field, finite values
NUM_EXAMPLES = Field("num_examples", tensor=False, low=0.0, integral=True)
TRAIN_LOSS = Field("train_loss", tensor=False)


def bounded_weights(spec: MessageSpec, bounds: dict[int, float]) -> MessageSpec:
    """``spec`` with each client's ``num_examples`` at most its bound in ``bounds`` (client
    id -> what the server knows of it: the node count of the subgraph its partition gave
    it, or a declared maximum); a client without a bound keeps the declared range."""

    def high(old: Bound) -> Callable[[int], float]:
        return lambda k: min(_bound(old, k), float(bounds.get(k, math.inf)))

    fields = tuple(
        replace(f, high=high(f.high)) if f.name == NUM_EXAMPLES.name and not f.tensor else f
        for f in spec.fields
    )
    return replace(spec, fields=fields)


def model_fields(prefix: str = "model.") -> Field:
    """The model's weights, ``model.<key>``: each as the broadcast's field of that name."""
    return Field(re.escape(prefix) + r".+", shape=None, dtype="like", like=lambda m: m[0])


def complete(reference: Message, prefix: str = "model.") -> Rule:
    """Every ``<prefix>...`` field of ``reference`` (the broadcast) must come back: a
    partial model is refused."""
    want = [k for k in reference.tensors if k.startswith(prefix)]

    def check(update: ClientUpdate) -> str | None:
        missing = [k for k in want if k not in update.tensors]
        return f"{missing[0]}: missing ({len(missing)} of the model's fields)" if missing else None

    return Rule(check)


def close(reported: float, recomputed: float, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """``reported`` equals ``recomputed`` within float32 rounding."""
    return abs(reported - recomputed) <= atol + rtol * abs(recomputed)
