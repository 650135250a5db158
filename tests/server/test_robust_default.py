"""The robust default (``federation.robust=auto``, docs/security.md "Robust aggregation"):
the relative screen's decisions computed by hand on tiny tensors, the previous-update
reference, centered clipping, the default stepping aside under secure sums, and FedTIP's
adapter aggregated by the same rules (hostile clients set aside, recorded as suspicious)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from fedlightning.errors import ConfigError
from fedlightning.federation.ledger import CommLedger
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.runners import SequentialRunner
from fedlightning.messages import ClientUpdate
from fedlightning.methods.fedavg.fedavg import FedAvg
from fedlightning.server.aggregate import as_model_fields, fedavg
from fedlightning.server.reliability import (
    FedTIPServer,
    aggregate,
    read_update,
    with_robust,
)
from fedlightning.server.robust import (
    PRESETS,
    RobustRule,
    centered_clip,
    chance_margin,
    coordinate_median,
    global_update,
    median_signs,
    pairwise,
    peer_outvoted,
    robust_aggregate,
    robust_deltas,
    robust_rule,
    robust_setting,
    screened,
    sign_agreement,
)

F64 = torch.float64


def rows(*r: list[float]) -> torch.Tensor:
    return torch.tensor(r, dtype=F64)


# --------------------------------------------------------------- the relative screen by hand
def test_relative_screen_sets_aside_a_byzantine_cosine_below_half_the_median_cosine():
    """Rows (1,0), (1,1), (0,1), (2,1), (-1,0.2): coordinate-wise median (1, 1); cosines
    1/sqrt2, 1, 1/sqrt2, 3/sqrt10, -0.8/sqrt(2.08); their (lower) median is 1/sqrt2, so the
    threshold is max(0, 0.5/sqrt2) = 0.354: the last row alone is set aside. A row at
    cos 0.3 (positive, so the absolute rule keeps it) is set aside by the relative one."""
    x = rows([1, 0], [1, 1], [0, 1], [2, 1], [-1, 0.2])
    auto = RobustRule("screen", cosine=0.0, relative=0.5)
    flagged = screened(auto, x, [10, 11, 12, 13, 14], None)
    assert [c for c, _ in flagged] == [14]
    cos = -0.8 / math.sqrt(1.04 * 2)
    assert f"cosine {cos:.3f} to the median update < {0.5 / math.sqrt(2):.3g}" in flagged[0][1]
    # a row at cosine 0.3 to (1, 1): angle 45 + acos(0.3) degrees from the x axis
    a = math.pi / 4 + math.acos(0.3)
    x2 = torch.cat([x[:4], rows([math.cos(a), math.sin(a)])])
    assert [c for c, _ in screened(auto, x2, range(5), None)] == [4]
    assert screened(RobustRule("screen", cosine=0.0), x2, range(5), None) == []


def test_relative_threshold_never_falls_below_the_absolute_one():
    """Against the reference (1, 0) (``previous``), rows at cosines -0.9, -0.8, -0.3, -0.02
    and 1: the median cosine is -0.3, half of it -0.15, so the threshold is ``cosine`` (0)
    and the row at -0.02 is set aside too; at a median of 0.6 the threshold is 0.3."""
    cos = [-0.9, -0.8, -0.3, -0.02, 1.0]
    x = torch.tensor([[c, math.sqrt(1 - c * c)] for c in cos], dtype=F64)
    rule = RobustRule("screen", cosine=0.0, relative=0.5, reference="previous")
    assert [c for c, _ in screened(rule, x, range(5), rows([1, 0])[0])] == [0, 1, 2, 3]
    cos = [0.2, 0.35, 0.6, 0.9, 1.0]
    x = torch.tensor([[c, math.sqrt(1 - c * c)] for c in cos], dtype=F64)
    assert [c for c, _ in screened(rule, x, range(5), rows([1, 0])[0])] == [0]


def test_sign_agreement_by_hand():
    """Reference (1, -2, 0, 3): the coordinates where it is not zero are 0, 1, 3. Row
    (2, -1, 5, 1) agrees on all three (1); (-1, -1, 0, -1) on one of three ((1 - 2)/3);
    (0, 1, 1, 0) disagrees on one, is zero on two (-1/3)."""
    ref = rows([1, -2, 0, 3])[0]
    x = rows([2, -1, 5, 1], [-1, -1, 0, -1], [0, 1, 1, 0])
    assert torch.allclose(sign_agreement(x, ref), rows([1, -1 / 3, -1 / 3])[0])
    assert sign_agreement(x, torch.zeros(4, dtype=F64)).tolist() == [0.0, 0.0, 0.0]


def test_the_default_screens_byzantine_rows_by_sign_agreement_with_half_the_median():
    """Five rows; the median (1, 1, 1, 0) (coordinate-wise); sign agreements on the first
    three coordinates: 1, 1, 1/3, 1/3, -1/3. Their median 1/3, half of it 1/6: only the
    last row is set aside (and a row at 1/3 is kept, though below the others)."""
    x = rows([1, 1, 1, 5], [2, 1, 3, -5], [1, 1, -1, 0], [-1, 2, 1, 0], [1, -1, -1, 0])
    assert torch.equal(coordinate_median(x), rows([1, 1, 1, 0])[0])
    flagged = screened(robust_rule("auto"), x, range(5), None)
    assert [c for c, _ in flagged] == [4]
    assert flagged[0][1] == "sign agreement -0.333 to the median update < 0.167"


def test_previous_reference_sets_aside_a_byzantine_row_by_hand():
    """Reference ``previous`` = (1, 0): cosines of (1,1), (-1,0.1), (0,1) are 0.707, -0.995,
    0; with ``cosine`` 0 only the second is set aside. Without a usable previous update (none,
    zero, or another length) the median (0, 1) is the reference: the first two are kept and
    the third... all three have cosine >= 0 to (0, 1)."""
    x = rows([1, 1], [-1, 0.1], [0, 1])
    rule = RobustRule("screen", reference="previous")
    flagged = screened(rule, x, range(3), rows([1, 0])[0])
    assert [c for c, _ in flagged] == [1] and "previous global update" in flagged[0][1]
    for prev in (None, torch.zeros(2, dtype=F64), torch.ones(3, dtype=F64)):
        assert screened(rule, x, range(3), prev) == []


def test_centered_clip_by_hand():
    """Centre 0, tau 1, one iteration: (3, 0) is clipped to (1, 0), (0, 0.5) kept: the mean
    (0.5, 0.25). A second iteration from there: deviations (2.5, -0.25) (norm 2.512, clipped
    to 1) and (-0.5, 0.25) (kept)."""
    x = rows([3, 0], [0, 0.5])
    v1 = centered_clip(x, torch.zeros(2, dtype=F64), 1.0, 1)
    assert torch.allclose(v1, rows([0.5, 0.25])[0])
    d = rows([2.5, -0.25])[0]
    step = (d / d.norm() + rows([-0.5, 0.25])[0]) / 2
    assert torch.allclose(centered_clip(x, torch.zeros(2, dtype=F64), 1.0, 2), v1 + step)
    # tau None: the median norm of the first deviations, the lower of {3, 0.5}: 0.5
    assert torch.allclose(
        centered_clip(x, torch.zeros(2, dtype=F64), None, 1), rows([0.25, 0.25])[0]
    )
    agg, kept, flagged = robust_deltas(RobustRule("centered_clip", tau=1.0, iters=1), x, [0, 1])
    assert torch.allclose(agg, v1) and kept == [0, 1] and flagged == []


def test_median_signs_are_the_signs_of_the_coordinate_median():
    """For odd row counts the sign of the middle value, zeros and ties included, is read
    from counts; the screen's sign agreement with it equals that with the median."""
    g = torch.Generator().manual_seed(1)
    for n in (1, 3, 5, 7):
        x = torch.randint(-2, 3, (n, 500), generator=g).to(F64)  # many zeros and ties
        assert torch.equal(median_signs(x), torch.sign(coordinate_median(x))), n
        assert torch.equal(
            sign_agreement(x, median_signs(x)), sign_agreement(x, coordinate_median(x))
        )


# --------------------------------------------------------------------- the peer vote by hand
def test_two_colluders_are_outvoted_by_their_peers():
    """Honest rows h1 = (1,1,1,1,1), h2 = (1,1,1,-1,1), h3 = (1,1,1,1,-1) and two colluders
    sending -h1, -h2. Pairwise sign agreement (/5): h1.h2 = h1.h3 = 3/5, h2.h3 = 1/5;
    -h1 against h1, h2, h3: -1, -3/5, -3/5; -h2 against them: -3/5, -1, -1/5; the two
    colluders agree with each other (3/5). Each colluder is below -0.1 with 3 of its 4
    peers (more than half: set aside); each honest row only with the 2 colluders (kept)."""
    h = rows([1, 1, 1, 1, 1], [1, 1, 1, -1, 1], [1, 1, 1, 1, -1])
    x = torch.cat([-h[:2], h])  # clients 0 and 1 collude
    expected = (
        torch.tensor(
            [
                [5, 3, -5, -3, -3],
                [3, 5, -3, -5, -1],
                [-5, -3, 5, 3, 3],
                [-3, -5, 3, 5, 1],
                [-3, -1, 3, 1, 5],
            ],
            dtype=F64,
        )
        / 5
    )
    assert torch.equal(pairwise(x, "sign"), expected)
    assert peer_outvoted(pairwise(x, "sign"), -0.1) == [(0, 3), (1, 3)]
    # the screen subtracts the chance margin 3 / sqrt(d): each coordinate repeated 100
    # times (d = 500) keeps every agreement and gives a margin of 0.134
    wide = x.repeat_interleave(100, dim=1)
    assert chance_margin(wide) == pytest.approx(3 / math.sqrt(500))
    only_peers = RobustRule("screen", measure="sign", cosine=-1.0, peers=0.0)
    flagged = screened(only_peers, wide, [7, 8, 9, 10, 11], None)
    assert [c for c, _ in flagged] == [7, 8]
    assert flagged[0][1] == "sign agreement < -0.134 with 3 of its 4 peers"
    # at d = 5 the margin (1.34) exceeds every agreement: five coordinates prove nothing
    assert screened(only_peers, x, range(5), None) == []
    # the cosine as the measure: -h1 has cosine -1, -3/5, -3/5 to the honest rows
    assert [i for i, _ in peer_outvoted(pairwise(x, "cosine"), -0.1)] == [0, 1]


def test_the_peer_vote_keeps_independent_honest_updates_and_needs_five_clients():
    """Five independent random updates of 10,000 weights agree in sign about 0 +- 0.01
    with each other: about half of the pairs are below 0, but none below the chance
    margin 0.03, so the default sets nobody aside (without the margin, some client would
    be outvoted). Fewer than five clients take no vote: two never outvote each other,
    even pointing in opposite directions, nor do three outvote one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 10_000, generator=g, dtype=F64)
    assert peer_outvoted(pairwise(x, "sign"), 0.0) != []
    assert screened(robust_rule("auto"), x, range(5), None) == []
    assert peer_outvoted(pairwise(rows([1, 1], [-1, -1]), "sign"), -0.1) == []
    assert peer_outvoted(pairwise(rows([1, 1], [1, 1], [-1, -1]), "sign"), -0.1) == []


def test_clients_that_each_pull_their_own_way_are_not_outvoted():
    """Five updates that each pull away from the others' mean (rows of independent
    Gaussians minus their mean: pairwise correlation -1/4, so sign agreement about
    (2/pi) asin(-1/4) = -0.161 for every pair) are below the margin with all 4 peers; each
    client's voters disagree among themselves just as much, so they are no consensus and
    nobody is set aside. The colluders of the hand-computed case are still outvoted: their
    voters h1, h2, h3 agree with a mean of (3 + 3 + 1) / 15 = 0.467."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(5, 10_000, generator=g, dtype=F64)
    x = v - v.mean(dim=0)
    a = pairwise(x, "sign")
    off = a[~torch.eye(5, dtype=torch.bool)]
    assert off.max() < -0.03 and abs(float(off.mean()) + 2 / math.pi * math.asin(0.25)) < 0.02
    assert [v for _, v in peer_outvoted(a, -0.03)] == [4] * 5  # no consensus asked: all five
    assert peer_outvoted(a, -0.03, 0.03) == []
    assert screened(robust_rule("auto"), x, range(5), None) == []
    h = rows([1, 1, 1, 1, 1], [1, 1, 1, -1, 1], [1, 1, 1, 1, -1])
    colluders = torch.cat([-h[:2], h])
    assert peer_outvoted(pairwise(colluders, "sign"), -0.1, 0.466) == [(0, 3), (1, 3)]
    assert peer_outvoted(pairwise(colluders, "sign"), -0.1, 0.467) == []


# ------------------------------------------------------------- settings and stepping aside
def test_auto_is_the_relative_screen_and_presets_take_overrides():
    auto = robust_rule("auto")
    got = (auto.rule, auto.reference, auto.measure, auto.cosine, auto.relative, auto.peers)
    assert got == ("screen", "median", "sign", 0.0, 0.5, 0.0) and auto.auto
    assert robust_rule({"rule": "auto", "relative": 0.6}).relative == 0.6
    assert robust_rule(PRESETS["auto"]) == auto
    for raw, key in [
        ({"rule": "screen", "reference": "mean"}, "reference"),
        ({"rule": "screen", "relative": 1.5}, "relative"),
        ({"rule": "screen", "measure": "angle"}, "measure"),
        ({"rule": "screen", "peers": 1.5}, "peers"),
        ({"rule": "centered_clip", "tau": 0}, "tau"),
        ({"rule": "centered_clip", "iters": 0}, "iters"),
    ]:
        with pytest.raises(ValueError, match=rf"federation\.robust\.{key}"):
            robust_rule(raw)


def test_the_default_steps_aside_under_secure_sums_with_one_line(caplog):
    with caplog.at_level(logging.DEBUG, logger="fedlightning.server.robust"):
        assert robust_setting("auto", fedavg_aggregation=True, secure=True) is None
        assert robust_setting("auto", fedavg_aggregation=False, secure=False) is None
        assert robust_setting("auto", True, False, temporal=True) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(
        line.startswith("federation.robust=auto steps aside") for line in lines
    )
    assert "secure_sum" in lines[0] and "otherwise" in lines[1]
    assert robust_setting("auto", True, False) == robust_rule("auto")
    with pytest.raises(ConfigError, match=r"federation\.robust.*screen cannot run.*secure_sum"):
        robust_setting("screen", True, True)
    with pytest.raises(ConfigError, match=r"^config `federation\.robust\.trim`"):
        robust_setting({"rule": "trimmed_mean", "trim": 0.7}, True, False)
    assert robust_setting("none", True, True) is None


def test_graph_program_lets_the_default_step_aside_under_secure_sums():
    """``robust_of`` (the graph program) returns no rule for the default under secure sums
    and for a method that aggregates otherwise, and still refuses a rule set by hand."""
    from omegaconf import OmegaConf

    from fedlightning.programs.graph_program import robust_of

    server = FedAvg().server({"w": torch.zeros(2)})
    cfg = OmegaConf.create({"federation": {"robust": "auto", "secure_sum": True}})
    assert robust_of(cfg, server) is None
    cfg.federation.secure_sum = False
    assert robust_of(cfg, server) == robust_rule("auto")
    other = FedAvg().server({"w": torch.zeros(2)})
    other.aggregator = lambda ups: ups[0].tensors
    assert robust_of(cfg, other) is None
    cfg.federation.robust, cfg.federation.secure_sum = "screen", True
    with pytest.raises(ConfigError, match="secure_sum"):
        robust_of(cfg, server)


# ------------------------------------------------------------------ the graph server
K, BAD = 5, 2
GLOBAL = {"w": torch.zeros(4, 3), "steps": torch.tensor(7)}


def model_updates(
    rnd: int = 1, flip: tuple[int, ...] = (), seed: int = 0, start: dict | None = None
) -> list[ClientUpdate]:
    """Five clients whose updates share a direction with much spread; ``flip`` send theirs
    turned around."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(4, 3, generator=g)
    base = (start or GLOBAL)["w"]
    out = []
    for k in range(K):
        d = common + 0.3 * torch.randn(4, 3, generator=g)
        model = {"w": base + (-d if k in flip else d), "steps": torch.tensor(8)}
        out.append(ClientUpdate(rnd, as_model_fields(model), {"num_examples": 10.0 + k}, k))
    return out


def test_the_default_on_an_honest_round_is_fedavg_bitwise_and_flags_nobody():
    ups = model_updates()
    state, kept, flagged = robust_aggregate(robust_rule("auto"), ups, GLOBAL)
    assert flagged == [] and len(kept) == K
    assert all(torch.equal(state[k], v) for k, v in fedavg(ups).items())


def test_the_default_sets_a_hostile_sign_flipped_client_aside_through_the_round():
    """Through the real round with the default: the flipped client is recorded in
    ``suspicious`` (the ledger reports it once one is set aside) and the model is the
    FedAvg of the others; an honest round leaves the ledger's summary without the key."""
    for flip in ((), (BAD,)):
        ups = {u.client_id: u for u in model_updates(flip=flip)}
        server = FedAvg().server(GLOBAL)
        server.robust = robust_rule("auto")
        ledger = CommLedger()

        def work(broadcast, ups=ups):
            return ClientWork(one=lambda c: ups[c.client_id], uplink=FedAvg().uplink(broadcast))

        clients = [type("C", (), {"client_id": k, "state": {}})() for k in range(K)]
        federated_round(1, server, SequentialRunner(None, progress=False), clients, work, ledger)
        honest = [u for k, u in ups.items() if k not in flip]
        assert torch.equal(server.global_state["w"], fedavg(honest)["w"])
        if flip:
            assert ledger.summary()["suspicious"]["per_client"] == {str(BAD): 1}
        else:
            assert "suspicious" not in ledger.summary() and not ledger.screened


def test_the_server_keeps_the_previous_update_across_a_checkpoint_with_a_hostile_round():
    """``reference: previous``: the server remembers the last global step (the rule's
    reference) in its state dict; a server restored from it decides the next round alike."""
    rule = RobustRule("screen", reference="previous")
    a = FedAvg().server(GLOBAL)
    a.robust = rule
    a.aggregate(1, model_updates(1))
    step = global_update(a.global_state, GLOBAL)
    assert torch.equal(a.previous, step) and torch.equal(a.state_dict()["robust_previous"], step)
    b = FedAvg().server(GLOBAL)
    b.robust = rule
    b.load_state_dict(a.state_dict())
    nxt = model_updates(2, flip=(BAD,), seed=1, start=a.global_state)
    a.aggregate(2, nxt)
    b.aggregate(2, nxt)
    assert torch.equal(a.global_state["w"], b.global_state["w"]) and a.flagged == b.flagged
    for rule in (None, robust_rule("auto")):  # off, or a rule without it: nothing new
        plain = FedAvg().server(GLOBAL)
        plain.robust = rule
        plain.aggregate(1, model_updates(1))
        assert "robust_previous" not in plain.state_dict()


# ------------------------------------------------------------------ FedTIP's adapter
D, D_H = 6, 3


def tip_updates(flip: tuple[int, ...] = (), seed: int = 0) -> list[ClientUpdate]:
    """Five FedTIP messages (Eq. 2): deltas around a common direction, two classes with
    prototypes and counts; ``flip`` send their delta turned around and 3x."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(D, generator=g)
    out = []
    for k in range(K):
        d = common + 0.3 * torch.randn(D, generator=g)
        d = -3 * d if k in flip else d
        tensors = {"delta": d, "proto.0": torch.ones(D_H), "proto.1": -torch.ones(D_H)}
        scalars = {"count.0": 2.0 + k, "count.1": 3.0}
        out.append(ClientUpdate(1, tensors, scalars, client_id=k))
    return out


def tip_server(rule: RobustRule | None) -> FedTIPServer:
    server = FedTIPServer({"omega": torch.zeros(D)}, eta_s=1.0, beta=0.1)
    server.robust = rule
    return server


def test_fedtip_adapter_screen_sets_the_hostile_flipped_client_aside():
    """A sign-flipped 3x delta is set aside; the adapter and the anchors are Eq. (30)-(31)
    and (23)-(24) over the other four (reliability weights recomputed among them)."""
    ups = tip_updates(flip=(BAD,))
    server = tip_server(robust_rule("auto"))
    server.aggregate(1, ups)
    assert [c for c, _ in server.flagged] == [BAD]
    honest = [read_update(u) for u in ups if u.client_id != BAD]
    omega, anchors, _ = aggregate(torch.zeros(D), {}, honest, 1.0, 0.1, True)
    assert torch.allclose(server.omega, omega) and torch.allclose(server.anchors[0], anchors[0])
    clean = tip_server(robust_rule("auto"))
    clean.aggregate(1, tip_updates())
    off = tip_server(None)
    off.aggregate(1, tip_updates())
    assert clean.flagged == [] and torch.equal(clean.omega, off.omega)


def test_fedtip_adapter_median_bounds_a_hostile_client_by_hand():
    """``median``: Eq. (31) with the coordinate-wise median of the deltas in place of
    Eq. (30)'s mean; the anchors from every message."""
    ups = tip_updates(flip=(BAD,))
    server = tip_server(robust_rule("median"))
    server.aggregate(1, ups)
    med = torch.stack([u.tensors["delta"].double() for u in ups]).median(dim=0).values
    assert torch.allclose(server.omega.double(), med) and server.flagged == []
    assert server.previous is None  # the median reads no previous update
    cc = tip_server(robust_rule({"rule": "centered_clip", "tau": 1e9, "iters": 1}))
    cc.aggregate(1, ups)  # tau beyond every deviation: the plain mean from 0
    mean = torch.stack([u.tensors["delta"].double() for u in ups]).mean(dim=0)
    assert torch.allclose(cc.previous, mean) and torch.allclose(cc.omega.double(), mean)


def test_fedtip_robust_is_wired_per_task_server_and_refuses_other_servers():
    server = tip_server(None)
    assert with_robust(server, robust_rule("krum")) is server
    assert server.robust == robust_rule("krum")
    assert with_robust(object, None) is object  # no rule: the method's own server
    with pytest.raises(ConfigError, match=r"federation\.robust.*aggregates otherwise"):
        with_robust(object(), robust_rule("krum"))


def test_fedtip_robust_through_the_round_records_hostile_clients_as_suspicious():
    ups = {u.client_id: u for u in tip_updates(flip=(BAD,))}
    server = tip_server(robust_rule("screen"))
    ledger = CommLedger()

    def work(broadcast):
        return ClientWork(one=lambda c: ups[c.client_id])

    clients = [type("C", (), {"client_id": k, "state": {}})() for k in range(K)]
    federated_round(1, server, SequentialRunner(None, progress=False), clients, work, ledger)
    assert ledger.summary()["suspicious"]["per_client"] == {str(BAD): 1}
    assert not ledger.rejections


def test_a_hostile_client_of_a_method_that_sends_part_of_its_model_is_screened():
    """A global field no client sends (a frozen part) is left out of the updates the rule
    reads (it used to raise ``KeyError`` for FedMVP and PRISM)."""
    ups = model_updates(flip=(BAD,))
    reference = {**GLOBAL, "frozen": torch.ones(2)}
    state, kept, flagged = robust_aggregate(robust_rule("auto"), ups, reference)
    assert [c for c, _ in flagged] == [BAD] and "frozen" not in state
    med, _, _ = robust_aggregate(robust_rule("median"), ups, reference)
    by_hand = torch.stack([u.tensors["model.w"] for u in ups]).median(dim=0).values
    assert torch.allclose(med["w"], by_hand)
