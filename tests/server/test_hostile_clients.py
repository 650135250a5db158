"""Hostile and broken clients through the real round (``federated_round``): the server checks
every message against the method's declaration before aggregation (docs/security.md).

Five clients; client 2 misbehaves. Each case asserts that the global state stays finite,
that the hostile client had no influence (the aggregate equals FedAvg of the four honest
clients, computed by hand) or a bounded one, and that the rejection is recorded with the
client, the field and the rule. A few cases run under two Gloo ranks (``runner=distributed``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fedlightning.errors import ConfigError, TooFewClients
from fedlightning.federation.ledger import UP, CommLedger
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.runners import SequentialRunner
from fedlightning.federation.task_loop import TaskBatches
from fedlightning.messages import ClientUpdate
from fedlightning.methods.fedavg.fedavg import FedAvg
from fedlightning.methods.fedogl.fedogl import FedOGL
from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.server import Server
from fedlightning.server.aggregate import as_model_fields
from fedlightning.server.reliability import FedTIPServer, label_coverage

REPO = Path(__file__).resolve().parents[2]
K, BAD = 5, 2
STATE = {
    "w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
    "b": torch.tensor([0.5, -0.5]),
    "steps": torch.tensor(3),
}


class Client:
    def __init__(self, client_id: int) -> None:
        self.client_id, self.state = client_id, {}


def honest(k: int, round: int) -> ClientUpdate:
    """Client ``k``'s model: the global one plus ``0.01 (k + 1)`` everywhere; ``10 (k+1)``
    training nodes."""
    model = {n: v + 0.01 * (k + 1) if v.is_floating_point() else v + 1 for n, v in STATE.items()}
    return ClientUpdate(round, as_model_fields(model), {"num_examples": 10.0 * (k + 1)}, k)


def by_hand(ids: list[int]) -> dict[str, torch.Tensor]:
    """FedAvg of the honest clients ``ids``, by hand: the global state plus the weighted
    mean of their shifts ``0.01 (k + 1)``, weights ``10 (k + 1)``."""
    n = [10.0 * (k + 1) for k in ids]
    shift = sum(w * 0.01 * (k + 1) for w, k in zip(n, ids, strict=True)) / sum(n)
    return {"w": STATE["w"] + shift, "b": STATE["b"] + shift, "steps": STATE["steps"] + 1}


def run_round(bad, algorithm=None, runner=None, min_clients=1, clients=None, server=None, round=1):
    """One real round of 5 clients where client 2's fit is ``bad(update)``; the server, the
    ledger and the updates kept."""
    algorithm = algorithm or FedAvg()
    runner = runner or SequentialRunner(None, progress=False)
    server = server or algorithm.server(STATE)
    clients = clients or [Client(k) for k in range(K)]
    ledger = CommLedger()

    def work(broadcast):
        def fit(client):
            u = honest(client.client_id, broadcast.round)
            return bad(u) if client.client_id == BAD and bad is not None else u

        return ClientWork(one=fit, uplink=algorithm.uplink(broadcast))

    kept = federated_round(round, server, runner, clients, work, ledger, min_clients=min_clients)
    return server, ledger, kept


def finite(state) -> bool:
    return all(bool(torch.isfinite(v.double()).all()) for v in state.values())


def set_tensor(name, value):
    def bad(u):
        u.tensors[name] = value
        return u

    return bad


def set_scalar(name, value):
    def bad(u):
        u.scalars[name] = value
        return u

    return bad


def drop(name):
    def bad(u):
        u.tensors.pop(name, None)
        u.scalars.pop(name, None)
        return u

    return bad


def attr(name, value):
    def bad(u):
        setattr(u, name, value)
        return u

    return bad


def poisoned(name, where, value):
    def bad(u):
        t = u.tensors[name].clone()
        t.view(-1)[where] = value
        u.tensors[name] = t
        return u

    return bad


def raises(u):
    raise RuntimeError("CUDA error: device-side assert triggered")


NAN = float("nan")
INF = float("inf")
# case: (client 2's behaviour, the field named, a piece of the rule)
CASES = {
    "nan_weights": (poisoned("model.w", 0, NAN), "model.w", "non-finite"),
    "inf_weights": (poisoned("model.b", 1, INF), "model.b", "non-finite"),
    "minus_inf_weights": (poisoned("model.w", 3, -INF), "model.w", "non-finite"),
    "num_examples_nan": (set_scalar("num_examples", NAN), "num_examples", "non-finite"),
    "num_examples_inf": (set_scalar("num_examples", INF), "num_examples", "non-finite"),
    "num_examples_negative": (set_scalar("num_examples", -5.0), "num_examples", "outside"),
    "num_examples_fraction": (set_scalar("num_examples", 2.5), "num_examples", "whole number"),
    "num_examples_bool": (set_scalar("num_examples", True), "num_examples", "a number"),
    "num_examples_text": (set_scalar("num_examples", "30"), "num_examples", "a number"),
    "stale_round": (attr("round", 0), "round", "current round is 1"),
    "future_round": (attr("round", 7), "round", "current round is 1"),
    "round_as_text": (attr("round", "1"), "round", "current round is 1"),
    "secret_tensor": (set_tensor("secret", torch.randn(1000)), "secret", "undeclared tensor"),
    "secret_scalar": (set_scalar("secret", 42.0), "secret", "undeclared scalar"),
    "train_loss_not_asked": (set_scalar("train_loss", 0.3), "train_loss", "undeclared"),
    "missing_num_examples": (drop("num_examples"), "num_examples", "missing"),
    "partial_model": (drop("model.b"), "model.b", "missing"),
    "wrong_shape": (set_tensor("model.w", torch.zeros(3, 2)), "model.w", "shape [3, 2]"),
    "huge_tensor": (set_tensor("model.b", torch.zeros(10**6)), "model.b", "shape [1000000]"),
    "wrong_dtype": (
        set_tensor("model.w", torch.ones(2, 2, dtype=torch.float64)),
        "model.w",
        "dtype torch.float64",
    ),
    "float_counter": (set_tensor("model.steps", torch.tensor(4.0)), "model.steps", "dtype"),
    "extra_model_field": (set_tensor("model.extra", torch.ones(2)), "model.extra", "no field"),
    "tensor_as_list": (set_tensor("model.b", [0.5, -0.5]), "model.b", "must be a tensor"),
    "scalar_as_tensor": (set_tensor("num_examples", torch.tensor(30.0)), "num_examples", ""),
    "impersonates_client_0": (attr("client_id", 0), "client_id", "names client 0"),
    "not_a_message": (lambda u: {"model.w": u.tensors["model.w"]}, "", "not a ClientUpdate"),
    "fit_raises": (raises, "", "fit failed: RuntimeError: CUDA error"),
    "vanishes": (lambda u: None, "", "sent no message"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_client_is_dropped_and_recorded(case, caplog):
    bad, field, rule = CASES[case]
    with caplog.at_level("WARNING", logger="fedlightning"):
        server, ledger, kept = run_round(bad)
    state = server.global_state
    assert finite(state)
    for k, v in by_hand([0, 1, 3, 4]).items():  # client 2 had no influence
        assert torch.allclose(state[k], v, rtol=0, atol=1e-6), k
    assert [u.client_id for u in kept] == [0, 1, 3, 4]
    ((r, c, f, why, _, _),) = ledger.rejections
    assert (r, c, f) == (1, BAD, field) and rule in why
    assert ledger.rejected_summary()["per_client"] == {"2": 1}
    assert ledger.total(UP, client=BAD) == 0  # a dropped message is not counted as sent
    (line,) = [m for m in caplog.messages if "rejected" in m]
    assert line.startswith("round 1: client 2") and rule in line


def test_a_fit_past_the_time_limit_is_dropped():
    runner = SequentialRunner(None, progress=False, client_timeout_s=0.3)
    t0 = time.perf_counter()
    server, ledger, _ = run_round(lambda u: time.sleep(30) or u, runner=runner)
    assert time.perf_counter() - t0 < 20  # hang guard: the fit was stopped
    assert finite(server.global_state)
    assert torch.allclose(server.global_state["w"], by_hand([0, 1, 3, 4])["w"], atol=1e-6)
    ((_, c, _, why, _, _),) = ledger.rejections
    assert c == BAD and "FitTimeout" in why and "runner.client_timeout_s=0.3" in why


def test_a_second_client_with_the_same_id_is_refused():
    """Two connections claim client 1 (a Sybil): the first message is kept."""
    clients = [Client(0), Client(1), Client(1), Client(3), Client(4)]
    server, ledger, kept = run_round(None, clients=clients)
    assert [u.client_id for u in kept] == [0, 1, 3, 4]
    ((_, c, f, why, _, _),) = ledger.rejections
    assert (c, f) == (1, "client_id") and "a second message from client 1" in why
    assert torch.allclose(server.global_state["w"], by_hand([0, 1, 3, 4])["w"], atol=1e-6)


def test_a_declared_train_loss_must_be_finite():
    algorithm = FedAvg()
    algorithm.report_train_loss = True
    runner = SequentialRunner(None, progress=False)
    runner_round = runner.run_round

    def with_losses(round, clients, fit, desc=""):  # every client sends its loss
        updates = runner_round(round, clients, fit, desc)
        for u in updates:
            u.scalars["train_loss"] = NAN if u.client_id == BAD else 0.25
        return updates

    runner.run_round = with_losses
    server, ledger, kept = run_round(None, algorithm=algorithm, runner=runner)
    assert len(kept) == K - 1
    ((_, c, f, why, _, _),) = ledger.rejections
    assert (c, f) == (BAD, "train_loss") and "non-finite" in why
    assert finite(server.global_state)


def test_a_1000x_update_moves_the_aggregate_by_at_most_the_bound():
    """``max_update_norm=C``: client 2's update is clipped to norm C around the broadcast
    model, so it moves the aggregate by at most ``w_2 (C + ||honest delta||)`` from the
    clean aggregate; here exactly (hand-computed) the clean FedAvg with client 2's shift
    replaced by its clipped one."""
    C = 0.05

    def scaled(u):
        for n in ("model.w", "model.b"):
            u.tensors[n] = STATE[n[6:]] + 1000 * (u.tensors[n] - STATE[n[6:]])
        return u

    clean, _, _ = run_round(None, algorithm=FedAvg(max_update_norm=C))
    server, ledger, _ = run_round(scaled, algorithm=FedAvg(max_update_norm=C))
    assert not ledger.rejections  # well-formed: bounded, not rejected
    # client 2's delta: 1000 * 0.03 on 6 floats -> norm 30 sqrt(6), clipped to C:
    # each entry C / sqrt(6); honest clients' norms 0.01 (k+1) sqrt(6) <= C for k <= 1 only
    honest_shift = {k: min(0.01 * (k + 1), C / math.sqrt(6)) for k in range(K)}
    honest_shift[BAD] = C / math.sqrt(6)
    n = [10.0 * (k + 1) for k in range(K)]
    shift = sum(n[k] * honest_shift[k] for k in range(K)) / sum(n)
    assert torch.allclose(server.global_state["w"], STATE["w"] + shift, atol=1e-6)
    moved = torch.cat([(server.global_state[k] - clean.global_state[k]).view(-1) for k in "wb"])
    w2 = n[BAD] / sum(n)
    assert float(moved.norm()) <= w2 * (C + 0.03 * math.sqrt(6)) + 1e-6
    assert float(moved.norm()) == pytest.approx(
        w2 * (C - min(0.03, C / math.sqrt(6)) * math.sqrt(6)), abs=1e-6
    )


def test_a_client_claiming_a_billion_examples_is_capped():
    capped = FedAvg(max_client_weight=50.0)
    server, ledger, _ = run_round(set_scalar("num_examples", 1e9), algorithm=capped)
    assert not ledger.rejections
    n = [10.0, 20.0, 50.0, 40.0, 50.0]  # client 2's 1e9 capped at 50
    shift = sum(w * 0.01 * (k + 1) for k, w in enumerate(n)) / sum(n)
    assert torch.allclose(server.global_state["w"], STATE["w"] + shift, atol=1e-6)
    # without the cap it would have taken the aggregate to client 2's model
    free, _, _ = run_round(set_scalar("num_examples", 1e9))
    assert torch.allclose(free.global_state["w"], STATE["w"] + 0.03, atol=1e-6)


def test_bounds_are_checked_settings():
    with pytest.raises(ConfigError, match="algorithm.max_update_norm"):
        FedAvg(max_update_norm=0)
    with pytest.raises(ConfigError, match="algorithm.max_client_weight"):
        FedAvg(max_client_weight=-1)
    assert FedAvg().bounds() == {"max_update_norm": None, "max_client_weight": None}


def test_too_few_clients_left_stops_before_aggregation():
    clients = [Client(k) for k in range(K)]
    runner = SequentialRunner(None, progress=False)
    server = FedAvg().server(STATE)
    ledger = CommLedger()

    def work(broadcast):
        def fit(client):
            if client.client_id in (1, 2, 3):
                raise ValueError("out of memory")
            return honest(client.client_id, broadcast.round)

        return ClientWork(one=fit, uplink=FedAvg().uplink(broadcast))

    with pytest.raises(TooFewClients, match=r"round 1: 2 of 5 clients' messages kept, fewer "
                       r"than federation.min_clients=3"):  # fmt: skip
        federated_round(1, server, runner, clients, work, ledger, min_clients=3)
    assert torch.equal(server.global_state["w"], STATE["w"])  # the last good state stands
    assert [c for _, c, *_ in ledger.rejections] == [1, 2, 3]


def test_every_client_hostile_is_an_error_even_with_min_clients_1():
    with pytest.raises(TooFewClients, match="0 of 1"):
        run_round(poisoned("model.w", 0, NAN), clients=[Client(BAD)])


# ------------------------------------------------------------------ FedOGL's prototypes
def fedogl():
    alg = FedOGL()
    alg.stream = SimpleNamespace(known=lambda t: [0, 1, 2])
    alg.rounds_per_stage = 1
    return alg


OGL_STATE = {**STATE, "head.weight": torch.ones(3, 2), "head.bias": torch.zeros(3)}


def with_protos(**extra):
    def bad(u):
        u.tensors.update({"model.head.weight": torch.ones(3, 2), "model.head.bias": torch.zeros(3)})
        u.tensors["proto.0.0"], u.scalars["proto_count.0.0"] = torch.ones(2), 5.0
        for name, value in extra.items():
            name = name.replace("__", ".")
            if value is None:
                u.tensors.pop(name, None)
                u.scalars.pop(name, None)
            elif isinstance(value, torch.Tensor):
                u.tensors[name] = value
            else:
                u.scalars[name] = value
        return u

    return bad


OGL_CASES = {
    "unknown_class": (
        with_protos(proto__7__0=torch.ones(2), proto_count__7__0=3.0),
        "proto.7.0",
        "class 7",
    ),
    "proto_without_count": (with_protos(proto_count__0__0=None), "proto.0.0", "together"),
    "counts_beyond_examples": (with_protos(proto_count__0__0=1e6), "proto_count.*", "sum"),
    "proto_wrong_width": (with_protos(proto__0__0=torch.ones(5)), "proto.0.0", "shape"),
    "zero_count": (with_protos(proto_count__0__0=0.0), "proto_count.0.0", "outside"),
    "nan_proto": (with_protos(proto__0__0=torch.tensor([NAN, 1.0])), "proto.0.0", "non-finite"),
    "unknown_mode": (
        with_protos(proto__0__3=torch.ones(2), proto_count__0__3=1.0),
        "proto.0.3",
        "undeclared",
    ),
}


@pytest.mark.parametrize("case", sorted(OGL_CASES))
def test_fedogl_prototype_lies_are_refused(case):
    bad, field, rule = OGL_CASES[case]
    alg = fedogl()
    good = with_protos()

    def fit_all(u):
        return bad(u) if u.client_id == BAD else good(u)

    server = Server(OGL_STATE)
    clients = [Client(k) for k in range(K)]
    ledger = CommLedger()

    def work(broadcast):
        return ClientWork(
            one=lambda c: fit_all(honest(c.client_id, broadcast.round)),
            uplink=alg.uplink(broadcast),
        )

    kept = federated_round(1, server, SequentialRunner(None, progress=False), clients, work, ledger)
    assert [u.client_id for u in kept] == [0, 1, 3, 4]
    ((_, c, f, why, _, _),) = ledger.rejections
    assert (c, f) == (BAD, field) and rule in why
    assert finite(server.global_state)


# ------------------------------------------------------------------ FedTIP (Eqs. 27-30)
P, D_H, SUPPORT = 6, 3, 10


def tip_update(k: int, round: int, scale: float = 1.0, counts=None) -> ClientUpdate:
    """Client ``k``'s honest message of Eq. (2): a delta, counts (3 + k % 2, 4) of 10
    support events (or ``counts``), prototypes, and the coverage and norm it computes."""
    g = torch.Generator().manual_seed(k)
    delta = scale * 0.01 * torch.randn(P, generator=g)
    counts = counts or {0: 3 + k % 2, 1: 4}
    return ClientUpdate(
        round,
        {"delta": delta, **{f"proto.{c}": torch.ones(D_H) / (c + 1) for c in counts}},
        {
            **{f"count.{c}": float(n) for c, n in counts.items()},
            "coverage": label_coverage(counts, [0, 1]),
            "norm": float(delta.norm()),
        },
        k,
    )


def tip_round(bad, scale: float = 1.0, counts=None):
    """One real FedTIP round of ``K`` clients, ``BAD``'s message passed through ``bad``;
    ``counts(k)``: client ``k``'s class counts (default: :func:`tip_update`'s)."""
    alg = FedTIP()
    server = FedTIPServer({"a": torch.zeros(P)}, anchors=True, proto_norm_ratio=alg.prototype_bound)
    task = TaskBatches(0, {k: {"h_u": torch.zeros(SUPPORT, 1)} for k in range(K)})
    ledger = CommLedger()

    def work(broadcast):
        def fit(c):
            k = c.client_id
            u = tip_update(
                k, broadcast.round, scale if k == BAD else 1.0, counts(k) if counts else None
            )
            return bad(u) if c.client_id == BAD and bad is not None else u

        return ClientWork(one=fit, uplink=alg.task_uplink(task, "nc", broadcast, D_H))

    clients = [Client(k) for k in range(K)]
    kept = federated_round(1, server, SequentialRunner(None, progress=False), clients, work, ledger)
    return server, ledger, kept


def tip_by_hand(ids, scale_bad: float = 1.0):
    r"""Eqs. (27)-(31) by hand over clients ``ids``: coverage from counts, norms from deltas,
    :math:`\gamma` their median, :math:`r_k = b_k \min(1, \gamma / \|\Delta_k\|)`,
    :math:`\Omega' = \sum n_k r_k \Delta_k / \sum n_k r_k`."""
    ms = [tip_update(k, 1, scale_bad if k == BAD else 1.0) for k in ids]
    norms = [float(m.tensors["delta"].double().norm()) for m in ms]
    gamma = float(torch.tensor(norms, dtype=torch.float64).quantile(0.5))
    num, den = torch.zeros(P, dtype=torch.float64), 0.0
    for m, norm in zip(ms, norms, strict=True):
        n0, n1 = m.scalars["count.0"], m.scalars["count.1"]
        b = 1 - 0.5 * (abs(n0 / (n0 + n1) - 0.5) + abs(n1 / (n0 + n1) - 0.5))
        r = b * min(1.0, gamma / (norm + 1e-8))
        num += (n0 + n1) * r * m.tensors["delta"].double()
        den += (n0 + n1) * r
    return (num / den).float()


def tip_set(name, value):
    def bad(u):
        (u.tensors if isinstance(value, torch.Tensor) else u.scalars)[name] = value
        return u

    return bad


def tip_pop(name):
    def bad(u):
        u.tensors.pop(name, None)
        u.scalars.pop(name, None)
        return u

    return bad


TIP_CASES = {
    "nan_delta": (tip_set("delta", torch.full((P,), NAN)), "delta", "non-finite"),
    "delta_wrong_shape": (tip_set("delta", torch.zeros(P + 1)), "delta", "shape"),
    "missing_delta": (tip_pop("delta"), "delta", "missing"),
    "tiny_norm_lie": (tip_set("norm", 1e-9), "norm", "the server recomputes"),
    "huge_coverage": (tip_set("coverage", 1e6), "coverage", "outside [0, 1]"),
    "negative_coverage": (tip_set("coverage", -0.5), "coverage", "outside [0, 1]"),
    "coverage_lie": (tip_set("coverage", 1.0), "coverage", "the server recomputes"),
    "unknown_class_count": (tip_set("count.7", 2.0), "count.7", "class 7"),
    "count_beyond_support": (tip_set("count.0", 11.0), "count.0", "outside [1, 10]"),
    "counts_sum_beyond_support": (tip_set("count.1", 9.0), "count.*", "support holds 10"),
    "fractional_count": (tip_set("count.0", 2.5), "count.0", "whole number"),
    "proto_without_count": (tip_pop("count.1"), "proto.1", "together"),
    "nan_proto": (tip_set("proto.0", torch.full((D_H,), NAN)), "proto.0", "non-finite"),
    "missing_norm": (tip_pop("norm"), "norm", "missing"),
}


@pytest.mark.parametrize("case", sorted(TIP_CASES))
def test_fedtip_message_lies_are_refused(case):
    bad, field, rule = TIP_CASES[case]
    server, ledger, kept = tip_round(bad)
    assert [u.client_id for u in kept] == [0, 1, 3, 4]
    ((_, c, f, why, _, _),) = ledger.rejections
    assert (c, f) == (BAD, field) and rule in why
    assert torch.isfinite(server.omega).all()
    assert torch.allclose(server.omega, tip_by_hand([0, 1, 3, 4]), atol=1e-6)


def test_fedtip_1000x_delta_with_an_honest_looking_norm_is_bounded():
    """The server reads the norm off the delta, not the client's scalar: a 1000x delta that
    reports the norm its unscaled delta would have is refused; one that reports its true
    norm is kept and down-weighted by Eq. (29) so that its contribution has norm at most
    :math:`n_k b_k \\gamma / Z`."""
    _, ledger, _ = tip_round(
        lambda u: tip_set("norm", float(u.tensors["delta"].norm()) / 1000)(u), scale=1000
    )
    assert ledger.rejections[0][2] == "norm"

    server, ledger, kept = tip_round(None, scale=1000)
    assert not ledger.rejections and len(kept) == K
    expected = tip_by_hand(list(range(K)), scale_bad=1000)
    assert torch.allclose(server.omega, expected, atol=1e-6)
    honest_only = tip_by_hand([0, 1, 3, 4])
    # the bound: 7 events, coverage 6/7 (counts 3, 4) and gamma: the median honest norm
    norms = sorted(float(tip_update(k, 1).tensors["delta"].norm()) for k in [0, 1, 3, 4])
    assert float(server.omega.norm()) < 10 * max(norms)  # 1000x delta: norm ~1000x
    assert float((server.omega - honest_only).norm()) < 2 * max(norms)


def test_fedtip_a_dropped_sole_holder_of_a_class_leaves_that_class_without_an_anchor():
    """``BAD`` alone observed class 1 and sends a NaN delta: its whole message goes, its
    (finite) class-1 prototype with it, so the task has no class-1 anchor and node
    classification is not scored (docs/security.md); class 0's anchor is the normalised
    count-weighted mean of the kept prototypes (Eqs. 23-24), all ``1`` here."""
    server, ledger, kept = tip_round(
        tip_set("delta", torch.full((P,), NAN)),
        counts=lambda k: {0: 5, 1: 2} if k == BAD else {0: 6},
    )
    assert [u.client_id for u in kept] == [0, 1, 3, 4]
    assert ledger.rejections[0][1:3] == (BAD, "delta")
    assert set(server.class_prototypes()) == {0}
    assert torch.allclose(server.class_prototypes()[0], torch.ones(D_H) / D_H**0.5)
    assert torch.isfinite(server.omega).all()


# ------------------------------------------------------------------ distributed
DIST = """
import json, sys, time, torch
from types import SimpleNamespace
sys.path.insert(0, {tests!r})
import test_hostile_clients as h
from test_hostile_clients import Client, STATE, honest, NAN
from fedlightning.federation.runners import DistributedRunner

runner = DistributedRunner(SimpleNamespace(device=None), backend="gloo", device="cpu",
                           client_timeout_s=2, progress=False)
def fit_round():
    def work(broadcast):
        from fedlightning.federation.round import ClientWork
        def fit(client):
            u = honest(client.client_id, broadcast.round)
            if client.client_id == 1:
                raise RuntimeError("rank 0 client broke")
            if client.client_id == 3:
                u.tensors["model.w"] = torch.full((2, 2), NAN)
            if client.client_id == 4:
                time.sleep(60)
            return u
        return ClientWork(one=fit, uplink=h.FedAvg().uplink(broadcast))
    from fedlightning.federation.ledger import CommLedger
    from fedlightning.federation.round import federated_round
    server, ledger = h.FedAvg().server(STATE), CommLedger()
    clients = [Client(k) for k in range(5)]
    federated_round(1, server, runner, clients, work, ledger)
    return server, ledger
server, ledger = fit_round()
with open(f"result_{{runner.world.rank}}.json", "w") as f:
    json.dump({{"rank": runner.world.rank, "w": server.global_state["w"].tolist(),
               "rejections": [list(r[:4]) for r in ledger.rejections]}}, f)
"""


@pytest.mark.slow
def test_hostile_clients_under_two_gloo_ranks(tmp_path):
    """Rank 0 fits clients 0-1 (1 raises), rank 1 clients 2-4 (3 sends NaN, 4 runs past the
    time limit): every rank drops the same three, records them, and aggregates 0 and 2."""
    script = tmp_path / "dist.py"
    script.write_text(DIST.format(tests=str(Path(__file__).parent)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = subprocess.run(
        [*cmd, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # one file per rank, not stdout: two ranks share torchrun's pipe
    files = sorted(tmp_path.glob("result_*.json"))
    assert [f.name for f in files] == ["result_0.json", "result_1.json"], (
        f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    )
    results = [json.loads(f.read_text()) for f in files]
    assert [x["rank"] for x in results] == [0, 1]
    assert (
        results[0]["w"] == results[1]["w"] and results[0]["rejections"] == results[1]["rejections"]
    )
    assert torch.allclose(torch.tensor(results[0]["w"]), by_hand([0, 2])["w"], atol=1e-6)
    rejected = results[0]["rejections"]
    assert [x[1] for x in rejected] == [1, 3, 4]
    assert "RuntimeError: rank 0 client broke" in rejected[0][3]
    assert rejected[1][2] == "model.w" and "non-finite" in rejected[1][3]
    assert "FitTimeout" in rejected[2][3]


def test_fedtip_a_class_sent_under_two_names_is_refused():
    """``count.00``/``proto.00`` beside ``count.0``/``proto.0`` (counts split so the sum
    fits) was accepted and the last one won: class ids must be written canonically."""

    def two_names(u):
        u.scalars["count.0"], u.scalars["count.00"] = 2.0, 1.0
        u.tensors["proto.00"] = -100 * u.tensors["proto.0"]
        return u

    server, ledger, kept = tip_round(two_names)
    ((_, c, field, why, _, _),) = ledger.rejections
    assert (c, field) == (BAD, "proto.00") and "not canonical" in why and "`0`" in why
    assert torch.allclose(server.omega, tip_by_hand([0, 1, 3, 4]), atol=1e-6)


def test_fedtip_a_poisoned_prototype_moves_the_anchor_by_at_most_its_bound():
    """A prototype sent as -100 times the honest one (counts honest) is set aside against
    the class's reference (the median of three or more uploads, or the anchor), and one
    scaled 100x in the honest direction is clipped to 3x the class's median norm: the
    anchor ends where the honest clients' alone put it, or within the stated bound."""
    from fedlightning.server.reliability import bound_prototypes, read_update

    def flipped(u):
        for k in [k for k in u.tensors if k.startswith("proto.")]:
            u.tensors[k] = -100 * u.tensors[k]
        return u

    server, ledger, _ = tip_round(flipped)
    assert not ledger.rejections and {c for c, _ in server.flagged} == {BAD}
    honest_server, _, _ = tip_round(lambda u: tip_pop("proto.0")(tip_pop("proto.1")(u)))
    for c in (0, 1):
        assert torch.allclose(server.anchors[c], honest_server.anchors[c], atol=1e-6)
    # same direction, 100x: clipped to 3x the class's median norm (all honest norms equal)
    msgs = [read_update(tip_update(k, 1)) for k in range(K)]
    msgs[BAD].prototypes[0] = 100 * msgs[BAD].prototypes[0]
    out, bounded = bound_prototypes(msgs, 3.0)
    assert [(i, c) for i, c, _ in bounded] == [(BAD, 0)]
    honest_norm = float(torch.ones(D_H).norm())  # proto.0 = ones(D_H) / 1
    assert float(out[BAD].prototypes[0].norm()) == pytest.approx(3 * honest_norm)
