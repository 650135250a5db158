"""DyGPrompt learns: trained prompts (R = 20, E = 5) beat their untrained self on link prediction
by more than three standard errors of the AUC, on Bitcoin-Alpha; on the synthetic stream they
do not (an expected failure, kept strict so that a change which makes them learn there is seen).

The untrained self is the same config with one round of one step at learning rates of 1e-12
(Adam's step is about the learning rate, so no weight moves): with ``init=identity`` it is the
frozen bank's own cosine similarity, the zero-shot floor. The margin: an AUC ``A`` over ``n``
positives and ``n`` negatives has a standard error of at most ``sqrt(A (1 - A) / n)``
(the variance of a Mann-Whitney statistic is at most ``A (1 - A) / min(n_pos, n_neg)``;
Birnbaum and Klose, 1957), so the test asks for ``3 sqrt(A0 (1 - A0) / n)`` above the
untrained ``A0``, ``n`` the test segment's events (one negative each; the inductive subset
for ``auc_ilp``).
"""

from __future__ import annotations

import math

import pytest

from fedlightning.train import train

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

SETTING = [  # FedTIP's learning setting (tests/integration/test_learning.py), link prediction
    "experiment=temporal_synthetic",
    "protocol.tasks.num_tasks=3",
    "protocol.tasks.support=120",
    "protocol.tasks.active=10",
    "bank.epochs=1",
    "bank.max_events=2000",
    "families=[lp]",
    "logger=none",
    "runner.progress=false",
]
UNTRAINED = [
    "federation.rounds=1",
    "federation.local_epochs=1",
    "algorithm.lr=1e-12",
    "algorithm.cn_lr=1e-12",
]


def margin(a: float, n: int) -> float:
    """Three standard errors of an AUC ``a`` over ``n`` positives and ``n`` negatives."""
    return 3 * math.sqrt(max(a * (1 - a), 1e-4) / n)


def gains(compose, root, over: list[str], keys: tuple[str, ...]) -> list[tuple]:
    """(key, untrained, trained, n) for each AUC in ``keys``."""
    trained = train(compose(over), root / "trained", verbose=False)
    untrained = train(compose([*over, *UNTRAINED]), root / "untrained", verbose=False)
    sizes = {"auc_tlp": trained["table"]["test"], "auc_ilp": trained["table"]["ind_test"]}
    return [(k, untrained["metrics"][k], trained["metrics"][k], sizes[k]) for k in keys]


@pytest.mark.parametrize(
    "algorithm, keys",
    [("dygprompt_central", ("auc_tlp", "auc_ilp")), ("dygprompt_fedavg", ("auc_tlp",))],
)
def test_dygprompt_link_prediction_beats_its_untrained_self_on_bitcoin_alpha(
    algorithm, keys, tmp_env, compose, shared_data, monkeypatch
):
    """The TGAT bank (the full one, as measured in docs/fedtip.md), the first 3 tasks.
    Measured (20 tasks, seed 2026): central 0.700 vs 0.554 (T-LP, n = 3,851, margin 0.024),
    0.720 vs 0.591 (I-LP, n = 640, margin 0.058); FedAvg 0.597 vs 0.554 (T-LP); FedAvg's I-LP
    gain (0.627 vs 0.591) is inside its margin, so it is not asserted."""
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(tmp_env / "cache"))
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    over = [
        "experiment=temporal_bitcoin_alpha", f"algorithm={algorithm}", "bank=tgat",
        "max_tasks=3", "families=[lp]", "logger=none", "runner.progress=false",
    ]  # fmt: skip
    for key, a0, a1, n in gains(compose, tmp_env, over, keys):
        assert a1 > a0 + margin(a0, n), (key, a0, a1, n)


@pytest.mark.xfail(strict=True, reason="DyGPrompt does not beat the bank's cosine here")
@pytest.mark.parametrize("algorithm", ["dygprompt_fedavg", "dygprompt_central"])
def test_dygprompt_on_the_synthetic_stream_does_not_beat_its_untrained_self(
    algorithm, tmp_env, compose, monkeypatch
):
    """Measured (seed 2026, FedTIP's learning setting): T-LP 0.5474 (FedAvg) and 0.5461
    (central) against the untrained 0.5500 (n = 3,200, margin 0.026); the validation segment
    rose (0.505 to 0.538, central, n = 400, margin 0.075). Also below or inside the margin:
    the full synthetic bank (0.6225 vs 0.6388), the released start (``init=xavier``, full
    bank: 0.5763 vs 0.5581), node classification (0.8815 vs 0.9493 with ``label_shift=2``:
    the event features that carry the label are not DyGPrompt's inputs). The stream's links
    follow favourites and popularity with Poisson gaps: nothing for the time prompts, and the
    node prompts only reweight a cosine the bank already sets (docs/fedtip.md)."""
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(tmp_env / "cache"))
    over = [*SETTING, f"algorithm={algorithm}"]
    for key, a0, a1, n in gains(compose, tmp_env, over, ("auc_tlp",)):
        assert a1 > a0 + margin(a0, n), (key, a0, a1, n)
