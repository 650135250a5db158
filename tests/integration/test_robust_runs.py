"""``federation.robust`` on FedTIP's adapter, end to end on the synthetic stream
(docs/security.md, "Robust aggregation"): one client of each round sends its delta turned
around (its reported norm consistent), a hostile update no bound catches; the screen sets it
aside, records it as suspicious, and the AUCs end near the clean run's."""

from __future__ import annotations

import pytest

from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.train import train

pytestmark = pytest.mark.slow

SMALL = [
    "experiment=temporal_synthetic",
    "algorithm=fedtip",
    "protocol.tasks.num_tasks=3",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
    "task_workers=1",  # the spoiled fit is patched in this process
]


def flip_highest(monkeypatch) -> None:
    """The highest client id of each round sends ``-3`` times its delta (norm reported)."""
    real = FedTIP.make_updates

    def spoiled(self, module, batch, start, round, client_ids, generators=None):
        out = real(self, module, batch, start, round, client_ids, generators)
        for u in out:
            if u.client_id == max(client_ids):
                u.tensors["delta"] = -3 * u.tensors["delta"]
                u.scalars["norm"] = float(u.tensors["delta"].norm())
        return out

    monkeypatch.setattr(FedTIP, "make_updates", spoiled)


def test_fedtip_adapter_screen_sets_a_hostile_sign_flipped_client_aside(
    tmp_path, compose, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(tmp_path / "cache"))

    def run(name, extra):
        return train(compose([*SMALL, *extra]), tmp_path / name, verbose=False)

    clean = run("clean", ["federation.robust=screen"])
    assert clean["comm"]["suspicious"]["count"] == 0  # explicit: reported, even at zero
    default = run("default", [])  # the default steps aside on temporal runs: bitwise none
    off = run("off", ["federation.robust=none"])
    assert default["metrics"] == off["metrics"] and "suspicious" not in default["comm"]
    flip_highest(monkeypatch)
    screened = run("screened", ["federation.robust=screen"])
    flagged = screened["comm"]["suspicious"]
    assert flagged["count"] >= 1 and not screened["comm"]["rejected"]["count"]
    for key in ("auc_nc", "auc_tlp", "auc_ilp"):
        assert abs(screened["metrics"][key] - clean["metrics"][key]) <= 0.01, key
