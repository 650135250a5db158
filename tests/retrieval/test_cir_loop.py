"""RetrievalEvaluation's stage-end evaluation against a brute-force recomputation.

A tiny synthetic run (3 clients, stages [2, 1, 1] of 5 classes, modalities text -> image
with 10% missing) goes through ``fedlightning.train.train``; the final global model is read
back from the checkpoint and every number of the last stage is recomputed by hand: pair by
pair cosine similarities, ranks, thresholds.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedlightning.config import build
from fedlightning.data.partition import Partition
from fedlightning.data.streams import ClassStream
from fedlightning.programs.graph_program import build_clients, load_graph
from fedlightning.train import train

OVERRIDES = [
    "protocol=cil",
    "protocol.stream.stages=[2,1,1]",
    "model=retrieval_gnn",
    "model.net.item=image",
    "model.net.hidden=16",
    "algorithm=cir_fedavg_replay",
    "dataset.num_nodes=300",
    "federation.clients=3",
    "federation.rounds=2",
    "task=cir",
    "name=cir_tiny",
    "logger=none",
    "runner.progress=false",
]


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(a @ b / (a.norm() * b.norm()))


def brute_force(q, k, queries, items):
    """hit[i]: query i's own item is strictly above every other item; score: max cosine."""
    hits, known_scores, unknown_scores = [], [], []
    for i in queries:
        sims = {j: cos(q[i], k[j]) for j in items}
        if i in items:
            own = sims[i]
            hits.append(all(own > s for j, s in sims.items() if j != i))
            known_scores.append(max(sims.values()))
        else:
            unknown_scores.append(max(sims.values()))
    return hits, known_scores, unknown_scores


def threshold(scores, tpr=0.95):
    s = sorted(scores, reverse=True)
    return s[max(1, math.ceil(round(tpr * len(s), 6))) - 1]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, compose):
    """One tiny run and its final state rebuilt from the run directory."""
    tmp = tmp_path_factory.mktemp("cir")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        mp.setenv("FEDLIGHTNING_CACHE", str(tmp / "cache"))
        cfg = compose(OVERRIDES)
        run_dir = tmp / "run"
        summary = train(cfg, run_dir)
        graph = load_graph(cfg)
    partition = Partition.load(run_dir / "partition.json")
    stream = ClassStream.load(run_dir / "stream.json")
    clients = build_clients(graph, partition)
    in_dims = {m: x.size(1) for m, x in graph.features.items()}
    net = build(cfg.model.net, "model.net")(in_dims=in_dims, num_classes=graph.num_classes)
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    net.load_state_dict(ckpt["server"]["global_state"])
    net.eval()
    return summary, stream, clients, net, graph.num_classes


def final_stage_by_hand(stream, clients, net, num_classes, split):
    """Per client: {stage: [hits]}, known scores, unknown scores of the last stage."""
    t = stream.num_stages - 1
    known = set(stream.known(t))
    class_stage = {c: s for s, cls in enumerate(stream.stages) for c in cls}
    out = []
    with torch.no_grad():
        for c in clients:
            d = c.data
            q, k = net(d)
            mask = d.modality_mask  # columns: text, image
            nodes = d[f"{split}_mask"].nonzero().flatten().tolist()
            items = [i for i in nodes if int(d.y[i]) in known and mask[i, 0] and mask[i, 1]]
            unknown = [i for i in nodes if int(d.y[i]) not in known and mask[i, 0]]
            hits, ks, us = brute_force(q, k, items + unknown, set(items))
            per_stage: dict[int, list[bool]] = {}
            for i, h in zip(items, hits, strict=True):
                per_stage.setdefault(class_stage[int(d.y[i])], []).append(h)
            out.append((per_stage, hits, ks, us))
    return out


def test_stage_metrics_match_brute_force(tiny_run):
    summary, stream, clients, net, num_classes = tiny_run
    T = stream.num_stages
    assert stream.never, "the setup needs a never-introduced class for FPR95"
    test = final_stage_by_hand(stream, clients, net, num_classes, "test")
    val = final_stage_by_hand(stream, clients, net, num_classes, "val")

    # accuracy-matrix row T-1: Recall@1 per introducing stage, pooled over clients
    for split, res, key in (("test", test, "acc_matrix"), ("val", val, "val_acc_matrix")):
        row = summary[key][T - 1]
        for j in range(T):
            hits = [h for per_stage, *_ in res for h in per_stage.get(j, [])]
            assert row[j] == pytest.approx(sum(hits) / len(hits), abs=1e-12), (split, j)
    # per-client rows
    for c, (per_stage, *_) in zip(clients, test, strict=True):
        row = summary["client_acc_matrices"][str(c.client_id)][T - 1]
        for j in range(T):
            if j in per_stage:
                assert row[j] == pytest.approx(sum(per_stage[j]) / len(per_stage[j]))
            else:
                assert row[j] is None

    m, last = summary["metrics"], summary["stages"][-1]
    all_hits = [h for _, hits, _, _ in test for h in hits]
    assert m["recall_at_1"] == pytest.approx(sum(all_hits) / len(all_hits), abs=1e-12)
    assert m["test_acc"] == pytest.approx(m["recall_at_1"], abs=1e-12)  # same queries
    val_hits = [h for _, hits, _, _ in val for h in hits]
    assert m["val_recall_at_1"] == pytest.approx(sum(val_hits) / len(val_hits), abs=1e-12)
    assert m["am"] == pytest.approx(sum(summary["acc_matrix"][T - 1]) / T)

    # open world: delta on val knowns, FPR95 and AUROC on test
    ks = [s for *_, k_, _ in test for s in k_]
    us = [s for *_, u_ in test for s in u_]
    vks = [s for *_, k_, _ in val for s in k_]
    vus = [s for *_, u_ in val for s in u_]
    assert us and vus
    delta = threshold(vks)
    assert last["threshold"] == pytest.approx(delta, abs=1e-5)
    t_test = threshold(ks)
    assert m["fpr95"] == pytest.approx(sum(u >= t_test for u in us) / len(us), abs=1e-9)
    assert m["val_fpr95"] == pytest.approx(sum(u >= threshold(vks) for u in vus) / len(vus))
    pairs = [(a, b) for a in ks for b in us]
    auroc = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)
    assert m["auroc_ood"] == pytest.approx(auroc, abs=1e-4)
    right = sum(h and s >= delta for h, s in zip(all_hits, ks, strict=True))
    right += sum(u < delta for u in us)
    assert m["open_acc"] == pytest.approx(right / (len(ks) + len(us)), abs=1e-9)


def test_summary_shape_and_tags(tiny_run):
    summary = tiny_run[0]
    T = tiny_run[1].num_stages
    assert summary["rounds"] == 2 * T and len(summary["stages"]) == T
    assert summary["tags"]["task"] == "cir" and summary["tags"]["backbone"] == "gcn"
    assert all(k not in summary["metrics"] for k in ("d_sem", "d_str", "d_fed"))
    for key in ("am", "fm", "fm_diag", "fpr95", "auroc_ood", "open_acc", "recall_at_1"):
        v = summary["metrics"][key]
        assert (0.0 <= v <= 1.0) if key not in ("fm", "fm_diag") else (-1.0 <= v <= 1.0), key
