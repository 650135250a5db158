"""The class-incremental open-world protocol end to end, checked against recomputation."""

import csv
import json
import statistics

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fedlightning.data.partition import Partition
from fedlightning.data.streams import ClassStream
from fedlightning.programs.graph_program import build_clients, load_graph
from fedlightning.train import train

pytestmark = pytest.mark.slow


def test_stage_metrics_match_a_recomputation_from_the_final_model(tmp_env, compose):
    over = [
        "protocol=cil",
        "algorithm=cil_fedavg_replay",
        "protocol.stream.stages=[2,1,1]",
        "federation.rounds=3",
        "logger=none",
        "task=cil",
        "plots=true",
    ]
    run = tmp_env / "run"
    s = train(compose(over), run)
    cfg = OmegaConf.load(run / "config.yaml")
    graph = load_graph(cfg)
    part, stream = Partition.load(run / "partition.json"), ClassStream.load(run / "stream.json")
    assert s["hashes"] == {"partition": part.hash, "stream": stream.hash}
    net = instantiate(cfg.model.net)(
        in_dims={m: x.size(1) for m, x in graph.features.items()}, num_classes=graph.num_classes
    )
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    net.load_state_dict(ckpt["server"]["global_state"])
    net.eval()
    known = torch.tensor(stream.known(2))
    cstage = stream.class_stage(graph.num_classes)
    correct, total = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    k_scores, u_scores = [], []
    for c in build_clients(graph, part):
        with torch.no_grad():
            logits = net(c.data)
        probs = torch.softmax(logits[:, known], -1)
        pred = known[probs.argmax(-1)]
        m = c.data.test_mask
        for node in m.nonzero().squeeze(1).tolist():
            j = int(cstage[c.data.y[node]])
            if j >= 0:
                total[j] += 1
                correct[j] += float(pred[node] == c.data.y[node])
                k_scores.append(float(probs[node].max()))
            else:
                u_scores.append(float(probs[node].max()))
    assert s["acc_matrix"][-1] == pytest.approx((correct / total).tolist(), abs=1e-9)
    am = float((correct / total).mean())
    assert s["metrics"]["am"] == pytest.approx(am, abs=1e-9)
    # FPR95 by brute force: the largest threshold accepting >= 95% of known test nodes
    ks = sorted(k_scores, reverse=True)
    thr = ks[int(torch.tensor(0.95 * len(ks)).ceil()) - 1]
    fpr = sum(u >= thr for u in u_scores) / len(u_scores)
    assert s["metrics"]["fpr95"] == pytest.approx(fpr, abs=1e-9)
    scores = torch.load(run / "test_scores.pt", weights_only=False)
    assert len(scores) == 3  # one record per stage: every test node's MSP score
    last = scores[-1]
    assert sorted(last["score"][last["known"]].tolist()) == pytest.approx(sorted(k_scores))
    assert sorted(last["score"][~last["known"]].tolist()) == pytest.approx(sorted(u_scores))
    # the matrix is lower-triangular: stage j's classes are unseen before stage j
    assert s["acc_matrix"][0][1] is None and s["acc_matrix"][1][2] is None
    assert len(s["stages"]) == 3 and (run / "acc_matrix.csv").exists()
    assert (run / "acc_matrix.png").exists() and (run / "seen_acc.png").exists()
    for k in (
        "am",
        "fm",
        "fm_diag",
        "fpr95",
        "auroc_ood",
        "open_acc",
        "val_am",
        "val_fm",
        "val_fpr95",
        "d_sem",
        "d_str",
        "d_fed",
        "d_fed_local",
        "d_fed_local_std",
    ):
        assert k in s["metrics"], k
    # Fig. 3: every stage's client-by-class terms of Eq. (4), in the summary and the CSV, and
    # the scalars recomputed from the last stage's
    terms = s["prototype_terms"]
    assert len(terms) == 3
    with (run / "d_fed_terms.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sum(map(len, terms))
    assert [float(r["discrepancy"]) for r in rows[-len(terms[-1]) :]] == pytest.approx(
        [v for _, _, v in terms[-1]], abs=1e-6
    )
    last = terms[-1]
    assert {cl for cl, _, _ in last} <= set(stream.known(2))
    assert {k for _, k, _ in last} <= {c.client_id for c in build_clients(graph, part)}
    by_class = {cl: [v for c2, _, v in last if c2 == cl] for cl, _, _ in last}
    by_client = {k: [v for _, k2, v in last if k2 == k] for _, k, _ in last}
    class_means = [statistics.fmean(v) for v in by_class.values()]
    m = s["metrics"]
    assert m["d_fed_local"] == pytest.approx(statistics.fmean(class_means), abs=1e-12)
    assert m["d_fed_local_std"] == pytest.approx(statistics.pstdev(v for _, _, v in last))
    assert m["d_fed_local_class_std"] == pytest.approx(statistics.pstdev(class_means))
    assert m["d_fed_local_client_std"] == pytest.approx(
        statistics.pstdev(statistics.fmean(v) for v in by_client.values())
    )
    assert (run / "d_fed_terms.png").exists()


def test_replay_reduces_forgetting_on_cora(tmp_env, compose, shared_data, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    short = ["logger=none", "federation.rounds=5"]  # per stage; 3 rounds do not learn enough
    no_replay = train(
        compose(["experiment=cil_cora", "algorithm=cil_fedavg", *short]), tmp_env / "a"
    )
    replay = train(
        compose(["experiment=cil_cora", "algorithm=cil_fedavg_replay", *short]), tmp_env / "b"
    )
    assert no_replay["hashes"] == replay["hashes"]  # same protocol, different method
    assert no_replay["metrics"]["fm"] > 0.3  # catastrophic forgetting without replay
    assert replay["metrics"]["fm"] < no_replay["metrics"]["fm"] - 0.1
    assert replay["metrics"]["am"] > no_replay["metrics"]["am"]
    summary = json.loads((tmp_env / "b" / "summary.json").read_text())
    assert summary["tags"]["task"] == "cil" and summary["tags"]["variant"] == "replay"


def test_same_seed_same_stream_and_metrics(tmp_env, compose, shared_data, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    over = ["experiment=cil_cora", "algorithm=cil_fedlwf", "federation.rounds=2", "logger=none"]
    a = train(compose(over), tmp_env / "a")
    b = train(compose(over), tmp_env / "b")
    assert a["hashes"] == b["hashes"] and a["metrics"] == b["metrics"]
    c = train(compose([*over, "seed=1"]), tmp_env / "c")
    assert c["hashes"] == a["hashes"]


def test_missing_modalities_reach_the_model(tmp_env, compose, shared_data, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    cfg = compose(
        ["experiment=cil_citeseer_mm", "algorithm=cil_fedavg", "+dataset.missing_rate=0.3"]
    )
    g = load_graph(cfg)
    hidden = (~g.mask).float().mean(0)
    # each modality hidden for r - r^2/2 = 0.255 of nodes (a node keeps at least one)
    assert torch.allclose(hidden, torch.full((2,), 0.255), atol=0.03)
    assert bool(g.mask.any(1).all())
    assert torch.equal(
        g.features["text"][~g.mask[:, 0]], torch.zeros(int((~g.mask[:, 0]).sum()), 384)
    )
