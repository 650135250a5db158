"""FedTIP end to end from the real configs: the synthetic stream (fast) and Bitcoin-Alpha."""

import json

import numpy as np
import pytest
import torch

from fedlightning.data.temporal import make_synthetic_stream
from fedlightning.errors import ConfigError, RunStopped
from fedlightning.temporal.adapter import PromptAdapter
from fedlightning.train import train

SMALL = [
    "protocol.tasks.num_tasks=3",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
]


def hand_uplink(run_dir, rounds, d_h, p, families, labels):
    """Float32 values sent up in a run, counted from its tasks.json and the stream labels:
    per client and round, the delta, and per observed class a d_h prototype and a count,
    plus coverage and norm."""
    tasks = json.loads((run_dir / "tasks.json").read_text())["tasks"]
    total = 0
    for t in tasks:
        for events in t["support"].values():
            for fam in families:
                classes = len(set(labels[events].tolist())) if fam == "nc" else 2
                total += rounds * (p + classes * (d_h + 1) + 2)
    return total


def test_fedtip_synthetic_end_to_end_with_the_hand_counted_uplink(env, compose):
    s = train(
        compose(["experiment=temporal_synthetic", "algorithm=fedtip", *SMALL]),
        env / "a",
        verbose=False,
    )
    m = s["metrics"]
    assert s["tasks_done"] == 3 and s["tags"]["task"] == "temporal"
    assert s["tags"]["method"] == "fedtip" and s["tags"]["variant"] == "full"
    per_task = json.loads((env / "a" / "task_metrics.json").read_text())
    assert [r["task"] for r in per_task] == [0, 1, 2]
    # the run's AUCs are the mean and std of the per-task ones (whether FedTIP learns:
    # tests/integration/test_learning.py)
    for k in ("auc_nc", "auc_tlp", "auc_ilp", "val_auc_nc", "val_auc_tlp"):
        values = np.array([r[k] for r in per_task], dtype=np.float64)
        assert not np.isnan(values).any(), k
        assert m[k] == pytest.approx(values.mean()) and m[f"{k}_std"] == pytest.approx(values.std())
    assert m["auc_tlp"] == pytest.approx(sum(r["auc_tlp"] for r in per_task) / 3)
    # the adapter of the stream's widths: d_h = 64, TE 64, 8 edge features
    p = PromptAdapter(64, 64, 8, bottleneck=2, rank=2).num_values()
    stream = make_synthetic_stream(num_events=20000, seed=2026)
    proto_dir = env / "a"
    expected = hand_uplink(proto_dir, 2, 64, p, ["nc", "lp"], stream.label)
    assert s["comm"]["uplink_values"] == expected
    assert m["uplink_mib_per_task"] == pytest.approx(4 * expected / 1024**2 / 3)
    assert s["comm"]["message_values_by_hand"]["lp"] == p + 2 * 65 + 2


def test_a_stopped_protocol_resumes_at_the_next_task(env, compose):
    cfg = compose(["experiment=temporal_synthetic", "algorithm=fedtip", *SMALL])
    straight = train(cfg, env / "straight", verbose=False)

    def stop_after_first(kind, step, metrics):
        assert kind == "task" and "auc_tlp" in metrics
        if step == 1:
            raise RunStopped("stopped after task 1")

    with pytest.raises(RunStopped):
        train(cfg, env / "cut", observe=stop_after_first, verbose=False)
    assert (env / "cut" / "checkpoint.pt").exists()
    # as a user resumes: the saved run's config (its small bank too), not the defaults
    resumed = train(compose([f"resume={env / 'cut'}"]), env / "x", verbose=False)
    assert resumed["resumed"] and resumed["metrics"] == straight["metrics"]
    # a run whose protocol no longer matches (data or code changed) is not resumed
    from fedlightning.errors import FedLightningError

    again = env / "again"
    with pytest.raises(RunStopped):
        train(cfg, again, observe=stop_after_first, verbose=False)
    saved = json.loads((again / "protocol.json").read_text())
    saved["hashes"]["tasks"] = "0" * 16
    (again / "protocol.json").write_text(json.dumps(saved))
    with pytest.raises(FedLightningError, match="refusing to resume"):
        train(
            compose(
                ["experiment=temporal_synthetic", "algorithm=fedtip", *SMALL, f"resume={again}"]
            ),
            env / "y",
        )
    assert resumed["comm"]["uplink_values"] == straight["comm"]["uplink_values"]


def test_comparators_and_ablation_switches_run(env, compose):
    one = [*SMALL, "protocol.tasks.num_tasks=1"]
    central = train(
        compose(["experiment=temporal_synthetic", "algorithm=prompt_central", *one]),
        env / "c",
        verbose=False,
    )
    assert central["tags"]["method"] == "prompt_central" and central["comm"]["uplink_values"] == 0
    assert "uplink_mib_per_task" not in central["metrics"]  # raw support, not a federation
    fedavg = train(
        compose(["experiment=temporal_synthetic", "algorithm=prompt_fedavg", *one]),
        env / "f",
        verbose=False,
    )
    fields = fedavg["comm"]["fields"]
    assert "lp/proto.1" not in fields and "lp/coverage" not in fields and "nc/proto.1" in fields
    ab = train(
        compose(["experiment=temporal_synthetic", "algorithm=fedtip", *one, "+ablation=no_pa_rwa"]),
        env / "a",
        verbose=False,
    )
    assert ab["tags"]["variant"] == "no_pa_rwa"
    assert not any(k.startswith(("nc/anchor", "lp/anchor")) for k in ab["comm"]["fields"])


def test_bad_fedtip_input_fails_before_training(env, compose):
    with pytest.raises(ConfigError, match="families"):
        train(
            compose(
                ["experiment=temporal_synthetic", "algorithm=fedtip", *SMALL, "families=[nc,xx]"]
            ),
            env / "a",
        )
    with pytest.raises(ConfigError, match="algorithm.aggregation"):
        train(
            compose(
                [
                    "experiment=temporal_synthetic",
                    "algorithm=fedtip",
                    *SMALL,
                    "algorithm.aggregation=mean",
                ]
            ),
            env / "b",
        )
    assert not (env / "a" / "config.yaml").exists() and not (env / "b").exists()  # no run began


def test_fedtip_logs_every_task_to_mlflow(env, compose):
    from mlflow.tracking import MlflowClient

    over = [o for o in SMALL if o != "logger=none"]
    cfg = compose(["experiment=temporal_synthetic", "algorithm=fedtip", *over, "plots=true"])
    s = train(cfg, env / "a", verbose=False)
    client = MlflowClient(cfg.logger.tracking_uri)
    run_id = json.loads((env / "a" / "mlflow_run.json").read_text())["run_id"]
    history = client.get_metric_history(run_id, "curves/auc_tlp")
    assert [h.step for h in history] == [1, 2, 3]
    run = client.get_run(run_id)
    assert run.data.metrics["final/auc_tlp"] == pytest.approx(s["metrics"]["auc_tlp"])
    assert run.data.tags["hash_tasks"] == s["hashes"]["tasks"]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.json", "task_metrics.json", "task_auc.png", "tasks.json"} <= artifacts


@pytest.mark.slow
def test_fedtip_on_bitcoin_alpha(env, compose, shared_data, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    over = [
        "experiment=temporal_bitcoin_alpha",
        "algorithm=fedtip",
        *SMALL[:-2],
        "bank.max_events=3000",
        "logger=none",
    ]
    s = train(compose(over), env / "btc", verbose=False)
    assert s["table"]["events"] == 24_186 and s["families"] == ["nc", "lp"]
    m = s["metrics"]
    assert not any(np.isnan(m[k]) for k in ("auc_nc", "auc_tlp", "auc_ilp"))
    # no edge features reach the adapter: the rating would give the label away
    p = PromptAdapter(64, 64, 0).num_values()
    assert s["comm"]["adapter_values"] == p
    saved = torch.load(s["bank"]["path"], weights_only=False)
    assert saved["hash"] == s["hashes"]["bank"]


def test_fulltune_fedavg_sends_the_whole_model_and_tunes_the_encoder(env, compose):
    from fedlightning.temporal.contexts import fork, load_bank, restore_state

    over = [
        "experiment=temporal_synthetic",
        "algorithm=fulltune_fedavg",
        "max_tasks=3",
        *SMALL,
        "protocol.tasks.num_tasks=1",
    ]
    s = train(compose([*over, "families=[lp]"]), env / "f", verbose=False)
    stream = make_synthetic_stream(num_events=20000, seed=2026)
    enc = load_bank(s["bank"]["path"], stream)
    encoder_values = sum(p.numel() for p in enc.parameters())
    p = PromptAdapter(64, 64, 8).num_values()
    # link prediction: the whole model's delta and the two counts, nothing else
    assert s["comm"]["message_values"]["lp"] == encoder_values + p + 2
    fields = s["comm"]["fields"]
    assert fields["lp/count.1"]["up"] * (encoder_values + p) == fields["lp/delta"]["up"]
    assert set(s["comm"]["fields"]) == {"bank", "lp/count.0", "lp/count.1", "lp/delta", "lp/model"}
    assert s["tags"]["method"] == "fulltune_fedavg" and 0.0 <= s["metrics"]["auc_tlp"] <= 1.0
    # restoring a streamed copy gives back the snapshot's state exactly
    twin = fork(enc)
    twin.ingest(*(torch.tensor([0, 1]), torch.tensor([200, 201]), torch.tensor([10**6] * 2)),
                torch.zeros(2, 8), torch.tensor([0, 1]))  # fmt: skip
    assert not torch.equal(twin.state.last_time, enc.state.last_time)
    restore_state(twin, enc)
    assert all(torch.equal(a, b) for a, b in zip(twin.buffers(), enc.buffers(), strict=True))
    assert torch.equal(twin.state.loader.e_id, enc.state.loader.e_id)
    # a local fit streams in evaluation mode (the kind of states the server scores) and
    # still sends gradients into the encoder
    from fedlightning.methods.fulltune.fulltune_client import FullTuneClient

    client = FullTuneClient(fork(enc), enc, PromptAdapter(64, 64, 8), stream, "lp")
    client.train()
    assert client.adapter.training and not client.encoder.training
    ev = torch.arange(15000, 15006)
    batch = {
        "events": ev,
        "neg_id": torch.from_numpy(stream.dst[(ev + 7).numpy()]),
        "x": torch.from_numpy(stream.msg[ev.numpy()]),
        "y": torch.from_numpy(stream.label[ev.numpy()]),
        "neg_ok": torch.ones(6, dtype=torch.bool),
    }
    client.training_step(batch, 0).backward()
    grads = [p.grad for p in client.encoder.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)


def test_a_fedtip_grid_sweep_reads_the_task_mean(tmp_path, monkeypatch):
    from fedlightning.sweeps import Sweep, load_spec
    from tests.conftest import compose_cfg

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(tmp_path / "cache"))
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(
        "experiment: temporal_synthetic\n"
        "space:\n  algorithm.lambda_a: {type: categorical, choices: [0.0, 1.0]}\n"
        "objective: {metric: val_auc_tlp, direction: maximize}\n"
        "seeds: [2026]\nsampler: {name: grid, seed: 0}\n"
    )
    spec = load_spec(spec_file)
    spec.storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = Sweep(
        spec, tmp_path / "out", SMALL, compose_cfg, lambda c, d, o: train(c, d, o, verbose=False)
    ).run()
    values = {t.params["algorithm.lambda_a"]: t.value for t in study.trials}
    assert set(values) == {0.0, 1.0}
    for t in study.trials:  # each trial's value is its run's validation task mean
        run = tmp_path / "out" / "s" / f"trial_{t.number}" / "seed_2026" / "summary.json"
        assert t.value == pytest.approx(json.loads(run.read_text())["metrics"]["val_auc_tlp"])
        assert sorted(t.intermediate_values) == [1, 2, 3]  # reported after every task
