"""A user's own data, as issue 21 brings it: a temporal protocol composed without an
experiment, and a label-free interaction stream through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlightning.data.temporal import make_synthetic_stream
from fedlightning.errors import ConfigError
from fedlightning.resources import conf_dir

REPO = Path(__file__).resolve().parents[2]
FL = str(Path(sys.executable).parent / "fedlightning")


def write_label_free(path: Path, num_events: int = 20000) -> Path:
    """A `src dst time` file (no labels, no features) from the synthetic stream, users and
    items in one id space (items numbered after the users): a who-rates-whom list."""
    s = make_synthetic_stream(num_events=num_events, seed=0)
    users = int(s.src.max()) + 1
    rows = np.c_[s.src, s.dst - s.dst.min() + users, s.t]
    np.savetxt(path, rows, fmt="%d", delimiter=" ")
    return path


def fl(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``fedlightning ARGS`` in ``cwd`` with this checkout's package, its own cache and
    MLflow store."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FEDLIGHTNING_CACHE": str(cwd / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}",
    }
    return subprocess.run([FL, *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_manifest_without_an_experiment_from_the_command_line(tmp_path):
    """`data manifest dataset=... protocol=temporal`: the default experiment's graph keys
    (`dataset.missing_rate`) stay out of the stream's loader, on a built-in stream and on a
    label-free `src dst time` file read by the generic loader."""
    small = ["dataset.num_events=3000", "logger=none"]
    r = fl(["data", "manifest", "dataset=synthetic_stream", "protocol=temporal", *small,
            "--out", "plain"], tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "written" in r.stdout and "missing_rate" not in r.stderr
    plain = json.loads((tmp_path / "plain" / "protocol.json").read_text())
    # the same objects as through the protocol's experiment
    r = fl(["data", "manifest", "experiment=temporal_synthetic", *small, "--out", "exp"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "exp" / "protocol.json").read_text())["hashes"] == plain["hashes"]

    path = write_label_free(tmp_path / "ratings.txt")
    r = fl(["data", "manifest", "dataset=interactions", f"dataset.path={path}",
            "dataset.bipartite=false", "protocol=temporal", "logger=none", "--out", "own"],
           tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    table = json.loads((tmp_path / "own" / "protocol.json").read_text())["table"]
    assert table["events"] == 20000 and table["labels"] == "none" and table["classes"] == 0


# --- rules the config alone decides: checked before any data is read ---------------------
# (overrides, the key the one-line error names, text it holds); cora's files are never found
# (data_root points nowhere) and the loader is replaced by one that fails if called.
BEFORE_DATA = [
    (["protocol.stream.stages=[2,2,2,2]"], "protocol.stream.stages", "'cora' has 7"),
    (["protocol.stream.stages=[1,1,1]"], "protocol.stream.stages", "first stage of >= 2"),
    (["dataset=synthetic", "dataset.num_classes=4", "protocol.stream.stages=[2,2]"],
     "protocol.stream.stages", "at most 3 in all, e.g. [2, 1]"),
    (["protocol.stream.client_fraction=0"], "protocol.stream.client_fraction", "(0, 1]"),
    (["partition.split=[0.8,0.0,0.2]"], "partition.split", "validation fraction must be > 0"),
    (["partition=dirichlet", "partition.alpha=0"], "partition.alpha", "> 0"),
    (["algorithm=fedtip"], "algorithm", "has no class-incremental form"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, key, text", BEFORE_DATA)
def test_config_only_rules_fail_before_any_data_is_read(
    overrides, key, text, tmp_env, compose, monkeypatch
):
    import fedlightning.programs.graph_program as graph_program
    from fedlightning.train import train

    def no_data(cfg):
        raise AssertionError("data was read before the config was checked")

    monkeypatch.setattr(graph_program, "load_graph", no_data)
    base = [
        "experiment=cil_cora",
        "algorithm=cil_fedavg",
        f"data_root={tmp_env / 'nowhere'}",
        "logger=none",
    ]
    with pytest.raises(ConfigError) as err:
        train(compose([*base, *overrides]), tmp_env / "run", verbose=False)
    assert err.value.key == key and text in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_env / "run").exists()  # no run began


def test_bad_stages_of_a_folder_not_yet_written_name_the_stages(tmp_env, compose):
    """A folder's classes are known only once its labels are read, but the layout rules
    hold for any dataset: the stages error comes first, before the folder is looked at."""
    from fedlightning.config import validate

    over = [
        "experiment=cil_cora",
        "algorithm=cil_fedavg",
        "dataset=folder",
        f"dataset.path={tmp_env / 'later'}",
    ]
    with pytest.raises(ConfigError, match="protocol.stream.stages"):
        validate(compose([*over, "protocol.stream.stages=[1,1,1]"]))
    # C unknown: any good layout passes, and then the missing folder is named
    with pytest.raises(ConfigError, match="dataset.path"):
        validate(compose([*over, "protocol.stream.stages=[2,2,2,2,2]"]))


def test_bad_stages_from_the_command_line_is_one_line(tmp_path):
    r = fl(["train", "experiment=cil_cora", "algorithm=cil_fedavg", "protocol.stream.stages=[1,1,1]",
            f"data_root={tmp_path / 'nowhere'}", "logger=none"], tmp_path)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: config `protocol.stream.stages`: need a first stage of >= 2 classes and >= 1 "
        "class per later stage, got [1, 1, 1]"
    ]
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.json"))


# --- a label-free stream runs link prediction only -----------------------------------------
FEDTIP_SMALL = [  # as tests/integration/test_fedtip.py: a few tasks, a small bank
    "protocol.tasks.num_tasks=3",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
]


def test_a_label_free_stream_runs_link_prediction_only(tmp_env, compose, caplog):
    """`families: auto` (the synthetic recipe's) resolves to `lp` on a `src dst time` file:
    the summary, the tag and the metrics say so; `families=[nc, lp]` is refused."""
    import logging

    from fedlightning.train import train

    path = write_label_free(tmp_env / "ratings.txt")
    over = ["experiment=temporal_synthetic", "algorithm=fedtip", "dataset=interactions", f"dataset.path={path}",
            "dataset.bipartite=false", *FEDTIP_SMALL]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="fedlightning.programs.temporal_program"):
        s = train(compose(over), tmp_env / "run", verbose=False)
    assert "families=auto: lp on ratings (no usable state labels)" in caplog.messages
    assert s["families"] == ["lp"] and s["tags"]["families"] == "lp"
    assert s["tags"]["dataset"] == "ratings" and s["tasks_done"] == 3
    assert 0.0 <= s["metrics"]["auc_tlp"] <= 1.0 and "auc_nc" not in s["metrics"]
    assert set(s["comm"]["message_values"]) == {"lp"}
    with pytest.raises(ConfigError, match="families") as err:
        train(compose([*over, "families=[nc,lp]"]), tmp_env / "nc", verbose=False)
    assert "ratings has none" in str(err.value) and "\n" not in str(err.value)


# --- names that follow the data --------------------------------------------------------------
DATASETS = sorted(p.stem for p in (conf_dir() / "dataset").glob("*.yaml"))


def run_dir_of(overrides: list[str]) -> str:
    """``hydra.run.dir`` as ``fedlightning train OVERRIDES`` resolves it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fedlightning.config import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides, return_hydra_config=True)
        return str(cfg.hydra.run.dir)


@pytest.mark.parametrize(
    "overrides, data, experiment",
    [
        (["experiment=cil_cora", "algorithm=cil_fedavg"], "cora", "cil_fedavg_cora"),
        (["experiment=cil_cora", "algorithm=cil_fedavg", "dataset=folder", "dataset.path=/d/my graph/"],
         "my_graph", "cil_fedavg_my_graph"),  # the folder's name, made one folder name
        (["experiment=cil_cora", "algorithm=cil_fedavg", "dataset=folder", "dataset.path=/d/g",
          "dataset.name=mine"], "mine", "cil_fedavg_mine"),
        (["experiment=temporal_synthetic", "algorithm=fedtip", "dataset=interactions", "dataset.path=/d/ratings.txt"],
         "ratings", "fedtip_ratings"),  # the file's stem
        (["experiment=temporal_bitcoin_alpha", "algorithm=fedtip", "dataset.name=bitcoin_otc"], "bitcoin_otc",
         "fedtip_bitcoin_otc"),
        (["experiment=temporal_wikipedia", "algorithm=fedtip", "dataset=jodie", "dataset.path=/d/reddit.csv"],
         "reddit", "fedtip_reddit"),
        ([], "synthetic", "demo"),
    ],
)  # fmt: skip
def test_the_run_folder_and_the_experiment_take_the_method_and_the_data_name(
    overrides, data, experiment, compose
):
    prefix, stamp = run_dir_of(overrides).rsplit("/", 1)
    assert prefix == f"outputs/{data}/{experiment}" and stamp[:2] == "20"
    cfg = compose(overrides)
    assert cfg.dataset.display_name == data and cfg.name == experiment


@pytest.mark.parametrize("dataset", DATASETS)
def test_every_dataset_config_declares_its_display_name(dataset, compose):
    over = [f"dataset={dataset}", "dataset.path=/d/x.csv"]
    cfg = compose(over if "path: ???" in (conf_dir() / "dataset" / f"{dataset}.yaml").read_text()
                  else [f"dataset={dataset}"])  # fmt: skip
    assert isinstance(cfg.dataset.display_name, str) and cfg.dataset.display_name


def test_data_name_reads_files_folders_and_names(tmp_path):
    from fedlightning.config import data_name

    assert data_name("/d/messages.txt", "file") == "messages"
    assert data_name("/d/my_graph/", "folder") == "my_graph"
    assert data_name("/d/my_graph", "folder", "given") == "given"
    assert data_name("a/b c:d", "name") == "a_b_c_d" and data_name("///", "name") == "data"
    # a folder-format folder's meta.json names it, as the loader names the graph
    folder = tmp_path / "v2"
    folder.mkdir()
    (folder / "meta.json").write_text('{"name": "pages"}')
    assert data_name(folder, "folder") == "pages" and data_name(folder, "dir") == "v2"
    (folder / "meta.json").write_text("{not json")  # the loader reports it; the name falls back
    assert data_name(folder, "folder") == "v2"


def test_a_folder_run_is_named_after_the_folder_and_keeps_its_class_names(tmp_path):
    """From the command line: `dataset=folder` with class-name labels under a recipe of
    another dataset. The run folder, MLflow run name and experiment take the folder's name
    beside the method's, and class_names.json (next to partition.json, and an
    artifact) maps the label ids back to the names."""
    from fedlightning.data.graphs import make_synthetic, save_folder

    g = make_synthetic(num_nodes=200, num_classes=4, modalities={"text": 8}, missing_rate=0.0,
                       p_in=0.1, p_out=0.005, seed=0)  # fmt: skip
    folder = tmp_path / "my_graph"
    save_folder(g, folder)
    for f in ("labels.npy", "class_names.json", "meta.json"):  # named by its folder
        (folder / f).unlink()
    names = ["ML", "AI", "IR", "DB"]  # named labels: ids in sorted order AI, DB, IR, ML
    (folder / "labels.csv").write_text("".join(f"{names[y]}\n" for y in g.y.tolist()))
    r = fl(["train", "experiment=cil_cora", "algorithm=cil_fedavg", "dataset=folder", f"dataset.path={folder}",
            "protocol.stream.stages=[2,1]", "federation.rounds=1", "federation.clients=2"],
           tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = (tmp_path / "outputs" / "my_graph" / "cil_fedavg_my_graph").iterdir()
    assert json.loads((run / "class_names.json").read_text()) == ["AI", "DB", "IR", "ML"]
    assert (run / "partition.json").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["experiment"] == "cil_fedavg_my_graph" and summary["tags"]["dataset"] == "my_graph"
    )

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mrun = client.get_run(json.loads((run / "mlflow_run.json").read_text())["run_id"])
    assert mrun.info.run_name == f"{mrun.data.tags['method']}-my_graph-s0"  # method, data, seed
    assert mrun.data.tags["experiment"] == "cil_fedavg_my_graph"
    assert "class_names.json" in {a.path for a in client.list_artifacts(mrun.info.run_id)}


def test_a_sparse_folder_with_named_classes_trains_like_its_dense_twin(tmp_path):
    """`features/words.npz` (SciPy CSR) and class-name labels: `cil_fedogl` from the command
    line gives the metrics of the same folder written dense, within float tolerance (sparse
    and dense products round differently; the dropout draws are the same, one per
    non-zero)."""
    import scipy.sparse

    from fedlightning.data.graphs import make_synthetic, save_folder

    g = make_synthetic(num_nodes=300, num_classes=4, modalities={"text": 8},
                       multi_hot={"words": 300}, density=0.03, p_in=0.1, p_out=0.005,
                       missing_rate=0.2, signal=0.5, seed=0)  # fmt: skip
    names = ["ML", "AI", "IR", "DB"]
    summaries = {}
    for kind in ("sparse", "dense"):
        folder = tmp_path / kind / "pages"
        save_folder(g, folder)
        if kind == "dense":  # the same words, written dense
            words = folder / "features" / "words.npz"
            np.save(folder / "features" / "words.npy", scipy.sparse.load_npz(words).toarray())
            words.unlink()
        for f in ("labels.npy", "class_names.json", "meta.json"):  # named by its folder
            (folder / f).unlink()
        (folder / "labels.csv").write_text("".join(f"{names[y]}\n" for y in g.y.tolist()))
        r = fl(["train", "experiment=cil_cora", "algorithm=fedogl", "dataset=folder", f"dataset.path={folder}",
                "protocol.stream.stages=[2,1]", "federation.rounds=2", "federation.clients=2",
                "logger=none"], tmp_path / kind)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        (run,) = (tmp_path / kind / "outputs" / "pages" / "cil_fedogl_pages").iterdir()
        summaries[kind] = json.loads((run / "summary.json").read_text())
    sparse, dense = summaries["sparse"]["metrics"], summaries["dense"]["metrics"]
    assert sparse.keys() == dense.keys() and "am" in sparse
    for key, value in dense.items():
        assert sparse[key] == pytest.approx(value, abs=1e-4), key
    assert summaries["sparse"]["comm"] == summaries["dense"]["comm"]


def test_cora_bag_of_words_can_be_kept_sparse(compose, shared_data):
    """`dataset.sparse_modalities=[bow]`: Cora's words become a sparse COO modality with the
    same entries; an unknown modality is one ConfigError naming the key."""
    from fedlightning.programs.graph_program import load_graph

    dense = load_graph(
        compose(["experiment=fl_cora", "algorithm=fedavg", f"data_root={shared_data}"])
    )
    sparse = load_graph(compose(["experiment=fl_cora", "algorithm=fedavg", f"data_root={shared_data}",
                                 "dataset.sparse_modalities=[bow]"]))  # fmt: skip
    assert sparse.features["bow"].layout == torch.sparse_coo
    assert torch.equal(sparse.features["bow"].to_dense(), dense.features["bow"])
    with pytest.raises(ConfigError, match="dataset.sparse_modalities.*unknown modalities"):
        load_graph(compose(["experiment=fl_cora", "algorithm=fedavg", f"data_root={shared_data}",
                            "dataset.sparse_modalities=[text]"]))  # fmt: skip
