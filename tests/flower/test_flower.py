"""runner=flower: our messages as Flower records, a Flower simulation and a loopback deployment
(SuperLink + one SuperNode per client) that give bitwise the sequential run's metrics, send
only the declared fields, and fail clearly and resume when a SuperNode dies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, MetricRecord, RecordDict  # noqa: E402

from fedlightning.errors import ConfigError  # noqa: E402
from fedlightning.federation.executors import LeanExecutor  # noqa: E402
from fedlightning.flower.records import (  # noqa: E402
    content_fields,
    message_records,
    records_update,
)
from fedlightning.flower.runner import FlowerRunner  # noqa: E402
from fedlightning.messages import ClientUpdate  # noqa: E402
from fedlightning.train import train  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
K = 2  # clients: one SuperNode each
CORA = [
    "experiment=fl_cora",
    "algorithm=fedavg",
    "federation.rounds=2",
    f"federation.clients={K}",
    "logger=none",
]
UPDATE_SCALARS = {"num_examples"}  # the loss stays on the client (federation.report_train_loss)
# Waits on other processes: hang guards far above the normal time (a deployment's run takes
# about a minute on an idle machine), so a loaded machine never fails a test by its clock;
# the nodes' set-up (imports, data) gets as long.
HANG_GUARD_S = 1800
CONNECT_S = 600
COUNT_FIELDS = {f"{s}_{c}" for s in ("train", "val", "test") for c in ("correct", "total")}


# ---------------------------------------------------------------------------- records
def test_records_round_trip_bitwise_with_dtypes_and_sizes():
    torch.manual_seed(0)
    update = ClientUpdate(
        round=3,
        client_id=2,
        tensors={"model.w": torch.randn(3, 4), "model.steps": torch.tensor(7)},
        scalars={"num_examples": 10.0, "train_loss": 0.1234567890123},
    )
    content = message_records(update)
    back = records_update(content, 3, 2)
    assert back.round == 3 and back.client_id == 2 and back.scalars == update.scalars
    assert list(back.tensors) == ["model.w", "model.steps"]
    for k, t in update.tensors.items():
        assert back.tensors[k].dtype == t.dtype and torch.equal(back.tensors[k], t)
    assert back.field_sizes() == update.field_sizes()  # the ledger counts it the same
    # 12 float32 (48 bytes) and one int64; each scalar one 8-byte number on the wire
    assert content_fields(content) == {
        "tensors": {"model.w": [12, 48], "model.steps": [1, 8]},
        "scalars": {"num_examples": [1, 8], "train_loss": [1, 8]},
    }


def test_an_undeclared_record_is_refused():
    content = message_records(ClientUpdate(round=1, client_id=0, scalars={"num_examples": 1.0}))
    content["extra"] = ConfigRecord({"raw_features": "..."})
    with pytest.raises(ValueError, match=r"client 0 sent undeclared records \['extra'\]"):
        records_update(content, 1, 0)
    assert isinstance(message_records(ClientUpdate(round=1))["scalars"], MetricRecord)
    assert isinstance(content, RecordDict)


def test_runner_flower_alone_says_how_to_start_it(tmp_env, compose):
    with pytest.raises(ConfigError, match="fedlightning flower-sim"):
        FlowerRunner(LeanExecutor())
    with pytest.raises(ConfigError, match="runner=flower runs inside a Flower ServerApp"):
        train(
            compose(
                ["experiment=fl_synthetic", "algorithm=fedavg", "runner=flower", "logger=none"]
            ),
            "r",
        )


def test_the_bank_is_refused_before_anything_runs(tmp_env):
    from fedlightning.flower.apps import simulate

    with pytest.raises(ConfigError, match="task=bank .* pre-trains the bank centrally"):
        simulate(["experiment=bank_synthetic", "bank=tgn"], tmp_env / "bank")
    assert not (tmp_env / "bank").exists()


# Every schedule at a small setting: class-incremental FedOGL (stage-end basis exchange),
# cross-modal retrieval FedOGL, and FedTIP (stacked task fits, one node per client).
FEDTIP = [
    "experiment=temporal_synthetic",
    "algorithm=fedtip",
    f"protocol.ownership.clients={K}",
    f"protocol.tasks.active={K}",
    "federation.rounds=1",  # each round a ClientApp process per node and message
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
]
SCHEDULES = {
    "cil_fedogl_cora": [
        "experiment=cil_cora",
        "algorithm=fedogl",
        "federation.rounds=1",
        f"federation.clients={K}",
        "protocol.stream.stages=[2,2]",
    ],
    "cir_fedogl_citeseer_mm": [
        "experiment=cir_citeseer_mm",
        "algorithm=cir_fedogl",
        "federation.rounds=1",
        f"federation.clients={K}",
        "protocol.stream.stages=[2,2]",
    ],
    "fedtip_synthetic": [*FEDTIP, "protocol.tasks.num_tasks=2"],
    # the worked example of "Adding a method": control variates on the nodes, c on the server
    "scaffold_synthetic": [
        "experiment=fl_synthetic",
        "algorithm=scaffold",
        "federation.rounds=2",
        f"federation.clients={K}",
    ],
    # and class-incremental: the same method folder and config, c_i carried on the nodes
    "scaffold_cil_cora": [
        "experiment=cil_cora",
        "algorithm=scaffold",
        "federation.rounds=1",
        f"federation.clients={K}",
        "protocol.stream.stages=[2,2]",
    ],
}
# a deployment starts a process per message: FedTIP's schedule there at one task
RUNS = {**SCHEDULES, "fedtip_one_task": [*FEDTIP, "protocol.tasks.num_tasks=1"]}


class References(dict):
    """The in-process sequential run of each schedule, run when first asked for, sharing
    one cache with the Flower runs (the bank is built once)."""

    def __init__(self, root: Path, shared_data: Path) -> None:
        super().__init__()
        self.root, self.data = root, shared_data

    def __missing__(self, name: str) -> dict:
        from fedlightning.config import compose

        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FEDLIGHTNING_DATA", str(self.data))
            mp.setenv("FEDLIGHTNING_CACHE", str(self.root / "cache"))
            over = [*RUNS[name], "logger=none"]
            self[name] = train(compose(over), self.root / name, verbose=False)
        return self[name]


@pytest.fixture(scope="session")
def references(tmp_path_factory, shared_data):
    refs = References(tmp_path_factory.mktemp("refs"), shared_data)
    return refs.root, refs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_simulation_runs_every_schedule_equal_to_the_sequential_run(
    name, tmp_env, shared_data, references, monkeypatch
):
    from fedlightning.flower.apps import simulate

    root, refs = references
    ref = refs[name]  # first: it builds the bank into the shared cache
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    monkeypatch.setenv("FEDLIGHTNING_CACHE", str(root / "cache"))
    summary = simulate([*SCHEDULES[name], "logger=none"], tmp_env / "sim")
    assert summary["metrics"] == ref["metrics"]  # bitwise: the same floats
    assert summary["comm"] == ref["comm"]  # every message, the stage-end ones too
    assert summary["hashes"] == ref["hashes"]
    if name.startswith("scaffold"):
        assert any(f.startswith("control_delta.") for f in summary["comm"]["fields"])
    elif name != "fedtip_synthetic":
        assert any(f.startswith("basis.") for f in summary["comm"]["fields"])
        states = list((tmp_env / "sim" / "nodes").rglob("state_*.pt"))
        assert states  # replay memory and teachers stay on the nodes


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="session")
def reference(tmp_path_factory, shared_data):
    """The in-process sequential run of CORA (the reference), with this process's threads."""
    from fedlightning.config import compose

    run_dir = tmp_path_factory.mktemp("seq") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDLIGHTNING_DATA", str(shared_data))
        return train(compose(CORA), run_dir, verbose=False)


def sent_fields(node_root: Path) -> dict[str, set[tuple[str, frozenset]]]:
    """kind -> the distinct (record, field names) the nodes' audit logs say they sent."""
    out: dict[str, set] = {}
    for log in node_root.rglob("sent.jsonl"):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            for record, fields in entry["records"].items():
                out.setdefault(entry["kind"], set()).add((record, frozenset(fields)))
    return out


def assert_only_declared_fields(node_root: Path, model_fields: set[str]) -> None:
    sent = sent_fields(node_root)
    assert sent["train"] == {
        ("tensors", frozenset(model_fields)),
        ("scalars", frozenset(UPDATE_SCALARS)),
    }
    assert sent["evaluate"] == {("counts", frozenset(COUNT_FIELDS))}


# ---------------------------------------------------------------------------- deployment
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Deployment:
    """A SuperLink and one SuperNode per client on loopback, each in its own process group."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env, self.procs = root, env, {}
        self.link = free_port()
        home = root / "flwr_home"
        home.mkdir(parents=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.link}"\ninsecure = true\n'
        )
        self.env = {**env, "FLWR_HOME": str(home)}
        self.start(
            "link",
            "flower-superlink",
            "--insecure",
            f"--port={self.link}",
            "--disable-runtime-dependency-installation",
        )
        wait_for_port(self.link)

    def start(self, name: str, *cmd: str) -> None:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 (closed with the process)
        self.procs[name] = subprocess.Popen(
            [str(BIN / cmd[0]), *cmd[1:]],
            cwd=self.root,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def node(self, k: int) -> None:
        state = self.root / f"node{k}"
        self.start(
            f"node{k}",
            "flower-supernode",
            "--insecure",
            f"--superlink=127.0.0.1:{self.link}",
            f"--port={free_port()}",
            f'--node-config=partition-id={k} num-partitions={K} state-dir="{state}"',
        )

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def flwr_run(
        self, run_config: str, timeout: float = HANG_GUARD_S
    ) -> subprocess.CompletedProcess:
        cmd = [str(BIN / "flwr"), "run", str(REPO / "tools" / "flower"), "local", "--stream"]
        return subprocess.run(
            [*cmd, "--run-config", run_config],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def stop(self) -> list[str]:
        """Kill every process group; the processes of the groups still running afterwards."""
        groups = [p.pid for p in self.procs.values()]
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for p in self.procs.values():
            p.wait()
        time.sleep(1)
        return running_in_groups(groups)


def running_in_groups(groups: list[int]) -> list[str]:
    """``pid command`` of every live (not zombie) process whose group is in ``groups``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            state, _, pgrp = text[text.rindex(")") + 2 :].split()[:3]
            if int(pgrp) in groups and state != "Z":
                out.append(f"{stat.parent.name} {text[: text.rindex(')') + 1]}")
    return out


def node_env(shared_data: Path, cache: Path) -> dict[str, str]:
    """The environment of a deployment's processes: this checkout, the data, the cache."""
    return {
        **os.environ,
        "FEDLIGHTNING_DATA": str(shared_data),
        "FEDLIGHTNING_CACHE": str(cache),
        "FLWR_TELEMETRY_ENABLED": "0",
        "OMP_NUM_THREADS": str(torch.get_num_threads()),  # the references' blocking
        "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def run_killing_a_node(fed: Deployment, run_dir: Path, overrides: str) -> str:
    """Start ``flwr run``, kill the last SuperNode once round 1 is checkpointed, and return
    the run's output (it ends with the run stopped, resumable)."""
    first = subprocess.Popen(
        [str(BIN / "flwr"), "run", str(REPO / "tools" / "flower"), "local", "--stream"]
        + ["--run-config", f'overrides="{overrides}" run-dir="{run_dir}"'],
        cwd=fed.root,
        env=fed.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + HANG_GUARD_S
    while not (run_dir / "checkpoint.pt").exists() and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()[0][-3000:]
        time.sleep(0.5)
    assert (run_dir / "checkpoint.pt").exists(), "round 1 never finished"
    fed.kill(f"node{K - 1}")  # round 2 waits for it in vain
    return first.communicate(timeout=HANG_GUARD_S)[0]


@contextlib.contextmanager
def deployment(root: Path, env: dict[str, str]) -> Iterator[Deployment]:
    """A SuperLink and K SuperNodes on loopback; afterwards, none of their processes lives."""
    fed = Deployment(root, env)
    try:
        for k in range(K):
            fed.node(k)
        yield fed
    finally:
        alive = fed.stop()
    assert alive == []  # the deployment's processes are all gone


@pytest.mark.slow
def test_loopback_deployment_runs_fedtip_bitwise(tmp_env, shared_data, references):
    """One SuperLink and K SuperNodes on loopback, each message a ClientApp process's
    start-up with the client's state on the node's disk: FedTIP's schedule (stacked task
    fits; one task, as every task sends the same messages: the simulation runs two) ends
    bitwise where its sequential run ends. The class-incremental and retrieval schedules send
    the messages of the CORA run below, read by the same node code (their simulation tests
    above)."""
    root, refs = references
    tip = refs["fedtip_one_task"]  # first: it builds the bank into the shared cache
    over = " ".join(
        [*RUNS["fedtip_one_task"], "logger=none", f"runner.connect_timeout_s={CONNECT_S}"]
    )
    with deployment(tmp_env, node_env(shared_data, root / "cache")) as fed:
        r = fed.flwr_run(f'overrides="{over}" run-dir="{tmp_env / "tip"}"')
    assert (tmp_env / "tip" / "summary.json").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_env / "tip" / "summary.json").read_text())
    assert summary["metrics"] == tip["metrics"]  # bitwise: the same floats
    assert summary["comm"] == tip["comm"]


@pytest.mark.slow
def test_loopback_deployment_survives_a_killed_supernode(tmp_env, shared_data, reference):
    """CORA on a loopback deployment whose last SuperNode is killed after round 1: the run
    stops clearly, resumable; the node comes back with its disk and the resumed run ends
    bitwise where the sequential run ends (a lost node only drops its client where the
    evaluation runs on the server: the class-incremental and retrieval schedules)."""
    run_dir = tmp_env / "run"
    with deployment(tmp_env, node_env(shared_data, tmp_env / "cache")) as fed:
        # the wait for the killed node: about ten times a live node's reply on an idle machine
        over = " ".join(
            [*CORA, "runner.client_timeout_s=120", f"runner.connect_timeout_s={CONNECT_S}"]
        )
        out = run_killing_a_node(fed, run_dir, over)
        # its fit is dropped from round 2 (no reply, or "Node Unavailable"); the global model
        # cannot be measured on its data: the evaluation stops the run, resumable
        assert f"round 2: client {K - 1} rejected: fit failed" in out, out[-3000:]
        assert f"round 2 (evaluate): client {K - 1}: " in out, out[-3000:]
        assert f"fedlightning flower-sim resume={run_dir}" in out
        assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["completed_rounds"] == 1
        assert not (run_dir / "summary.json").exists()

        fed.node(K - 1)  # the SuperNode comes back with its disk: the run resumes
        resumed = fed.flwr_run(f'resume="{run_dir}" overrides="logger=none"')
        assert (run_dir / "summary.json").exists(), resumed.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"] is True
    assert summary["metrics"] == reference["metrics"]
    assert summary["comm"] == reference["comm"]
    model_fields = set(reference["comm"]["fields"]) - UPDATE_SCALARS
    for k in range(K):  # client state stays on the nodes: the two newest rounds'
        (cora,) = [
            d / f"client_{k}"
            for d in (tmp_env / f"node{k}").iterdir()
            if "name: fedavg_cora" in (d / f"client_{k}" / "config.yaml").read_text()
        ]
        assert sorted(p.name for p in cora.glob("state_*.pt")) == ["state_1.pt", "state_2.pt"]
        assert_only_declared_fields(cora, model_fields)


def test_client_state_on_the_node_follows_the_rounds(tmp_path):
    """A fit in round r starts from the state saved after the client's newest fit before r,
    whatever later rounds a failed attempt left; two files stay."""
    from fedlightning.flower.node import StateFiles

    states = StateFiles(tmp_path)
    assert states.load(1) == {}
    states.save(1, {"replay": torch.tensor([1, 2])})
    states.save(3, {"replay": torch.tensor([3])})  # not sampled in round 2
    assert torch.equal(states.load(3)["replay"], torch.tensor([1, 2]))  # a repeated round 3
    assert torch.equal(states.load(4)["replay"], torch.tensor([3]))
    states.save(5, {"teacher": torch.zeros(2)})  # round 4 left nothing behind
    assert sorted(states.rounds()) == [3, 5]
    assert torch.equal(states.load(5)["replay"], torch.tensor([3]))


def test_a_node_the_superlink_reports_unavailable_drops_its_client(monkeypatch):
    """The SuperLink answers a message to a node it knows is gone with an error of its own
    (from its node id, not the node's): the runner matches replies to the messages they
    answer, and drops that client from the round."""
    from types import SimpleNamespace

    from flwr.app import Message
    from flwr.server.superlink.linkstate.utils import (
        create_message_error_unavailable_res_message,
    )
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):  # what a ServerApp process has set
        monkeypatch.setattr(TaskIdentity, name, 7)

    gone = 202
    update = ClientUpdate(1, {"model.w": torch.ones(2)}, {"num_examples": 3.0}, 0)

    class Grid:
        pushed: dict[str, Message] = {}

        def push_messages(self, messages):
            for i, m in enumerate(messages):
                m.metadata.__dict__["_message_id"] = f"m{i}"  # as Flower's grids do
                self.pushed[f"m{i}"] = m
            return list(self.pushed)

        def pull_messages(self, ids):
            for i in ids:
                m = self.pushed[i]
                if m.metadata.dst_node_id == gone:
                    yield create_message_error_unavailable_res_message(m.metadata, "node")
                else:
                    yield Message(message_records(update), reply_to=m)

    runner = FlowerRunner(LeanExecutor(), grid=Grid(), client_timeout_s=5, progress=False)
    runner.nodes = {0: 101, 1: gone}
    fit = SimpleNamespace(kind="fit", params={}, broadcast=update)
    got = runner.run_round(1, [SimpleNamespace(client_id=0), SimpleNamespace(client_id=1)], fit)
    assert torch.equal(got[0].tensors["model.w"], torch.ones(2)) and got[0].client_id == 0
    assert got[1].client_id == 1 and got[1].reason.startswith("node error: ")


# ---------------------------------------------------------------------------- a failing client
# Written as the ``sitecustomize`` of every process the simulation starts (its Ray workers
# inherit PYTHONPATH): once ``fedlightning.federation.loop`` is imported, client BAD's fit
# raises in round ROUND. Test-only; the package has no such hook.
FAILING_FIT = """
import importlib.util, sys


class FailingFit:
    def find_spec(self, name, path=None, target=None):
        if name != "fedlightning.federation.loop":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = module.local_fit

            def local_fit(algorithm, m, broadcast, executor, epochs, seed, client):
                if client.client_id == {bad} and broadcast.round == {round}:
                    raise RuntimeError("injected failure")
                return real(algorithm, m, broadcast, executor, epochs, seed, client)

            module.local_fit = local_fit

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, FailingFit())
"""


@pytest.mark.slow
def test_simulation_drops_a_failing_client_mid_run_as_the_sequential_run(
    tmp_env, shared_data, monkeypatch
):
    """Client 1's node raises in its round-2 fit: Flower drops it from round 2 (one record,
    ``fit failed``), the run goes on (client 1 fits again in round 3) and ends bitwise
    where the sequential run with the same failing fit ends."""
    import fedlightning.federation.loop as loop_module
    from fedlightning.config import compose
    from fedlightning.flower.apps import simulate

    bad, round = 1, 2
    over = [
        "experiment=fl_cora",
        "algorithm=fedavg",
        "federation.rounds=3",
        f"federation.clients={K}",
    ]
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(shared_data))
    real = loop_module.local_fit

    def failing(algorithm, m, broadcast, executor, epochs, seed, client):
        if client.client_id == bad and broadcast.round == round:
            raise RuntimeError("injected failure")
        return real(algorithm, m, broadcast, executor, epochs, seed, client)

    with monkeypatch.context() as mp:
        mp.setattr(loop_module, "local_fit", failing)
        # one at a time, as Flower's nodes fit: the failure is injected into the one-client
        # fit, and a failing stacked share would drop every client of the round
        seq = [*over, "logger=none", "runner.stack_clients=false"]
        reference = train(compose(seq), tmp_env / "seq", verbose=False)

    hook = tmp_env / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAILING_FIT.format(bad=bad, round=round))
    paths = [str(hook), str(REPO), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    summary = simulate([*over, "logger=none"], tmp_env / "sim")

    for s in (reference, summary):
        rejected = s["comm"]["rejected"]
        assert rejected["per_client"] == {str(bad): 1} and rejected["per_round"] == {"2": 1}
        ((m,),) = [rejected["messages"]]
        assert (m["client"], m["field"]) == (bad, "") and "fit failed" in m["rule"]
        assert "injected failure" in m["rule"]
    assert summary["metrics"] == reference["metrics"]  # bitwise: the same floats
    assert {k: v for k, v in summary["comm"].items() if k != "rejected"} == {
        k: v for k, v in reference["comm"].items() if k != "rejected"
    }
    # client 1 sent in rounds 1 and 3 only, client 0 in all three
    assert summary["comm"]["fields"]["num_examples"]["up"] == 2 + 1 + 2
