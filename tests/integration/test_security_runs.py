"""Secure sums and the private prototype release in real runs, in-process (docs/security.md)."""

import json

import pytest

from fedlightning.server.privacy import epsilon
from fedlightning.train import train

pytestmark = pytest.mark.slow
TOL = 1e-6  # see docs/security.md: fixed-point sums are exact up to n 2^-33 per value


def _close(a, b):
    assert set(a) == set(b)
    for k, v in a.items():
        if isinstance(v, float) and "mib" not in k and "time" not in k:  # shares are int64
            assert b[k] == pytest.approx(v, abs=TOL), k


# the plain runs aggregate by FedAvg itself: the robust default, which a secure sum makes step
# aside, sets a dissenting honest client of fl_synthetic aside (docs/security.md)
PLAIN = "federation.robust=none"


def test_fedavg_with_secure_sums_equals_the_plain_run(tmp_env, compose):
    base = ["experiment=fl_synthetic", "algorithm=fedavg", "federation.rounds=2", "logger=none",
            PLAIN]  # fmt: skip
    plain = train(compose(base), tmp_env / "plain", verbose=False)
    secure = train(compose([*base, "federation.secure_sum=true"]), tmp_env / "s", verbose=False)
    _close(plain["metrics"], secure["metrics"])
    # what crossed were int64 ring elements: 8 bytes a model value instead of 4
    assert secure["comm"]["uplink_values"] == plain["comm"]["uplink_values"]


def test_max_client_weight_with_secure_sums_equals_the_capped_plain_run(tmp_env, compose):
    """The cap travels with secure sums: each client caps its weight before masking, so the
    capped secure run ends where the capped plain run does (before, the shares carried the
    clear counts and the cap was lost)."""
    base = ["experiment=fl_synthetic", "algorithm=fedavg", "federation.rounds=2", "logger=none",
            PLAIN]  # fmt: skip
    cap = [*base, "algorithm.max_client_weight=20"]
    free = train(compose(base), tmp_env / "free", verbose=False)
    plain = train(compose(cap), tmp_env / "plain", verbose=False)
    secure = train(compose([*cap, "federation.secure_sum=true"]), tmp_env / "s", verbose=False)
    _close(plain["metrics"], secure["metrics"])
    assert plain["metrics"]["test_acc"] != free["metrics"]["test_acc"]  # the cap bites
    assert secure["comm"]["rejected"]["count"] == 0


DEMO = [
    "experiment=demo",
    "federation.rounds=1",
    "federation.local_epochs=1",
    "protocol.stream.stages=[2,1]",
]


def test_fedogl_with_a_private_release_reports_its_budget(tmp_env, compose):
    over = [*DEMO, "logger=none"]
    dp = ["algorithm.dp.clip=1.0", "algorithm.dp.sigma=2.0"]
    s = train(compose([*over, *dp]), tmp_env / "dp", verbose=False)
    releases = 2  # 2 stages x 1 round, every client releases its classes once a round
    assert s["privacy"]["releases"] == releases
    assert s["privacy"]["epsilon"] == pytest.approx(epsilon(2.0, releases, 1e-5))
    assert 0 < s["metrics"]["dp_epsilon"] < 100
    on_disk = json.loads((tmp_env / "dp" / "summary.json").read_text())
    assert on_disk["privacy"]["epsilon"] == pytest.approx(s["privacy"]["epsilon"])


def test_fedogl_sums_models_and_prototypes_securely(tmp_env, compose):
    over = [*DEMO, "logger=none", "federation.secure_sum=true"]
    s = train(compose(over), tmp_env / "s", verbose=False)
    assert 0.0 <= s["metrics"]["am"] <= 1.0
    # masked shares show no client's model: Eq. (4) from the clients' own models is left out
    assert "d_fed" in s["metrics"] and "d_fed_local" not in s["metrics"]


FEDTIP = [
    "experiment=temporal_synthetic",
    "algorithm=fedtip",
    "protocol.tasks.num_tasks=1",
    "federation.rounds=2",
    "federation.local_epochs=1",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
]


def test_fedtip_eq6_by_secure_sums_equals_the_plain_run(tmp_env, compose):
    avg = [*FEDTIP, "algorithm.aggregation=fedavg"]
    plain = train(compose(avg), tmp_env / "p", verbose=False)
    secure = train(compose([*avg, "federation.secure_sum=true"]), tmp_env / "s", verbose=False)
    _close(plain["metrics"], secure["metrics"])


def test_fedtip_reliability_weights_by_secure_sums_equal_the_plain_run(tmp_env, compose):
    """FedTIP's default (reliability weights, Eqs. 27-30) under secure sums: two phases a
    round (the clear scalars, then the r_k-weighted shares), the plain run's AUCs."""
    plain = train(compose(FEDTIP), tmp_env / "p", verbose=False)
    secure = train(compose([*FEDTIP, "federation.secure_sum=true"]), tmp_env / "s", verbose=False)
    _close(plain["metrics"], secure["metrics"])


def test_fedtip_private_release_reports_its_budget(tmp_env, compose):
    dp = train(
        compose([*FEDTIP, "algorithm.dp.clip=1.0", "algorithm.dp.sigma=1.0"]),
        tmp_env / "dp",
        verbose=False,
    )
    fams = len(dp["families"])
    assert dp["privacy"]["releases"] == 1 * 2 * fams
    assert dp["metrics"]["dp_epsilon"] == pytest.approx(epsilon(1.0, 2 * fams, 1e-5))


def test_robust_aggregation_with_secure_sums_is_refused_in_one_line(tmp_env, compose):
    """A robust rule reads each client's update, which a secure sum hides: the combination
    is refused before training, naming the key."""
    from fedlightning.errors import ConfigError

    over = ["experiment=fl_synthetic", "algorithm=fedavg", "federation.rounds=1", "logger=none",
            "federation.robust=median", "federation.secure_sum=true"]  # fmt: skip
    with pytest.raises(
        ConfigError,
        match=r"config `federation.robust`: median cannot run: federation.secure_sum=true hides",
    ) as e:
        train(compose(over), tmp_env / "both", verbose=False)
    assert "\n" not in str(e.value)


def test_a_robust_run_reports_its_suspicious_clients(tmp_env, compose):
    """``federation.robust=krum``: the clients multi-Krum sets aside each round are in
    ``comm.suspicious`` and the metrics (MLflow's ``suspicious`` per round)."""
    over = ["experiment=fl_synthetic", "algorithm=fedavg", "federation.rounds=2", "logger=none",
            "federation.robust={rule: krum, byzantine: 1}"]  # fmt: skip
    s = train(compose(over), tmp_env / "krum", verbose=False)
    assert s["comm"]["suspicious"]["per_round"] == {"1": 1, "2": 1}  # n - f = 4 of 5 kept
    assert s["metrics"]["suspicious"] == 2.0 and s["comm"]["rejected"]["count"] == 0
