"""Pairwise-masked secure sums (fedlightning/server/secure_sum.py) against hand computations,
and through the real round (federated_round) with the server's aggregate input instrumented."""

import math

import pytest
import torch

from fedlightning.federation.ledger import CommLedger
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.runners import SequentialRunner
from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.server import Server
from fedlightning.server.aggregate import fedavg
from fedlightning.server.reliability import FedTIPServer
from fedlightning.server.secure_sum import (
    PROTO_SUM,
    SCALE,
    SecureSum,
    ShareSpec,
    client_mask,
    decode,
    encode,
    graph_secure_sum,
)

PEERS = [0, 1, 3, 4]  # client ids of a round (2 not sampled)
TOL = 1e-6  # float32 results: the fixed-point error (n 2^-33 / N) is far below float32 ulp


def test_masks_cancel_exactly_in_the_ring():
    total = sum(client_mask(7, 3, k, PEERS, "model.w", (50,)) for k in PEERS)
    assert torch.equal(total, torch.zeros(50, dtype=torch.int64))  # exact, not approximate
    one = client_mask(7, 3, 0, PEERS, "model.w", (50,))
    assert one.abs().float().mean() > 2**60  # uniform on the ring: huge, not small noise
    # each pair's mask depends on the round and the field
    assert not torch.equal(one, client_mask(7, 4, 0, PEERS, "model.w", (50,)))
    assert not torch.equal(one, client_mask(7, 3, 0, PEERS, "model.b", (50,)))


def test_fixed_point_round_trip_and_range():
    x = torch.tensor([0.1, -2.5, 1e3, 0.0], dtype=torch.float64)
    assert torch.allclose(decode(encode(x)), x, atol=0.5 / SCALE, rtol=0)
    assert encode(torch.tensor([0.75])).item() == int(0.75 * 2**32)
    with pytest.raises(ValueError, match="fixed-point range"):
        encode(torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="fixed-point range"):
        encode(torch.tensor([2.0**31]))


def _updates(seed=0, n=(10.0, 30.0, 5.0, 55.0)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, nk in zip(PEERS, n, strict=True):
        tensors = {
            "model.w": torch.randn(6, 3, generator=g),
            "model.b": torch.randn(3, generator=g),
            "model.bn.num_batches_tracked": torch.tensor(4 + k),
        }
        out.append(ClientUpdate(2, tensors, {"num_examples": nk}, client_id=k))
    return out


def _broadcast(like):
    return ServerBroadcast(2, {k: torch.zeros_like(v) for k, v in like.tensors.items()})


def test_a_share_alone_is_uncorrelated_with_the_plain_update():
    ups = _updates()
    secure = SecureSum(11, ShareSpec())
    share = secure.mask(ups[1], _broadcast(ups[0]), PEERS)
    plain = encode(30.0 * ups[1].tensors["model.w"].double())
    assert share.tensors["model.w"].dtype == torch.int64
    assert not torch.equal(share.tensors["model.w"], plain)
    a, b = share.tensors["model.w"].double().flatten(), plain.double().flatten()
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.6  # 18 values: noise
    # over many masks the correlation vanishes
    many = torch.stack(
        [
            SecureSum(s, ShareSpec()).mask(ups[1], _broadcast(ups[0]), PEERS).tensors["model.b"]
            for s in range(300)
        ]
    ).double()
    assert abs(float(torch.corrcoef(torch.stack([many[:, 0], many[:, 1]]))[0, 1])) < 0.2
    assert share.scalars == {"num_examples": 30.0}  # the weight travels in the clear


def test_masked_sum_equals_fedavg_within_tolerance():
    ups = _updates()
    secure = SecureSum(11, ShareSpec())
    b = _broadcast(ups[0])
    shares = [secure.mask(u, b, PEERS) for u in ups]
    total = secure.unmask(shares, b, PEERS)
    plain = fedavg(ups)
    assert total.num_examples == 100.0
    for k, v in plain.items():
        got = total.tensors["model." + k]
        assert got.dtype == v.dtype
        assert torch.allclose(got.double(), v.double(), atol=TOL, rtol=0), k
    # what the server's aggregation makes of the sum alone is plain FedAvg
    again = fedavg([total])
    assert all(torch.allclose(again[k].double(), plain[k].double(), atol=TOL) for k in plain)


def test_a_client_dropping_after_masking_is_recovered_from_the_survivors():
    ups = _updates()
    secure = SecureSum(5, ShareSpec())
    b = _broadcast(ups[0])
    shares = [secure.mask(u, b, PEERS) for u in ups]
    survivors = shares[:2] + shares[3:]  # client 3's share is lost after masking
    total = secure.unmask(survivors, b, PEERS)
    expected = fedavg(ups[:2] + ups[3:])
    for k, v in expected.items():
        assert torch.allclose(total.tensors["model." + k].double(), v.double(), atol=TOL), k
    # without the recovery the masks would not cancel: summing as if 3 were not a peer fails
    wrong = secure.unmask(survivors, b, [0, 1, 4])
    assert not torch.allclose(wrong.tensors["model.w"], expected["w"], atol=1.0)


def test_each_client_clips_its_update_before_masking():
    ups = _updates(n=(10.0, 10.0, 10.0, 10.0))
    b = _broadcast(ups[0])
    bound = 0.5
    ups[2].tensors["model.w"] = ups[2].tensors["model.w"] * 1000  # a 1000x client
    secure = SecureSum(3, ShareSpec(max_update_norm=bound))
    total = secure.unmask([secure.mask(u, b, PEERS) for u in ups], b, PEERS)
    # the aggregate is the mean of clipped updates: it moves by at most the bound
    change = torch.cat([total.tensors[k].flatten() for k in ("model.w", "model.b")])
    assert float(change.norm()) <= bound + TOL
    one = ups[0].tensors
    norm0 = math.sqrt(float(one["model.w"].pow(2).sum() + one["model.b"].pow(2).sum()))
    clipped0 = SecureSum(3, ShareSpec(max_update_norm=bound)).spec.plain(ups[0], b)
    assert float(clipped0["model.w"].norm()) == pytest.approx(
        10 * float(one["model.w"].norm()) * min(1, bound / norm0), rel=1e-6
    )


def test_prototype_sums_per_class():
    spec = ShareSpec("fedavg", classes=3, dim=2)
    u0 = ClientUpdate(
        1,
        {"proto.0.0": torch.tensor([1.0, 0.0]), "proto.2.0": torch.ones(2)},
        {"num_examples": 1.0, "proto_count.0.0": 2.0, "proto_count.2.0": 1.0},
        0,
    )
    u1 = ClientUpdate(
        1, {"proto.0.0": torch.tensor([0.0, 1.0])}, {"num_examples": 1.0, "proto_count.0.0": 6.0}, 1
    )
    rows = spec.plain(u0, ServerBroadcast(1))[PROTO_SUM]
    assert rows.tolist() == [[2.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    secure = SecureSum(1, spec)
    total = secure.unmask(
        [secure.mask(u, ServerBroadcast(1), [0, 1]) for u in (u0, u1)], ServerBroadcast(1), [0, 1]
    )
    # class 0: (2 [1, 0] + 6 [0, 1]) / 8; class 2 from client 0 alone; class 1 absent
    assert torch.allclose(total.tensors["proto.0.0"], torch.tensor([0.25, 0.75]), atol=TOL)
    assert total.scalars["proto_count.0.0"] == 8.0 and "proto.1.0" not in total.tensors
    assert torch.allclose(total.tensors["proto.2.0"], torch.ones(2), atol=TOL)


def test_fedtip_eq6_by_secure_sum_equals_the_plain_server():
    g = torch.Generator().manual_seed(3)
    omega = {"w": torch.zeros(2, 3)}
    ups = []
    for k in PEERS:
        counts = {0: float(k + 1), 1: float(2 * k + 1)}
        tensors = {"delta": torch.randn(6, generator=g)}
        tensors.update({f"proto.{c}": torch.randn(4, generator=g) for c in counts})
        ups.append(ClientUpdate(1, tensors, {f"count.{c}": n for c, n in counts.items()}, k))
    # random prototypes point every way: the plain server's prototype screen, which a secure
    # sum cannot run (docs/security.md), is off in the reference
    plain = FedTIPServer(omega, reliability_weights=False, proto_norm_ratio=None)
    plain.aggregate(1, ups)
    secure = SecureSum(9, ShareSpec("fedtip", classes=2, dim=4))
    b = ServerBroadcast(1, {"adapter": torch.zeros(6)})
    masked = FedTIPServer(omega, reliability_weights=False)
    masked.aggregate(1, [secure.unmask([secure.mask(u, b, PEERS) for u in ups], b, PEERS)])
    assert torch.allclose(masked.omega, plain.omega, atol=TOL)
    for c in (0, 1):
        assert torch.allclose(masked.anchors[c], plain.anchors[c], atol=TOL)


class Client:
    def __init__(self, k):
        self.client_id, self.state = k, {}


def test_the_round_aggregates_only_the_sum_of_masked_shares(monkeypatch):
    """federated_round under secure sums: what crosses is masked (int64 ring elements, not
    the plain update), the server's aggregation is called once with the sum, and the global
    model equals plain FedAvg within the tolerance."""
    ups = {u.client_id: u for u in _updates()}
    like = {k[len("model.") :]: torch.zeros_like(v) for k, v in ups[0].tensors.items()}
    plain_server, server = Server(like), Server(like)
    server.secure = graph_secure_sum(server, seed=0)
    seen = []
    inner = server.aggregate
    monkeypatch.setattr(server, "aggregate", lambda r, us: (seen.append(list(us)), inner(r, us)))

    def work(broadcast):
        return ClientWork(one=lambda c: ups[c.client_id])

    runner = SequentialRunner(executor=None, progress=False)
    clients = [Client(k) for k in PEERS]
    sent = federated_round(2, server, runner, clients, work, CommLedger())
    federated_round(2, plain_server, runner, clients, work, CommLedger())
    for share in sent:
        plain = ups[share.client_id].tensors["model.w"]
        assert share.tensors["model.w"].dtype == torch.int64
        assert not torch.allclose(decode(share.tensors["model.w"]).float(), plain, atol=1.0)
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].client_id == -1
    for k, v in plain_server.global_state.items():
        assert torch.allclose(server.global_state[k].double(), v.double(), atol=TOL), k


def test_only_weighted_sums_are_summed_securely():
    server = Server({"w": torch.zeros(2)}, aggregator=lambda us: {})
    with pytest.raises(ValueError, match="FedAvg aggregation"):
        graph_secure_sum(server, 0)


def test_the_setting_is_a_boolean():
    from fedlightning.errors import ConfigError
    from fedlightning.server.secure_sum import enabled

    assert enabled(True) and not enabled(False)
    with pytest.raises(ConfigError, match="federation.secure_sum"):
        enabled("yes")


@pytest.mark.parametrize("hostile", ["nan", "float_share", "undeclared"])
def test_a_hostile_client_under_secure_sums_is_dropped_and_its_masks_recovered(hostile):
    """Under secure sums the server checks what it still can (docs/security.md): a client
    whose update is not finite cannot encode it (its fit fails), a share that is not ring
    elements or carries an undeclared field breaks the share's declaration; each is dropped
    and recorded, the survivors' masks with it are recovered, and the global model equals
    plain FedAvg over the honest clients."""
    from fedlightning.methods.fedavg.fedavg import FedAvg

    ups = {u.client_id: u for u in _updates()}
    bad = PEERS[1]
    like = {k[len("model.") :]: torch.zeros_like(v) for k, v in ups[0].tensors.items()}
    server, honest = Server(like), Server(like)
    server.secure = graph_secure_sum(server, seed=0)
    spoiled = ups[bad].tensors["model.w"].clone()
    if hostile == "nan":
        spoiled[0, 0] = float("nan")
    plain_bad = ClientUpdate(
        2, {**ups[bad].tensors, "model.w": spoiled}, {"num_examples": 30.0}, client_id=bad
    )

    def work(broadcast):
        def one(c):
            return plain_bad if c.client_id == bad else ups[c.client_id]

        return ClientWork(one=one, uplink=FedAvg().uplink(broadcast))

    runner = SequentialRunner(executor=None, progress=False)
    clients = [Client(k) for k in PEERS]
    if hostile != "nan":  # spoil the share itself, after masking (the client's process)
        inner = server.secure.client_side

        def client_side(fit, peers, weights=None):
            masked = inner(fit, peers, weights)
            one = masked.one

            def spoil(c):
                share = one(c)
                if c.client_id != bad:
                    return share
                t = dict(share.tensors)
                if hostile == "float_share":
                    t["model.w"] = t["model.w"].float()
                else:
                    t["secret"] = torch.zeros(1000, dtype=torch.int64)
                return ClientUpdate(2, t, dict(share.scalars), client_id=bad)

            return type(masked)(**{**masked.__dict__, "one": spoil})

        object.__setattr__(server.secure, "client_side", client_side)
    ledger = CommLedger()
    sent = federated_round(2, server, runner, clients, work, ledger)
    assert [u.client_id for u in sent] == [k for k in PEERS if k != bad]
    assert ledger.rejected() == 1
    federated_round(
        2,
        honest,
        runner,
        [c for c in clients if c.client_id != bad],
        lambda b: ClientWork(one=lambda c: ups[c.client_id]),
        CommLedger(),
    )
    for k, v in honest.global_state.items():
        assert torch.isfinite(server.global_state[k].double()).all()
        assert torch.allclose(server.global_state[k].double(), v.double(), atol=TOL), k


def test_fedtip_reliability_weights_by_a_two_phase_secure_round():
    """FedTIP's reliability weights (Eqs. 27-30) under secure sums: phase one carries the
    clear scalars (counts, coverage, norm), the server computes each r_k, phase two the
    shares n_k r_k dOmega_k and n_kc r_k q_kc; the round's result equals the plain
    reliability-weighted server within the tolerance, the aggregation sees only the sum,
    and the ledger counts both phases and each client's r_k sent down."""
    from fedlightning.server.reliability import coverage_of, update_norm

    g = torch.Generator().manual_seed(5)
    omega = {"w": torch.zeros(2, 3)}
    ups = {}
    for k in PEERS:
        counts = {0: float(k + 1), 1: float(3 - k % 3)}
        delta = torch.randn(6, generator=g) * (1 + 3 * k)  # norms far apart: r_k differ
        tensors = {"delta": delta, **{f"proto.{c}": torch.randn(4, generator=g) for c in counts}}
        scalars = {f"count.{c}": n for c, n in counts.items()}
        scalars |= {"coverage": coverage_of(counts, (0, 1)), "norm": update_norm(delta)}
        ups[k] = ClientUpdate(1, tensors, scalars, k)
    plain = FedTIPServer(omega, proto_norm_ratio=None)  # the screen a secure sum cannot run
    plain.aggregate(1, list(ups.values()))
    server = FedTIPServer(omega)
    server.secure = SecureSum(9, ShareSpec("fedtip", classes=2, dim=4))
    seen = []
    inner = server.aggregate
    server.aggregate = lambda r, us: (seen.append(list(us)), inner(r, us))
    runner = SequentialRunner(executor=None, progress=False)
    clients = [Client(k) for k in PEERS]
    ledger = CommLedger()
    sent = federated_round(
        1, server, runner, clients, lambda b: ClientWork(one=lambda c: ups[c.client_id]), ledger
    )
    assert all(u.tensors["delta"].dtype == torch.int64 for u in sent)
    assert len(seen) == 1 and len(seen[0]) == 1  # the sum alone
    assert torch.allclose(server.omega, plain.omega, atol=TOL)
    for c in (0, 1):
        assert torch.allclose(server.anchors[c], plain.anchors[c], atol=1e-5)
    # the weights matter: support-weighted FedAvg gives another adapter
    avg = FedTIPServer(omega, reliability_weights=False)
    avg.aggregate(1, list(ups.values()))
    assert not torch.allclose(avg.omega, plain.omega, atol=1e-3)
    down = [e for e in ledger.entries if e[0] == "down" and e[3] == "reliability"]
    assert len(down) == len(PEERS)  # each client's r_k, one value each
    up_fields = {e[3] for e in ledger.entries if e[0] == "up"}
    assert {"norm", "coverage", "delta", "proto_sum"} <= up_fields
