"""The real CiteSeer-MM retrieval experiment, composed as the CLI composes it, end to end."""

from __future__ import annotations

import json
import math

import pytest

from fedlightning.train import train


@pytest.mark.slow
def test_cir_fedavg_replay_citeseer_mm_end_to_end(tmp_env, shared_data, monkeypatch, compose):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    cfg = compose(
        ["experiment=cir_fedavg_replay_citeseer_mm", "federation.rounds=2", "logger=none"]
    )
    s = train(cfg, tmp_env / "run")
    m = s["metrics"]
    T = 4  # stages [2, 1, 1, 1]; one CiteSeer class is never introduced
    assert s["rounds"] == 2 * T and len(s["stages"]) == T
    assert s["tags"]["task"] == "cir" and s["tags"]["variant"] == "replay"
    assert s["tags"]["method"] == "fedavg" and s["tags"]["dataset"] == "citeseer_mm"
    for key in ("am", "fpr95", "auroc_ood", "open_acc", "recall_at_1", "val_recall_at_1"):
        assert 0.0 <= m[key] <= 1.0, key
    assert -1.0 <= m["fm"] <= 1.0 and -1.0 <= m["fm_diag"] <= 1.0
    assert m["test_acc"] == pytest.approx(m["recall_at_1"])  # both: final known test queries
    M = s["acc_matrix"]
    assert len(M) == T and all(len(row) == T for row in M)
    for t, row in enumerate(M):
        assert all(v is None for v in row[t + 1 :])  # future stages are not measured
        assert all(0.0 <= v <= 1.0 for v in row[: t + 1])
    assert m["am"] == pytest.approx(sum(M[-1]) / T)
    # Recall@1 is pooled over about 50-130 known test queries per client: chance is at most
    # 1/50 (a query against the smallest client's items); learning is three standard errors
    # above it at the smallest pooled query count, 5 x 50 (the synthetic learning test
    # compares with the untrained model: tests/integration/test_learning.py)
    chance, n = 1 / 50, 5 * 50
    assert m["recall_at_1"] > chance + 3 * math.sqrt(chance * (1 - chance) / n)
    assert not math.isnan(m["fpr95"])
    on_disk = json.loads((tmp_env / "run" / "summary.json").read_text())
    assert on_disk["metrics"]["recall_at_1"] == m["recall_at_1"]
    assert (tmp_env / "run" / "acc_matrix.csv").exists()
