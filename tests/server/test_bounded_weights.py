"""Bounded client weights by default, and the same cap under secure sums (docs/security.md,
"Bounded influence").

The server knows each client's node count (it made the partition): a message claiming more
examples is refused with one line, a weight is never above its bound, the weight sum is
always finite, and ``algorithm.max_client_weight`` gives the same aggregate with and without
``federation.secure_sum=true``. Expected values are FedAvg computed by hand.
"""

from __future__ import annotations

import pytest
import torch

from fedlightning.federation.ledger import CommLedger
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.runners import SequentialRunner
from fedlightning.messages import ClientUpdate
from fedlightning.methods.fedavg.fedavg import FedAvg
from fedlightning.server.aggregate import as_model_fields, normalized_weights, weighted_average
from fedlightning.server.secure_sum import graph_secure_sum

K, BAD = 5, 2
STATE = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([0.5, -0.5])}
NODES = {k: 10.0 * (k + 1) + 5 for k in range(K)}  # each client's subgraph: 15, 25, ... nodes


class Client:
    def __init__(self, client_id: int) -> None:
        self.client_id, self.state = client_id, {}


def update(k: int, round: int, n: float | None = None, sign: float = 1.0) -> ClientUpdate:
    """Client ``k``'s model: the global one plus ``sign * 0.01 (k + 1)``; ``10 (k + 1)``
    training nodes unless it claims ``n``."""
    model = {name: v + sign * 0.01 * (k + 1) for name, v in STATE.items()}
    n = 10.0 * (k + 1) if n is None else n
    return ClientUpdate(round, as_model_fields(model), {"num_examples": n}, k)


def by_hand(weights: dict[int, float], signs: dict[int, float] | None = None) -> torch.Tensor:
    """``w`` after FedAvg of clients ``weights`` (id -> weight), by hand."""
    signs = signs or {}
    total = sum(weights.values())
    shift = sum(w * signs.get(k, 1.0) * 0.01 * (k + 1) for k, w in weights.items()) / total
    return STATE["w"] + shift


def round_of(bad_n=None, algorithm=None, bounds=NODES, secure=False, sign=1.0):
    """One real round; client ``BAD`` claims ``bad_n`` examples (and its shift times
    ``sign``). Returns the server and the ledger."""
    algorithm = algorithm or FedAvg()
    server = algorithm.server(STATE)
    server.weight_bounds = dict(bounds or {})
    if secure:
        server.secure = graph_secure_sum(server, 0, None, algorithm.max_client_weight)
    ledger = CommLedger()

    def work(broadcast):
        def fit(c):
            k = c.client_id
            return update(k, broadcast.round, bad_n if k == BAD else None, sign if k == BAD else 1)

        return ClientWork(one=fit, uplink=algorithm.uplink(broadcast))

    clients = [Client(k) for k in range(K)]
    federated_round(1, server, SequentialRunner(None, progress=False), clients, work, ledger)
    return server, ledger


@pytest.mark.parametrize("claim", [1e12, 1.7e308, 10**400], ids=["1e12", "1.7e308", "10**400"])
def test_a_client_claiming_more_than_its_subgraph_is_rejected(claim):
    server, ledger = round_of(claim, sign=-1.0)
    ((_, c, field, rule, _, _),) = ledger.rejections
    assert (c, field) == (BAD, "num_examples") and ("outside [0, 35]" in rule or "float" in rule)
    honest = {k: 10.0 * (k + 1) for k in range(K) if k != BAD}
    assert torch.allclose(server.global_state["w"], by_hand(honest), atol=1e-6)


def test_a_client_at_its_bound_keeps_the_bounded_weight():
    server, ledger = round_of(NODES[BAD], sign=-1.0)
    assert not ledger.rejections
    weights = {k: 10.0 * (k + 1) for k in range(K)} | {BAD: NODES[BAD]}
    assert torch.allclose(server.global_state["w"], by_hand(weights, {BAD: -1}), atol=1e-6)


def test_the_server_caps_a_weight_the_screen_did_not_see():
    """A custom schedule with no declaration: the server still caps at the node count."""
    server = FedAvg().server(STATE)
    server.weight_bounds = NODES
    ups = [update(k, 1, 1e12 if k == BAD else None) for k in range(K)]
    server.aggregate(1, ups)
    weights = {k: 10.0 * (k + 1) for k in range(K)} | {BAD: NODES[BAD]}
    assert torch.allclose(server.global_state["w"], by_hand(weights), atol=1e-6)


def test_two_weights_near_the_float_limit_have_a_finite_sum():
    """Unbounded (no partition known, no cap): two clients at 1.7e308 overflowed the weight
    sum to inf and zeroed the model; normalised by the largest weight first, the mean is
    theirs, finite."""
    assert torch.allclose(
        normalized_weights([0, 1, 2], [1.7e308, 1.7e308, 1.0], "state").sum().double(),
        torch.tensor(1.0, dtype=torch.float64),
    )
    states = [{"w": torch.full((2,), float(k))} for k in range(3)]
    avg = weighted_average(states, [1.7e308, 1.7e308, 1.0])
    assert torch.allclose(avg["w"], torch.full((2,), 0.5))
    with pytest.raises(ValueError, match="finite"):
        normalized_weights([0, 1], [float("inf"), 1.0], "state")


@pytest.mark.parametrize("claim", [None, 1e6], ids=["honest", "inflated"])
def test_max_client_weight_is_the_same_with_and_without_secure_sums(claim):
    """The cap is applied on the client before masking; the capped plain run and the capped
    secure run agree within the fixed-point tolerance (no partition bound: the cap alone)."""
    capped = FedAvg(max_client_weight=25.0)
    plain, plain_ledger = round_of(claim, algorithm=capped, bounds=None, sign=-1.0)
    secure, secure_ledger = round_of(
        claim, algorithm=FedAvg(max_client_weight=25.0), bounds=None, secure=True, sign=-1.0
    )
    assert not plain_ledger.rejections and not secure_ledger.rejections
    n = {k: min(10.0 * (k + 1), 25.0) for k in range(K)}
    if claim is not None:
        n[BAD] = 25.0
    want = by_hand(n, {BAD: -1})
    for got in (plain.global_state["w"], secure.global_state["w"]):
        assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(plain.global_state["w"], secure.global_state["w"], atol=1e-6, rtol=0)


def test_under_secure_sums_a_clear_count_above_the_cap_is_refused():
    """The server checks the cap from the clear counts: a share whose clear weight is over
    it (a client that skipped the cap) is refused and its masks recovered."""
    alg = FedAvg(max_client_weight=25.0)
    server = alg.server(STATE)
    server.secure = graph_secure_sum(server, 0, None, 25.0)
    spec = server.secure.share_spec(alg.uplink(server.broadcast(1)))
    from fedlightning.server.validation import screen

    share = server.secure.mask(update(BAD, 1), server.broadcast(1), list(range(K)))
    assert share.scalars["num_examples"] == 25.0  # the client capped its 30
    share.scalars["num_examples"] = 30.0
    kept, (r,) = screen(1, [BAD], [(0, share)], spec)
    assert not kept and r.field == "num_examples" and "outside [0, 25]" in r.rule
