"""The real CiteSeer-MM retrieval experiment, composed as the CLI composes it, end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedlightning.config import build
from fedlightning.programs.graph_program import build_clients, load_graph
from fedlightning.train import train


def queries_per_client(cfg) -> list[int]:
    """Each client's Recall@1 queries after the last stage (its known-class test nodes with
    both modalities; they are also its candidate items), rebuilt from the run's config."""
    graph = load_graph(cfg)
    partition = build(cfg.partition, "partition")(graph, cfg.federation.clients, cfg.protocol.seed)
    stream = build(cfg.protocol.stream, "protocol.stream")(graph, partition, cfg.protocol.seed)
    known = torch.tensor(stream.known(stream.num_stages - 1))
    counts = []
    for c in build_clients(graph, partition):
        d = c.data
        counts.append(int((d.test_mask & torch.isin(d.y, known) & d.modality_mask.all(1)).sum()))
    return [n for n in counts if n]


@pytest.mark.slow
def test_cir_fedavg_replay_citeseer_mm_end_to_end(tmp_env, shared_data, monkeypatch, compose):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    cfg = compose(
        [
            "experiment=cir_citeseer_mm",
            "algorithm=cir_fedavg_replay",
            "federation.rounds=2",
            "logger=none",
        ]
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
    # Recall@1 pools each client's queries against its own items: a random ranking hits
    # 1/n_k of client k's n_k queries, one hit per client, so chance is K / N, with
    # variance sum_k (1 - 1/n_k) / N^2; the run must be three standard errors above it (the
    # synthetic learning test compares with the untrained model instead)
    n = queries_per_client(cfg)
    N = sum(n)
    assert abs(m["recall_at_1"] * N - round(m["recall_at_1"] * N)) < 1e-6  # N queries scored
    chance, se = len(n) / N, math.sqrt(sum(1 - 1 / k for k in n)) / N
    assert m["recall_at_1"] > chance + 3 * se, (m["recall_at_1"], chance, se)
    assert not math.isnan(m["fpr95"])
    on_disk = json.loads((tmp_env / "run" / "summary.json").read_text())
    assert on_disk["metrics"]["recall_at_1"] == m["recall_at_1"]
    assert (tmp_env / "run" / "acc_matrix.csv").exists()
