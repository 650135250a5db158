"""The message screen never raises, whatever a hostile client sends (docs/security.md).

Property-based: hypothesis builds messages of every shape a client could send (huge Python
ints, floats near the float64 limit, NaN and Inf, meta, sparse and nested tensors, wrong
dtypes and devices, nested containers, non-text field names, objects that are not messages)
and checks, for the uplink declarations of FedAvg, FedOGL and FedTIP and for undeclared
work, that :func:`screen` returns, keeps or drops every message, and that each drop is one
line naming the client, the field and the rule.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedlightning.federation.task_loop import TaskBatches  # noqa: E402
from fedlightning.messages import ClientUpdate, ServerBroadcast  # noqa: E402
from fedlightning.methods.fedavg.fedavg import FedAvg  # noqa: E402
from fedlightning.methods.fedogl.fedogl import FedOGL  # noqa: E402
from fedlightning.methods.fedtip.fedtip import FedTIP  # noqa: E402
from fedlightning.server.aggregate import as_model_fields  # noqa: E402
from fedlightning.server.validation import MessageSpec, Rejection, screen  # noqa: E402

STATE = {"w": torch.ones(2, 2), "b": torch.zeros(2), "steps": torch.tensor(3)}
HEAD = {"head.weight": torch.ones(3, 2), "head.bias": torch.zeros(3)}


def specs() -> dict[str, MessageSpec | None]:
    """The uplink declarations the fuzzer checks messages against."""
    plain = ServerBroadcast(1, as_model_fields(STATE))
    ogl = FedOGL()
    ogl.stream = SimpleNamespace(known=lambda t: [0, 1, 2])
    ogl.rounds_per_stage = 1
    task = TaskBatches(0, {k: {"h_u": torch.zeros(10, 1)} for k in range(3)})
    tip_down = ServerBroadcast(1, {"delta": torch.zeros(6)})
    fedavg = FedAvg().uplink(plain)
    return {
        "fedavg": fedavg,
        "fedavg_masked": fedavg.with_masked(r"model\..+", "num_examples"),
        "fedogl": ogl.uplink(ServerBroadcast(1, as_model_fields({**STATE, **HEAD}))),
        "fedtip": FedTIP().task_uplink(task, "nc", tip_down, 3),
        "undeclared": None,
    }


SPECS = specs()


def nested() -> torch.Tensor:
    """A nested tensor (torch warns that the API is a prototype)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


NAMES = [
    "model.w",
    "model.b",
    "model.steps",
    "model.head.weight",
    "num_examples",
    "proto.0.0",
    "proto_count.0.0",
    "proto.0",
    "proto.00",
    "count.0",
    "count.00",
    "count.1",
    "delta",
    "norm",
    "coverage",
    "train_loss",
]

numbers = st.one_of(
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1.7e308, -1.7e308, 1e12, 0.0, -0.0, 5.0, 2**31, 2**63]),
    st.booleans(),
)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Dense tensors of many shapes and dtypes, with hostile values, and their odd kin."""
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    dtype = draw(
        st.sampled_from(
            [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool, torch.complex64]
        )
    )
    fill = draw(st.sampled_from([0.0, 1.0, -1e30, 3e38, float("nan"), float("inf")]))
    kind = draw(st.sampled_from(["dense", "dense", "meta", "sparse", "csr", "param", "view"]))
    t = torch.full(shape, fill).to(dtype) if dtype != torch.bool else torch.zeros(shape).bool()
    if kind == "meta":
        return t.to("meta")
    if kind == "sparse":
        return t.to_sparse()
    if kind == "csr" and t.dim() == 2:
        return t.to_sparse_csr()
    if kind == "param":
        return torch.nn.Parameter(t, requires_grad=False)
    if kind == "view" and t.dim() == 2:
        return t.t()
    return t


leaves = st.one_of(
    numbers,
    tensors(),
    st.text(max_size=5),
    st.none(),
    st.just(nested()),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=12), st.integers(), st.none())


@st.composite
def messages(draw: st.DrawFn) -> object:
    """A message as a hostile client could send it (often almost well-formed)."""
    if draw(st.integers(0, 19)) == 0:
        return draw(values)
    tensors_ = {
        draw(names): draw(st.one_of(tensors(), values)) for _ in range(draw(st.integers(0, 4)))
    }
    scalars = {
        draw(names): draw(st.one_of(numbers, values)) for _ in range(draw(st.integers(0, 4)))
    }
    if draw(st.booleans()):
        tensors_ = {**as_model_fields(STATE), **tensors_}
        scalars = {"num_examples": 10.0, **scalars}
    if draw(st.integers(0, 9)) == 0:
        tensors_ = draw(values)
    rnd = draw(st.one_of(st.just(1), numbers, st.text(max_size=2)))
    client = draw(st.one_of(st.just(0), numbers, st.just(torch.tensor([0, 0]))))
    return ClientUpdate(rnd, tensors_, scalars, client)


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(spec=st.sampled_from(sorted(SPECS)), batch=st.lists(messages(), min_size=1, max_size=2))
def test_the_screen_never_raises_and_names_client_field_and_rule(spec, batch):
    ids = list(range(len(batch)))
    kept, rejected = screen(1, ids, list(enumerate(batch)), SPECS[spec])
    assert len(kept) + len(rejected) == len(batch)
    for r in rejected:
        assert isinstance(r, Rejection) and r.client in ids and r.rule
        line = r.line()
        assert "\n" not in line and f"client {r.client}" in line and r.rule in line
        assert len(line) < 400
    for u in kept:  # what is kept is a message of this round, from its client, finite
        assert isinstance(u, ClientUpdate) and u.round == 1 and u.client_id in ids
        for v in u.scalars.values():
            assert math.isfinite(float(v))


@pytest.mark.parametrize(
    "value, rule",
    [
        (10**400, "beyond any float"),
        (-(10**5000), "beyond any float"),
        (torch.tensor(3.0), "must be a number"),
        ([1, 2], "must be a number"),
        ({"n": 1}, "must be a number"),
    ],
    ids=["10**400", "-10**5000", "tensor", "list", "dict"],
)
def test_odd_num_examples_are_rejected_in_one_line(value, rule):
    u = ClientUpdate(1, as_model_fields(STATE), {"num_examples": value}, 0)
    kept, (r,) = screen(1, [0], [(0, u)], SPECS["fedavg"])
    assert not kept and (r.client, r.field) == (0, "num_examples") and rule in r.rule


@pytest.mark.parametrize(
    "value, rule",
    [
        (torch.ones(2, 2, device="meta"), "meta tensor"),
        (torch.ones(2, 2).to_sparse(), "sparse tensor"),
        (torch.ones(2, 2).to_sparse_csr(), "sparse tensor"),
        (nested(), "nested tensor"),
        ([[1.0, 1.0], [1.0, 1.0]], "must be a tensor"),
    ],
)
def test_odd_tensors_are_rejected_in_one_line(value, rule):
    u = ClientUpdate(1, {**as_model_fields(STATE), "model.w": value}, {"num_examples": 3.0}, 0)
    kept, (r,) = screen(1, [0], [(0, u)], SPECS["fedavg"])
    assert not kept and (r.client, r.field) == (0, "model.w") and rule in r.rule


def test_a_client_id_that_is_not_a_number_is_rejected():
    u = ClientUpdate(1, as_model_fields(STATE), {"num_examples": 3.0}, torch.tensor([0, 0]))
    kept, (r,) = screen(1, [0], [(0, u)], SPECS["fedavg"])
    assert not kept and (r.client, r.field) == (0, "client_id") and "whole number" in r.rule


def test_a_rule_that_raises_drops_the_message_not_the_run():
    """A message-wide rule that fails on a value no one foresaw is a broken rule."""

    def boom(update):
        raise ZeroDivisionError("a rule's own bug")

    from fedlightning.server.validation import Rule

    spec = MessageSpec(SPECS["fedavg"].fields, rules=(Rule(boom),))
    u = ClientUpdate(1, as_model_fields(STATE), {"num_examples": 3.0}, 0)
    kept, (r,) = screen(1, [0], [(0, u)], spec)
    assert not kept and "could not be checked (ZeroDivisionError)" in r.rule
