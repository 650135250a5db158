"""FedMVP and PRISM as runs: the summary's ledger equals a hand count of their messages, each
learns on the synthetic graph, a killed run resumes bitwise, two Gloo ranks equal the
sequential run, and each runs from its experiment name on CiteSeer-MM and Cora (PRISM
refuses Cora, which has one modality)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedlightning.config import build
from fedlightning.errors import ConfigError
from fedlightning.federation.ledger import unpacked
from fedlightning.programs.graph_program import build_clients, build_model, load_graph
from fedlightning.train import train
from tests.inprocess import runs_once
from tests.integration.test_learning import learned, learned_margin

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 900  # far above the normal time (tens of seconds); only against a hang
RUN = ["logger=none", "runner.progress=false"]
CIL = ["protocol=cil", "protocol.stream.stages=[2,1,1]", "task=cil"]
METHODS = {
    "fedmvp": ["algorithm=cil_fedmvp", "model=fedmvp_gnn", "name=cil_fedmvp_synthetic"],
    "prism": ["algorithm=cil_prism", "model=prism_gnn", "name=cil_prism_synthetic"],
}
SMALL = ["dataset.num_nodes=400", "federation.rounds=1", "federation.local_epochs=1"]
BANK = {  # bank buffer, prototype field prefix, count prefix
    "fedmvp": ("class_text", "text_proto.", "text_count."),
    "prism": ("paired", "paired_proto.", "paired_count."),
}


def expected_uplink(cfg, method: str) -> tuple[int, dict[int, int]]:
    """The uplink by hand: every round, every client sends the model less the bank's two
    buffers, ``num_examples``, and per class of its training nodes (current and replayed)
    that carry the bank's modality one prototype row and one count. Also the number of
    prototypes each client sends."""
    graph = load_graph(cfg)
    partition = build(cfg.partition, "partition")(graph, cfg.federation.clients, cfg.protocol.seed)
    stream = build(cfg.protocol.stream, "protocol.stream")(graph, partition, cfg.protocol.seed)
    clients = build_clients(graph, partition)
    dims = {m: x.size(1) for m, x in graph.features.items()}
    net, alg, _ = build_model(cfg, dims, graph.num_classes)
    alg.setup(stream, cfg.federation.rounds, cfg.seed, graph.num_classes)
    buffer = BANK[method][0]
    state = net.state_dict()
    model = sum(
        v.numel() for k, v in state.items() if k not in (buffer, buffer + "_seen", "class_seen")
    )
    row = state[buffer][0].numel()
    total, sent = 0, {}
    for c in clients:
        if method == "prism":
            alg.make_deficient(c)
        for t in range(stream.num_stages):
            alg.begin_stage(c, t, {})
            batch = alg.batch_at(c, t)
            if method == "fedmvp":
                has = batch.modality_mask[:, net.modalities.index(net.text_modality)]
            else:
                has = batch.modality_mask.all(dim=1)
            m = (batch.sup_mask | batch.replay_mask) & has
            pairs = torch.unique(batch.y[m]).numel()
            sent[c.client_id] = sent.get(c.client_id, 0) + pairs * cfg.federation.rounds
            total += cfg.federation.rounds * (model + 1 + pairs * (row + 1))
    return total, sent


def small(method: str) -> list[str]:
    return [*CIL, *METHODS[method], *SMALL, *RUN]


@pytest.fixture(scope="module")
def sequential(tmp_path_factory, compose):
    """``sequential(method) -> run dir``: the small run of ``method`` in this process, once
    per module, shared by the ledger's hand count and the runs that the resumed and two-rank
    runs must equal."""
    return runs_once(tmp_path_factory, compose, small)


@pytest.mark.parametrize("method", list(METHODS))
def test_ledger_matches_a_hand_count_of_the_message(method, sequential, compose):
    over = small(method)
    run_dir = sequential(method)
    summary = json.loads((run_dir / "summary.json").read_text())
    total, sent = expected_uplink(compose(over), method)
    comm = summary["comm"]
    assert comm["uplink_values"] == total
    buffer, prefix, count_prefix = BANK[method]
    fields = comm["fields"]
    assert fields[f"model.{buffer}"]["up"] == 0 and fields[f"model.{buffer}"]["down"] > 0
    protos = sum(v["up"] for k, v in fields.items() if k.startswith(prefix))
    counts = sum(v["up"] for k, v in fields.items() if k.startswith(count_prefix))
    assert counts == sum(sent.values()) > 0
    row = 64 if method == "fedmvp" else 2 * 64  # hidden; PRISM: one row per modality
    assert protos == counts * row
    if method == "prism":  # the deficient clients send no paired prototype
        from fedlightning.methods.prism.prism import deficient_clients

        cfg = compose(over)
        missing = deficient_clients(5, ["text", "image"], 0.4, cfg.protocol.seed)
        assert len(missing) == 2 and all(sent[k] == 0 for k in missing)
        ledger = torch.load(run_dir / "checkpoint.pt", weights_only=False)["ledger"]
        senders = {
            e[2] for e in unpacked(ledger)["entries"] if e[0] == "up" and e[3].startswith(prefix)
        }
        assert senders.isdisjoint(missing) and senders


@pytest.mark.parametrize("method", list(METHODS))
def test_beats_its_untrained_self(method, tmp_env, compose):
    over = [*CIL, *METHODS[method], "federation.rounds=2", *RUN]
    trained = train(compose(over), tmp_env / "trained", verbose=False)
    untrained = train(
        compose([*over, "federation.rounds=1", "model.optimizer.lr=1e-12"]),
        tmp_env / "untrained",
        verbose=False,
    )
    p0, p1 = learned(untrained), learned(trained)
    assert p1 > p0 + learned_margin(tmp_env / "untrained", untrained), (p0, p1)


def subprocess_env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FEDLIGHTNING_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=cwd, env=subprocess_env(cwd), capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def same_runs(a: Path, b: Path) -> None:
    x = json.loads((a / "summary.json").read_text())
    y = json.loads((b / "summary.json").read_text())
    assert x["metrics"] == y["metrics"] and x["acc_matrix"] == y["acc_matrix"]
    assert x["comm"] == y["comm"] and x["hashes"] == y["hashes"]


@pytest.mark.parametrize("method", list(METHODS))
def test_killed_run_resumes_bitwise(method, tmp_env, sequential):
    """SIGKILL after the second client of round 2, then ``resume=DIR``: bitwise the
    uninterrupted run (the server's bank and the clients' replay memory are checkpointed)."""
    over = small(method)
    fl = str(Path(sys.executable).parent / "fedlightning")
    killed = run([fl, "train", *over, "hydra.run.dir=killed", "runner.kill_at=2:2"], tmp_env)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_env / "killed" / "summary.json").exists()
    resumed = run([fl, "train", "resume=killed", "logger=none"], tmp_env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    same_runs(tmp_env / "killed", sequential(method))
    assert json.loads((tmp_env / "killed" / "summary.json").read_text())["resumed"] is True


@pytest.mark.parametrize("method", list(METHODS))
def test_two_gloo_ranks_equal_the_sequential_run(method, tmp_env, sequential):
    over = small(method)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = run(
        [*cmd, "-m", "fedlightning", "train", *over, "runner=distributed", "hydra.run.dir=d"],
        tmp_env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    same_runs(tmp_env / "d", sequential(method))


@pytest.mark.parametrize(
    "experiment", ["cil_fedmvp_citeseer_mm", "cil_fedmvp_cora", "cil_prism_citeseer_mm"]
)
def test_runs_from_its_experiment_name(experiment, env, compose, shared_data, monkeypatch):
    """The experiment's first two stages (the second learns new classes with replay and the
    bank), one round each; ``env``: each dataset's partition made once."""
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    method, data = experiment.split("_", 2)[1:]  # the recipe cil_<data>, the method apart
    cfg = compose(
        [f"experiment=cil_{data}", f"algorithm=cil_{method}", "federation.rounds=1", *RUN]
    )
    cfg.protocol.stream.stages = list(cfg.protocol.stream.stages)[:2]
    s = train(cfg, env / "r")
    assert s["experiment"] == experiment
    assert len(s["acc_matrix"]) == len(s["stream"]["stages"]) == 2
    for k in ("am", "fm", "fpr95", "auroc_ood"):
        assert math.isfinite(s["metrics"][k]), k
    assert s["comm"]["uplink_values"] > 0


def test_prism_refuses_a_graph_with_one_modality(tmp_env, compose, shared_data, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    over = [
        "experiment=cil_cora",
        "algorithm=cil_fedmvp",
        "algorithm=cil_prism",
        "model=prism_gnn",
        *RUN,
    ]
    with pytest.raises(ConfigError, match="at least two modalities"):
        train(compose(over), tmp_env / "r")
    assert not (tmp_env / "r" / "summary.json").exists()
