"""Robust aggregation (docs/security.md, "Robust aggregation"): each rule against Flower's
own implementation (``flwr.server.strategy.aggregate``) or a hand-computed value, and hostile
(byzantine) clients through the real round: set aside, recorded as suspicious."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedlightning.federation.ledger import CommLedger
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.runners import SequentialRunner
from fedlightning.messages import ClientUpdate
from fedlightning.methods.fedavg.fedavg import FedAvg
from fedlightning.server.aggregate import as_model_fields
from fedlightning.server.robust import (
    RobustRule,
    coordinate_median,
    cosines,
    krum_scores,
    robust_aggregate,
    robust_rule,
    trimmed_mean,
)

K, BAD = 5, 2
GLOBAL = {"w": torch.zeros(3, 2), "b": torch.zeros(2), "steps": torch.tensor(7)}


def updates(seed: int = 0, flip: tuple[int, ...] = ()) -> list[ClientUpdate]:
    """Five clients around a common direction; those in ``flip`` send its opposite, 5x."""
    g = torch.Generator().manual_seed(seed)
    common = {k: torch.randn(v.shape, generator=g) for k, v in GLOBAL.items() if k != "steps"}
    out = []
    for k in range(K):
        s = -5.0 if k in flip else 1.0
        model = {
            n: s * common[n] + 0.1 * torch.randn(v.shape, generator=g) for n, v in common.items()
        }
        model["steps"] = torch.tensor(8)
        out.append(ClientUpdate(1, as_model_fields(model), {"num_examples": 10.0 + k}, k))
    return out


def flower_results(ups):
    """The updates as Flower's ``results``: (list of numpy arrays in key order, examples)."""
    return [
        ([u.tensors[f"model.{k}"].double().numpy() for k in ("w", "b")], int(u.num_examples))
        for u in ups
    ]


def test_median_and_trimmed_mean_equal_flowers():
    pytest.importorskip("flwr")  # the optional `flower` extra: the reference implementation
    from flwr.server.strategy.aggregate import aggregate_median, aggregate_trimmed_avg

    ups = updates(flip=(BAD,))
    for rule, theirs in (
        (RobustRule("median"), aggregate_median(flower_results(ups))),
        (RobustRule("trimmed_mean", trim=0.2), aggregate_trimmed_avg(flower_results(ups), 0.2)),
    ):
        state, kept, flagged = robust_aggregate(rule, ups, GLOBAL)
        assert len(kept) == K and not flagged
        for k, arr in zip(("w", "b"), theirs, strict=True):
            assert torch.allclose(state[k].double(), torch.from_numpy(arr), atol=1e-6), (rule, k)
        assert state["steps"].item() == 8  # integer buffers as FedAvg has them


def test_even_median_is_the_mean_of_the_two_middle_values():
    x = torch.tensor([[1.0, 10.0], [4.0, -2.0], [2.0, 0.0], [100.0, 1.0]], dtype=torch.float64)
    assert coordinate_median(x).tolist() == [3.0, 0.5]  # by hand: (2+4)/2, (0+1)/2
    assert trimmed_mean(x, 0.25).tolist() == [3.0, 0.5]  # cut one each end of four


def test_multi_krum_keeps_flowers_choice():
    pytest.importorskip("flwr")
    from flwr.server.strategy.aggregate import _compute_distances, aggregate_krum

    ups = updates(flip=(1, BAD))
    ours = krum_scores(
        torch.stack(
            [
                torch.cat(
                    [u.tensors["model.w"].reshape(-1).double(), u.tensors["model.b"].double()]
                )
                for u in ups
            ]
        ),
        2,
    )
    dist = _compute_distances([w for w, _ in flower_results(ups)])
    closest = max(1, K - 2 - 2)
    theirs = [np.sort(np.delete(row, i))[:closest].sum() for i, row in enumerate(dist)]
    assert torch.allclose(ours, torch.tensor(theirs, dtype=torch.float64), rtol=1e-9)
    state, kept, flagged = robust_aggregate(RobustRule("krum", byzantine=2, keep=3), ups, GLOBAL)
    assert [u.client_id for u in kept] == [0, 3, 4]
    assert sorted(c for c, _ in flagged) == [1, BAD]
    flower = aggregate_krum(flower_results(ups), 2, 3)  # FedAvg of the three it keeps
    for k, arr in zip(("w", "b"), flower, strict=True):
        assert torch.allclose(state[k].double(), torch.from_numpy(arr), atol=1e-6), k


def test_screen_sets_aside_updates_pointing_away_from_the_median():
    ups = updates(flip=(BAD,))
    state, kept, flagged = robust_aggregate(RobustRule("screen", cosine=0.0), ups, GLOBAL)
    assert [c for c, _ in flagged] == [BAD] and "cosine" in flagged[0][1]
    honest = [u for u in ups if u.client_id != BAD]
    n = [u.num_examples for u in honest]
    by_hand = sum(w * u.tensors["model.w"].double() for w, u in zip(n, honest, strict=True)) / sum(
        n
    )
    assert torch.allclose(state["w"].double(), by_hand, atol=1e-6)
    assert [u.client_id for u in kept] == [0, 1, 3, 4]


def test_screen_by_norm():
    ups = updates()
    ups[BAD].tensors["model.w"] = ups[BAD].tensors["model.w"] * 50  # same direction, 50x
    _, _, flagged = robust_aggregate(RobustRule("screen", cosine=-1.0, norm_ratio=3.0), ups, GLOBAL)
    assert [c for c, _ in flagged] == [BAD] and "norm" in flagged[0][1]


def test_cosines_by_hand():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    assert cosines(x, torch.tensor([2.0, 0.0], dtype=torch.float64)).tolist() == [
        1.0,
        0.0,
        -1.0,
        0.0,
    ]


@pytest.mark.parametrize(
    "raw, message",
    [
        ("mean", "rule"),
        ({"rule": "trimmed_mean", "trim": 0.5}, "trim"),
        ({"rule": "krum", "keep": 0}, "keep"),
        ({"rule": "screen", "cosine": 2}, "cosine"),
        ({"rule": "median", "typo": 1}, "typo"),
    ],
)
def test_bad_settings_name_the_key(raw, message):
    with pytest.raises(ValueError, match=rf"federation\.robust.*{message}"):
        robust_rule(raw)
    assert robust_rule(None) == RobustRule() and not robust_rule("none").on


class Client:
    def __init__(self, client_id: int) -> None:
        self.client_id, self.state = client_id, {}


@pytest.mark.parametrize("rule", ["median", "krum", "screen"])
def test_a_byzantine_client_through_the_round_is_bounded_and_recorded(rule):
    """A sign-flipped 5x client through the real round: the global model stays within the
    honest clients' range, and the rules that set clients aside record them in the ledger's
    ``suspicious`` (not in its rejections: the message passed the screen)."""
    ups = {u.client_id: u for u in updates(flip=(BAD,))}
    server = FedAvg().server(GLOBAL)
    server.robust = robust_rule({"rule": rule, "byzantine": 1})
    ledger = CommLedger()

    def work(broadcast):
        return ClientWork(one=lambda c: ups[c.client_id], uplink=FedAvg().uplink(broadcast))

    clients = [Client(k) for k in range(K)]
    federated_round(1, server, SequentialRunner(None, progress=False), clients, work, ledger)
    honest = torch.stack([ups[k].tensors["model.w"] for k in range(K) if k != BAD])
    w = server.global_state["w"]
    assert bool(((w >= honest.min(0).values - 1e-6) & (w <= honest.max(0).values + 1e-6)).all())
    assert not ledger.rejections and ledger.screened
    summary = ledger.summary()["suspicious"]
    if rule == "median":
        assert summary["count"] == 0
    else:
        assert summary["per_client"] == {str(BAD): 1} and summary["per_round"] == {"1": 1}
    again = CommLedger()
    again.load_state_dict(ledger.state_dict())  # a checkpoint keeps them
    assert again.suspicious == ledger.suspicious


def test_robust_off_is_fedavg_bitwise():
    ups = updates(flip=(BAD,))
    from fedlightning.server.aggregate import fedavg

    state, kept, flagged = robust_aggregate(RobustRule(), ups, GLOBAL)
    assert all(torch.equal(state[k], v) for k, v in fedavg(ups).items()) and not flagged
    assert math.isclose(float(kept[0].num_examples), 10.0)
