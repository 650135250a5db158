"""Malformed inputs through the real command line: configs, Hydra composition, output
directories, resume, checkpoints, the MLflow store, the data loaders (folder graphs,
interaction files), the feature pipeline and sweeps. Every case ends with exit status 2 and
exactly one line on stderr (no traceback) naming what is wrong, and no ``summary.json`` or
checkpoint is written or changed; a refused run directory is left byte for byte as it was.

Most cases call :func:`fedlightning.cli.main` in this process (what the console script
runs); the cases marked ``SUB`` run ``fedlightning`` as a real subprocess.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

HANG_GUARD_S = 600  # a subprocess case takes seconds; this only stops a hang
SYN = ["experiment=fl_synthetic", "algorithm=fedavg", "logger=none"]
FOLDER = [*SYN, "dataset=folder", "dataset.path=g", "federation.clients=2", "partition=random"]
N = 60  # nodes of the hand-written folder graph: 2 clients of 30


# ------------------------------------------------------------------------------ inputs
def write_folder(root: Path) -> Path:
    """A valid 60-node folder graph ``g`` (3 classes, a ring, one 4-d modality)."""
    g = root / "g"
    (g / "features").mkdir(parents=True)
    (g / "edges.csv").write_text("src,dst\n" + "".join(f"{i},{(i + 1) % N}\n" for i in range(N)))
    (g / "labels.csv").write_text("label\n" + "".join(f"{i % 3}\n" for i in range(N)))
    x = np.random.default_rng(0).standard_normal((N, 4)).astype(np.float32)
    np.save(g / "features" / "text.npy", x)
    (g / "class_names.json").write_text(json.dumps(["a", "b", "c"]))
    (g / "node_ids.json").write_text(json.dumps([f"n{i}" for i in range(N)]))
    (g / "meta.json").write_text(json.dumps({"name": "ring"}))
    return g


def folder(mutate: Callable[[Path], object]) -> Callable[[Path, dict], None]:
    """Set-up: the valid folder graph, then ``mutate(folder)``."""
    return lambda cwd, runs: mutate(write_folder(cwd))


def events(text: str) -> Callable[[Path, dict], None]:
    """Set-up: an interaction file ``ev.csv`` holding ``text``."""
    return lambda cwd, runs: (cwd / "ev.csv").write_text(text)


GOOD_EVENTS = "".join(f"{i % 7},{i % 5},{i}\n" for i in range(40))


def raw_graph(nodes: str, edges: str = "src,dst\na,b\n") -> Callable[[Path, dict], None]:
    """Set-up: a raw folder ``raw`` for ``data features`` with ``nodes.csv`` and ``edges.csv``."""

    def setup(cwd: Path, runs: dict) -> None:
        (cwd / "raw").mkdir()
        (cwd / "raw" / "nodes.csv").write_text(nodes)
        (cwd / "raw" / "edges.csv").write_text(edges)

    return setup


RAW_NODES = "id,text,label\na,first node,x\nb,second node,y\nc,third node,x\n"


def copy_run(name: str, then: Callable[[Path], object] | None = None):
    """Set-up: a copy of the module's ``name`` run (``done``: finished; ``cut``: killed in
    its second round) as ``run``, then ``then(run)``."""

    def setup(cwd: Path, runs: dict) -> None:
        shutil.copytree(runs[name], cwd / "run")
        if then is not None:
            then(cwd / "run")

    return setup


def edit_checkpoint(change: Callable[[dict], object]) -> Callable[[Path], None]:
    """Rewrite ``run/checkpoint.pt`` after ``change(state)`` (in place)."""

    def apply(run: Path) -> None:
        state = torch.load(run / "checkpoint.pt", weights_only=False)
        change(state)
        torch.save(state, run / "checkpoint.pt")

    return apply


def other_model(state: dict) -> None:
    """A checkpoint of a wider model: every 2-D weight of the global model gets a column."""
    g = state["server"]["global_state"]
    for k, v in list(g.items()):
        if v.dim() == 2:
            g[k] = torch.cat([v, v[:, :1]], dim=1)
    state.pop("identity", None)
    state["format"] = 2  # before runs had an identity: the shapes are what is checked


def other_identity(state: dict) -> None:
    state["identity"] = {**state["identity"], "experiment": "fedavg_cora"}


def put(path: str, content: str | bytes) -> Callable[[Path], None]:
    """Write ``content`` to ``run/<path>``."""

    def apply(run: Path) -> None:
        p = run / path
        p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)

    return apply


def truncate(path: str) -> Callable[[Path], None]:
    def apply(run: Path) -> None:
        data = (run / path).read_bytes()
        (run / path).write_bytes(data[: len(data) // 3])

    return apply


# ------------------------------------------------------------------------------- cases
@dataclass
class Case:
    args: list[str]  # fedlightning's arguments, in the case's own directory
    needle: str  # what the one error line must hold
    setup: Callable[[Path, dict], object] | None = None
    sub: bool = False  # a real subprocess (else cli.main in this process)
    env: dict[str, str] = field(default_factory=dict)
    untouched: str | None = None  # a folder that must stay byte for byte as it was


def train(*args: str, **kw) -> Case:
    needle = kw.pop("needle")
    return Case(["train", *args], needle, **kw)


SUB = {"sub": True}
CASES: dict[str, Case] = {
    # --- configs: Hydra composition (unknown experiment, group option, key; a bad override)
    "unknown experiment": train("experiment=nope", needle="config `experiment`", **SUB),
    "experiment close name": train("experiment=fl_cra", needle="did you mean fl_cora"),
    "experiment of the older form": train(
        "experiment=cil_fedogl_cora", needle="experiment=cil_cora algorithm=fedogl"
    ),
    "dataset close name": train("dataset=cor", needle="did you mean cora"),
    "unknown algorithm": train("algorithm=fedavgg", needle="config `algorithm`", **SUB),
    "unknown key": train("foo.bar=1", needle="config `foo.bar`"),
    "unknown key close name": train("federation.round=2", needle="federation.rounds"),
    "override does not parse": train("federation.rounds=[", needle="federation.rounds=["),
    "append existing key": train("+federation.rounds=3", needle="federation.rounds"),
    "multirun unknown option": train("-m", "seed=0,1", "dataset=cor", needle="did you mean cora"),
    # --- configs: values and types
    "rounds zero": train(*SYN, "federation.rounds=0", needle="federation.rounds"),
    "rounds a string": train(*SYN, "federation.rounds=abc", needle="federation.rounds", **SUB),
    "rounds a float": train(*SYN, "federation.rounds=1.5", needle="federation.rounds"),
    "clients negative": train(*SYN, "federation.clients=-1", needle="federation.clients"),
    "clients too many": train(*SYN, "federation.clients=400", needle="federation.clients"),
    "participation zero": train(*SYN, "federation.participation=0", needle="participation"),
    "participation above one": train(*SYN, "federation.participation=1.5", needle="particip"),
    "local epochs a list": train(*SYN, "federation.local_epochs=[1]", needle="local_epochs"),
    "seed negative": train(*SYN, "seed=-1", needle="`seed`"),
    "protocol seed a string": train(*SYN, "protocol.seed=x", needle="protocol.seed"),
    "conv unknown": train(*SYN, "model.net.conv=gat", needle="model.net.conv"),
    "dropout above one": train(*SYN, "model.net.dropout=2", needle="model.net.dropout"),
    "hidden zero": train(*SYN, "model.net.hidden=0", needle="model.net.hidden"),
    "lr zero": train(*SYN, "model.optimizer.lr=0", needle="model.optimizer.lr"),
    "threads zero": train(*SYN, "threads=0", needle="threads"),
    "threads a word": train(*SYN, "threads=many", needle="threads"),
    "split of two": train(*SYN, "partition.split=[0.5,0.5]", needle="partition.split"),
    "alpha zero": train(*SYN, "partition=dirichlet", "partition.alpha=0", needle="alpha"),
    "stages start with one": train(
        "logger=none", "protocol.stream.stages=[1,1]", needle="protocol.stream.stages"
    ),
    "stages too many classes": train(
        "logger=none", "protocol.stream.stages=[2,2,2]", needle="protocol.stream.stages"
    ),
    "client fraction two": train(
        "logger=none", "protocol.stream.client_fraction=2", needle="client_fraction"
    ),
    "continual algorithm without stream": train(*SYN, "algorithm=cil_fedavg", needle="protocol"),
    "continual experiment with a plain algorithm": train(
        "experiment=cil_cora",
        "logger=none",
        "algorithm=fedtip",
        needle="algorithm",
    ),
    "replay budget negative": train(
        "experiment=cil_cora",
        "algorithm=cil_fedavg_replay",
        "logger=none",
        "algorithm.replay_budget=-1",
        needle="replay_budget",
    ),
    "client fraction zero": train(
        "experiment=cil_cora",
        "algorithm=cil_fedavg",
        "logger=none",
        "protocol.stream.client_fraction=0",
        needle="client_fraction",
    ),
    "trainer devices under the distributed runner": train(
        *SYN,
        "runner=distributed",
        "runner.executor._target_=fedlightning.federation.executors.TrainerExecutor",
        "+runner.executor.devices=2",
        needle="runner.executor.devices",
    ),
    "data root missing": train(
        "experiment=fl_cora",
        "algorithm=fedavg",
        "logger=none",
        needle="/nonexistent/dir",
        env={"FEDLIGHTNING_DATA": "/nonexistent/dir"},
    ),
    "env interpolation unset": train(
        *SYN, "data_root=${oc.env:FEDLIGHTNING_UNSET_FOR_TEST}", needle="`data_root`", **SUB
    ),
    "interpolation of no key": train(*SYN, "federation.rounds=${nope}", needle="rounds"),
    "missing mandatory path": train(*SYN, "dataset=folder", needle="dataset.path"),
    # --- stages and partitions that leave nothing to learn
    "client without training nodes": train(
        *SYN, "partition.split=[0,0.5,0.5]", needle="no training node"
    ),
    "one-class graph": train(
        *FOLDER,
        needle="1 class",
        setup=folder(lambda g: (g / "labels.csv").write_text("label\n" + "0\n" * N)),
    ),
    "class stream on two classes": train(
        *FOLDER,
        "protocol=cil",
        "algorithm=cil_fedavg",
        "protocol.stream.stages=[2]",
        needle="needs >= 3",
        setup=folder(
            lambda g: (
                (g / "labels.csv").write_text("label\n" + "0\n1\n" * (N // 2)),
                (g / "class_names.json").write_text('["a", "b"]'),
            )
        ),
    ),
    "missing rate above one": train(*SYN, "dataset.missing_rate=1.5", needle="missing_rate"),
    "sparse modality unknown": train(
        *SYN, "dataset.sparse_modalities=[audio]", needle="dataset.sparse_modalities"
    ),
    # --- output directories
    "run dir under a file": train(
        *SYN,
        "hydra.run.dir=afile/run",
        needle="hydra.run.dir",
        setup=lambda c, r: (c / "afile").write_text("x"),
        **SUB,
    ),
    "run dir unwritable": train(*SYN, "hydra.run.dir=/proc/fl-nope/run", needle="hydra.run.dir"),
    "run dir holds a finished run": train(
        *SYN,
        "federation.rounds=1",
        "seed=1",
        "hydra.run.dir=run",
        needle="already holds a run",
        setup=copy_run("done"),
        untouched="run",
        **SUB,
    ),
    "run dir holds an interrupted run": train(
        *SYN,
        "hydra.run.dir=run",
        needle="already holds a run",
        setup=copy_run("cut"),
        untouched="run",
    ),
    "run dir interpolated to a run": train(
        *SYN,
        "hydra.run.dir=${name}",
        needle="already holds a run",
        setup=lambda c, r: shutil.copytree(r["done"], c / "fedavg_synthetic"),
        untouched="fedavg_synthetic",
    ),
    "multirun dir under a file": train(
        "-m",
        *SYN,
        "seed=0,1",
        "hydra.sweep.dir=afile/m",
        needle="hydra.sweep.dir",
        setup=lambda c, r: (c / "afile").write_text("x"),
        **SUB,
    ),
    "multirun into a sweep of runs": train(
        "-m",
        *SYN,
        "federation.rounds=1",
        "seed=0,1",
        "hydra.sweep.dir=sweep",
        needle="already holds a run",
        setup=lambda c, r: shutil.copytree(r["done"], c / "sweep" / "0"),
        untouched="sweep",
    ),
    # --- resume
    "resume of nothing": train("resume=nowhere", needle="config `resume`"),
    "resume of an empty dir": train(
        "resume=run", needle="config.yaml", setup=lambda c, r: (c / "run").mkdir()
    ),
    "resume of a finished run": train(
        "resume=run", needle="already finished", setup=copy_run("done"), untouched="run", **SUB
    ),
    "resume garbled config": train(
        "resume=run",
        needle="config.yaml",
        setup=copy_run("cut", put("config.yaml", "name: [x\n  task: {{fl\n")),
        untouched="run",
        **SUB,
    ),
    "resume config a list": train(
        "resume=run",
        needle="config.yaml",
        setup=copy_run("cut", put("config.yaml", "- 1\n- 2\n")),
        untouched="run",
    ),
    "resume config not utf-8": train(
        "resume=run",
        needle="config.yaml",
        setup=copy_run("cut", put("config.yaml", b"\xff\xfe\x00name")),
        untouched="run",
    ),
    "resume without checkpoint": train(
        "resume=run",
        needle="checkpoint.pt",
        setup=copy_run("cut", lambda run: (run / "checkpoint.pt").unlink()),
        untouched="run",
    ),
    "resume truncated checkpoint": train(
        "resume=run",
        needle="checkpoint.pt",
        setup=copy_run("cut", truncate("checkpoint.pt")),
        untouched="run",
        **SUB,
    ),
    "resume checkpoint of random bytes": train(
        "resume=run",
        needle="not a readable checkpoint",
        setup=copy_run("cut", put("checkpoint.pt", bytes(range(256)) * 8)),
        untouched="run",
    ),
    "resume checkpoint a tensor": train(
        "resume=run",
        needle="checkpoint format",
        setup=copy_run("cut", lambda run: torch.save(torch.zeros(3), run / "checkpoint.pt")),
        untouched="run",
    ),
    "resume checkpoint of a future format": train(
        "resume=run",
        needle="checkpoint format 99",
        setup=copy_run("cut", edit_checkpoint(lambda s: s.update(format=99))),
        untouched="run",
    ),
    "resume checkpoint of another experiment": train(
        "resume=run",
        needle="fedavg_cora",
        setup=copy_run("cut", edit_checkpoint(other_identity)),
        untouched="run",
    ),
    "resume checkpoint of another config": train(
        "resume=run",
        needle="federation.rounds",
        setup=copy_run(
            "cut", lambda run: shutil.copy(run.parent.parent / "done.pt", run / "checkpoint.pt")
        ),
        untouched="run",
    ),
    "resume checkpoint of another model": train(
        "resume=run",
        needle="another model",
        setup=copy_run("cut", edit_checkpoint(other_model)),
        untouched="run",
    ),
    "resume partial checkpoint": train(
        "resume=run",
        needle="does not fit",
        setup=copy_run("cut", edit_checkpoint(lambda s: s.pop("clients"))),
        untouched="run",
    ),
    "resume garbled identity": train(
        "resume=run",
        needle="identity.json",
        setup=copy_run("cut", put("identity.json", "{not json")),
        untouched="run",
    ),
    "resume identity of another run": train(
        "resume=run",
        needle="identity.json",
        setup=copy_run("cut", put("identity.json", json.dumps({"experiment": "other"}))),
        untouched="run",
    ),
    # --- the MLflow store
    "mlflow store unwritable": train(
        *SYN[:1], "logger.tracking_uri=sqlite:////proc/fl-nope/m.db", needle="tracking_uri", **SUB
    ),
    "mlflow store under a file": train(
        *SYN[:1],
        "logger.tracking_uri=sqlite:///afile/m.db",
        needle="tracking_uri",
        setup=lambda c, r: (c / "afile").write_text("x"),
    ),
    "mlflow uri of no scheme": train(
        *SYN[:1], "logger.tracking_uri=bogus://x", needle="logger.tracking_uri"
    ),
    # --- the folder format
    "folder path missing": train(*FOLDER[:-3], "federation.clients=2", needle="dataset.path"),
    "folder labels bad line": train(
        *FOLDER,
        needle="line 4",
        setup=folder(lambda g: (g / "labels.csv").write_text("label\n0\n1\nx\n" + "0\n" * 57)),
    ),
    "folder label out of range": train(
        *FOLDER,
        needle="labels.csv",
        setup=folder(lambda g: (g / "labels.csv").write_text("label\n" + "7\n" * N)),
    ),
    "folder features NaN": train(
        *FOLDER,
        needle="NaN",
        setup=folder(lambda g: np.save(g / "features" / "text.npy", np.full((N, 4), np.nan))),
    ),
    "folder features wrong rows": train(
        *FOLDER,
        needle="text.npy",
        setup=folder(lambda g: np.save(g / "features" / "text.npy", np.zeros((N + 1, 4)))),
    ),
    "folder features truncated": train(
        *FOLDER,
        needle="text.npy",
        setup=folder(lambda g: truncate("text.npy")(g / "features")),
        **SUB,
    ),
    "folder edges out of range": train(
        *FOLDER,
        needle="edges.csv",
        setup=folder(lambda g: (g / "edges.csv").write_text("src,dst\n0,1\n2,600\n")),
    ),
    "folder edges bad line": train(
        *FOLDER,
        needle="line 3",
        setup=folder(lambda g: (g / "edges.csv").write_text("src,dst\n0,1\n1;2\n")),
    ),
    "folder class names bad json": train(
        *FOLDER,
        needle="class_names.json",
        setup=folder(lambda g: (g / "class_names.json").write_text('["a", ')),
    ),
    "folder node ids wrong length": train(
        *FOLDER,
        needle="node_ids.json",
        setup=folder(lambda g: (g / "node_ids.json").write_text('["a"]')),
    ),
    "folder without features": train(
        *FOLDER,
        needle="features",
        setup=folder(lambda g: shutil.rmtree(g / "features")),
    ),
    # --- interaction files (data manifest: the stream and FedTIP's protocol objects)
    "events file missing": Case(
        ["data", "manifest", "experiment=temporal_synthetic", "dataset=interactions"]
        + ["dataset.path=none.csv", "dataset.bipartite=false", "--out", "m"],
        "none.csv",
    ),
    "events bipartite unset": Case(
        ["data", "manifest", "experiment=temporal_synthetic", "dataset=interactions"]
        + ["dataset.path=ev.csv", "--out", "m"],
        "dataset.bipartite",
        setup=events(GOOD_EVENTS),
    ),
    "events time not a number": Case(
        ["data", "manifest", "experiment=temporal_synthetic", "dataset=interactions"]
        + ["dataset.path=ev.csv", "dataset.bipartite=false", "--out", "m"],
        "line 3",
        setup=events("0,1,1\n1,2,2\n2,3,later\n"),
    ),
    "events two columns": Case(
        ["data", "manifest", "experiment=temporal_synthetic", "dataset=interactions"]
        + ["dataset.path=ev.csv", "dataset.bipartite=false", "--out", "m"],
        "ev.csv",
        setup=events("0,1\n1,2\n"),
        sub=True,
    ),
    # --- the feature pipeline
    "features raw missing": Case(["data", "features", "nowhere", "--out", "o"], "nodes"),
    "features no label column": Case(
        ["data", "features", "raw", "--out", "o"],
        "field `label`",
        setup=raw_graph("id,text\na,x\nb,y\n"),
    ),
    "features edge to nobody": Case(
        ["data", "features", "raw", "--out", "o"],
        "nobody",
        setup=raw_graph(RAW_NODES, "src,dst\na,nobody\n"),
        sub=True,
    ),
    "features repeated id": Case(
        ["data", "features", "raw", "--out", "o"],
        "repeats",
        setup=raw_graph("id,text,label\na,x,1\na,y,2\n"),
    ),
    "features out not empty": Case(
        ["data", "features", "raw", "--out", "o"],
        "refusing to overwrite",
        setup=lambda c, r: (raw_graph(RAW_NODES)(c, r), (c / "o").mkdir(), (c / "o" / "k").touch()),
    ),
    # --- sweeps
    "sweep file not YAML": Case(
        ["sweep", "bad.yaml", "--out", "s"],
        "bad.yaml",
        setup=lambda c, r: (c / "bad.yaml").write_text("experiment: [x\n  space: {{\n"),
        sub=True,
    ),
    "sweep file missing": Case(["sweep", "none.yaml", "--out", "s"], "none.yaml"),
    "sweep space not a mapping": Case(
        ["sweep", "bad.yaml", "--out", "s"],
        "bad.yaml",
        setup=lambda c, r: (c / "bad.yaml").write_text("experiment: fl_synthetic\nspace: 3\n"),
    ),
    # --- commands
    "unknown command": Case(["tran", "seed=0"], "did you mean train?"),
}


# ----------------------------------------------------------------------------- running
@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A finished ``fedavg_synthetic`` run (one round) and one killed in its second round,
    made once by the real CLI; ``done.pt`` beside them is the finished run's checkpoint."""
    root = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "FEDLIGHTNING_CACHE": str(root / "cache")}
    cmd = [str(Path(sys.executable).parent / "fedlightning"), "train", *SYN]
    for args, code in (
        (["federation.rounds=1", "hydra.run.dir=done"], 0),
        (["federation.rounds=2", "hydra.run.dir=cut", "runner.kill_at=2:1"], -9),
    ):
        r = subprocess.run(
            [*cmd, *args], cwd=root, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
        )
        assert r.returncode == code, r.stderr[-2000:]
    return {"done": root / "done", "cut": root / "cut", "cache": root / "cache"}


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def results(folder: Path) -> dict[str, str]:
    """The files that claim or hold a run's results: summaries and checkpoints."""
    return {k: v for k, v in fingerprint(folder).items() if Path(k).name in RESULT_FILES}


RESULT_FILES = ("summary.json", "checkpoint.pt")


def run_in_process(args: list[str], cwd: Path, env: dict, monkeypatch) -> tuple[int, str]:
    """``fedlightning ARGS`` through :func:`fedlightning.cli.main` in this process: its exit
    status and what it wrote to stderr."""
    from fedlightning.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [str(Path(sys.executable).parent / "fedlightning"), *args])
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, err.getvalue()


def run_subprocess(args: list[str], cwd: Path, env: dict) -> tuple[int, str]:
    cmd = [str(Path(sys.executable).parent / "fedlightning"), *args]
    r = subprocess.run(
        cmd,
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    return r.returncode, r.stderr


def test_at_least_sixty_cases_ten_of_them_subprocesses():
    assert len(CASES) >= 60
    assert sum(c.sub for c in CASES.values()) >= 10


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_input_is_one_line_exit_2(name, runs, tmp_path, monkeypatch):
    case = CASES[name]
    cwd = tmp_path / "case"
    cwd.mkdir()
    shutil.copy(runs["done"] / "checkpoint.pt", tmp_path / "done.pt")
    if case.setup is not None:
        case.setup(cwd, runs)
    env = {
        "FEDLIGHTNING_CACHE": str(runs["cache"]),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        **case.env,
    }
    before, kept = results(tmp_path), fingerprint(cwd / case.untouched) if case.untouched else {}

    if case.sub:
        code, stderr = run_subprocess(case.args, cwd, env)
    else:
        code, stderr = run_in_process(case.args, cwd, env, monkeypatch)

    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: ") and case.needle in lines[0], lines[0]
    assert results(tmp_path) == before  # no summary or checkpoint written or changed
    if case.untouched:
        assert fingerprint(cwd / case.untouched) == kept  # not a byte written there
