"""Real configs, composed as the CLI composes them, run end to end in-process."""

import json

import pytest
import torch

from fedlightning.train import train

pytestmark = pytest.mark.slow
SYN = [
    "experiment=fl_synthetic",
    "algorithm=fedavg",
]  # the smallest FedAvg run (the default is FedOGL)


def cora_model_values(classes=7, bow=1433, h=64, modalities=1):
    """Hand count of MultimodalGNN's parameters (no buffers) for one modality."""
    encoder = bow * h + h
    gcn = 2 * (h * h + h)  # two GCNConv layers: weight + bias
    project = (2 * h + modalities) * h + h
    head = h * classes + classes
    return encoder + gcn + project + head


def test_fedavg_cora_accuracy_uplink_and_repeatability(tmp_env, shared_data, monkeypatch, compose):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    cfg = compose(["experiment=fl_cora", "algorithm=fedavg", "federation.rounds=20", "logger=none"])
    s1 = train(cfg, tmp_env / "run1")
    # federated 2-layer GCN on Cora, 5 Louvain clients, 60/20/20: about 0.75 or more
    assert s1["metrics"]["test_acc"] >= 0.75
    values = cora_model_values() + 1  # + the num_examples scalar (the loss stays on the client)
    assert s1["comm"]["uplink_values"] == values * 5 * 20
    assert s1["comm"]["uplink_mib"] == pytest.approx(values * 5 * 20 * 4 / 2**20)
    assert s1["comm"]["fields"]["num_examples"] == {"up": 100, "down": 0}
    assert "train_loss" not in s1["comm"]["fields"] and "train_loss" not in s1["metrics"]
    s2 = train(
        compose(["experiment=fl_cora", "algorithm=fedavg", "federation.rounds=20", "logger=none"]),
        tmp_env / "run2",
    )
    assert s1["metrics"] == s2["metrics"] and s1["hashes"] == s2["hashes"]
    on_disk = json.loads((tmp_env / "run1" / "summary.json").read_text())
    assert on_disk["metrics"]["test_acc"] == s1["metrics"]["test_acc"]
    for key in ("metrics", "comm", "hashes", "wall_time_s", "seed", "experiment"):
        assert key in on_disk
    assert on_disk["experiment"] == "fedavg_cora"


def test_fedprox_citeseer_mm_two_modalities(tmp_env, shared_data, monkeypatch, compose):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    s = train(
        compose(
            ["experiment=fl_citeseer_mm", "algorithm=fedprox", "federation.rounds=3", "logger=none"]
        ),
        tmp_env / "run",
    )
    assert s["tags"]["dataset"] == "citeseer_mm" and s["tags"]["method"] == "fedprox"
    assert 0.3 < s["metrics"]["test_acc"] <= 1.0  # 6 classes: well above chance after 3 rounds
    fields = s["comm"]["fields"]
    assert "model.net.encoders.encoders.text.weight" not in fields  # fields are the net's keys
    assert fields["model.encoders.encoders.text.weight"]["up"] == 384 * 64 * 5 * 3
    assert fields["model.encoders.encoders.bow.weight"]["up"] == 3703 * 64 * 5 * 3


def test_seed_changes_training_but_not_protocol_hash(tmp_env, compose):
    a = train(compose([*SYN, "federation.rounds=2", "logger=none", "seed=1"]), tmp_env / "a")
    b = train(compose([*SYN, "federation.rounds=2", "logger=none", "seed=2"]), tmp_env / "b")
    assert a["hashes"] == b["hashes"]
    assert a["metrics"]["train_acc"] != b["metrics"]["train_acc"]
    c = train(
        compose([*SYN, "federation.rounds=2", "logger=none", "protocol.seed=5"]), tmp_env / "c"
    )
    assert c["hashes"]["partition"] != a["hashes"]["partition"]


def test_partial_participation_counts_only_sampled_clients(tmp_env, compose):
    s = train(
        compose([*SYN, "federation.rounds=3", "federation.participation=0.4", "logger=none"]),
        tmp_env / "p",
    )
    per_round = s["comm"]["per_round"]
    one = per_round["1"]["up"] // 2  # 2 of 5 clients sampled each round
    assert all(v["up"] == 2 * one for v in per_round.values())


def test_trainer_executor_matches_lean(tmp_env, compose):
    loss = "federation.report_train_loss=true"  # the clients send their loss: one more scalar
    lean = train(compose([*SYN, "federation.rounds=2", "logger=none", loss]), tmp_env / "l")
    full = train(
        compose([*SYN, "federation.rounds=2", "logger=none", "runner=sequential_trainer", loss]),
        tmp_env / "t",
    )
    assert lean["comm"]["fields"]["train_loss"]["up"] == 2 * 5
    assert full["metrics"]["test_acc"] == pytest.approx(lean["metrics"]["test_acc"], abs=1e-9)
    assert full["metrics"]["train_loss"] == pytest.approx(lean["metrics"]["train_loss"], rel=1e-5)


def test_refuses_to_overwrite_a_run(tmp_env, compose):
    from fedlightning.errors import FedLightningError

    train(compose([*SYN, "federation.rounds=1", "logger=none"]), tmp_env / "r")
    with pytest.raises(FedLightningError, match="refusing to overwrite"):
        train(compose([*SYN, "federation.rounds=1", "logger=none"]), tmp_env / "r")
    assert torch.load(tmp_env / "r" / "checkpoint.pt", weights_only=False)["completed_rounds"] == 1
