"""DyGPrompt's two Table 3 rows end to end from their configs on the synthetic stream (small):
the centralised row sends nothing, the direct FedAvg row's uplink is DyGPrompt's parameters
counted by hand from the run's tasks, and both score the same tasks as FedTIP."""

import json

import numpy as np
import pytest

from fedlightning.data.temporal import make_synthetic_stream
from fedlightning.methods.dygprompt.dygprompt_model import DyGPromptModule
from fedlightning.train import train

SMALL = [
    "experiment=temporal_synthetic",
    "protocol.tasks.num_tasks=2",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
]


def hand_uplink(run_dir, rounds: int, d_h: int, p: int, labels: np.ndarray) -> int:
    """Per client, round and family: the delta (p values) and a count per observed class,
    plus a d_h-wide prototype per observed state label for node classification."""
    tasks = json.loads((run_dir / "tasks.json").read_text())["tasks"]
    total = 0
    for t in tasks:
        for events in t["support"].values():
            classes = len(set(labels[events].tolist()))
            total += rounds * ((p + classes * (d_h + 1)) + (p + 2))
    return total


def test_dygprompt_central_and_fedavg_run_on_the_synthetic_stream(env, compose):
    fedavg = train(compose([*SMALL, "algorithm=dygprompt_fedavg"]), env / "f", verbose=False)
    central = train(compose([*SMALL, "algorithm=dygprompt_central"]), env / "c", verbose=False)
    for s, name in ((fedavg, "dygprompt_fedavg"), (central, "dygprompt_central")):
        assert s["tasks_done"] == 2 and s["tags"]["method"] == name
        assert s["tags"]["backbone"] == "tgn" and s["families"] == ["nc", "lp"]
        for k in ("auc_nc", "auc_tlp", "auc_ilp", "val_auc_nc", "val_auc_tlp"):
            assert 0.0 <= s["metrics"][k] <= 1.0, (name, k)
    # the same tasks as FedTIP's (the protocol's hashes)
    assert {k: v for k, v in fedavg["tags"].items() if k.startswith("hash_")} == {
        k: v for k, v in central["tags"].items() if k.startswith("hash_")
    }
    assert central["comm"]["uplink_values"] == 0
    assert "uplink_mib_per_task" not in central["metrics"]  # raw support, not a federation
    p = DyGPromptModule(64, 64, bottleneck=16).num_values()  # the stream's d_h = TE = 64
    assert fedavg["comm"]["adapter_values"] == p == 4384
    labels = make_synthetic_stream(num_events=20000, seed=2026).label
    assert fedavg["comm"]["uplink_values"] == hand_uplink(env / "f", 2, 64, p, labels)
    fields = fedavg["comm"]["fields"]
    assert "nc/proto.1" in fields and "lp/proto.1" not in fields
    assert not any(k.endswith(("coverage", "norm")) or "anchor" in k for k in fields)
    assert fedavg["comm"]["message_values"]["lp"] == p + 2


@pytest.mark.slow
def test_dygprompt_runs_on_the_tgat_bank(env, compose):
    s = train(
        compose([*SMALL, "algorithm=dygprompt_fedavg", "bank=tgat", "protocol.tasks.num_tasks=1"]),
        env / "t",
        verbose=False,
    )
    assert s["tags"]["backbone"] == "tgat" and 0.0 <= s["metrics"]["auc_tlp"] <= 1.0
