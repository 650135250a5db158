"""Built-in loaders on the real files, checked against values computed here from the raw files."""

from __future__ import annotations

import collections
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from fedlightning.data.graphs import data_root, load_citeseer_mm, load_planetoid
from fedlightning.errors import DataError

SHARED = Path(
    os.environ.get(
        "FEDLIGHTNING_TEST_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"
    )
)

pytestmark = pytest.mark.realdata


@pytest.fixture(scope="module")
def root() -> Path:
    if not SHARED.is_dir():
        msg = f"real data directory {SHARED} not found; set FEDLIGHTNING_TEST_DATA"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return SHARED


@pytest.fixture(scope="module")
def graphs(root: Path) -> dict:
    """Each built-in graph loaded once for the module (loading is the slow part)."""
    out = {
        (n, s): load_planetoid(n, s, root)
        for n in ("cora", "citeseer")
        for s in ("planetoid", "npz")
    }
    out["citeseer_mm"] = load_citeseer_mm(root)
    return out


# ------------------------------------------------------------------------------------------
# independent readers of the raw files (plain numpy / scipy / pickle, trusted test inputs)


def raw_npz(root: Path, name: str) -> dict:
    with np.load(root / "gnn_benchmark" / f"{name}.npz") as z:
        z = dict(z)
    adj = sp.csr_matrix((z["adj_data"], z["adj_indices"], z["adj_indptr"]), shape=z["adj_shape"])
    attr = sp.csr_matrix(
        (z["attr_data"], z["attr_indices"], z["attr_indptr"]), shape=z["attr_shape"]
    )
    # Undirected edges: symmetrise, drop the diagonal, count the upper triangle.
    undirected = sp.triu((adj + adj.T) > 0, k=1).nnz
    return {
        "attr": attr.toarray(),
        "labels": z["labels"].astype(np.int64),
        "class_names": z["class_names"].tolist(),
        "node_names": z["node_names"].tolist(),
        "undirected": undirected,
    }


def raw_planetoid(root: Path, name: str) -> dict:
    def part(p):
        with open(root / "planetoid" / f"ind.{name}.{p}", "rb") as f:
            return pickle.load(f, encoding="latin1")

    graph = part("graph")
    pairs = {(min(a, b), max(a, b)) for a, nbrs in graph.items() for b in nbrs if a != b}
    test_index = np.loadtxt(root / "planetoid" / f"ind.{name}.test.index", dtype=np.int64)
    ally, ty = part("ally"), part("ty")
    n = max(ally.shape[0], int(test_index.max()) + 1)
    y = np.zeros(n, dtype=np.int64)
    y[: ally.shape[0]] = ally.argmax(1)
    y[test_index] = ty.argmax(1)
    allx, tx = part("allx").toarray(), part("tx").toarray()
    x = np.zeros((n, allx.shape[1]), dtype=np.float32)
    x[: allx.shape[0]] = allx
    x[test_index] = tx
    return {
        "n": n,
        "undirected": len(pairs),
        "y": y,
        "x": x,
        "placeholders": n - ally.shape[0] - test_index.size,
    }


def assert_clean(graph) -> None:
    """Undirected (both directions), coalesced, no self loops."""
    ei = graph.edge_index
    assert ei.dtype == torch.long and ei.size(0) == 2
    assert not (ei[0] == ei[1]).any()
    fwd = set(map(tuple, ei.t().tolist()))
    assert len(fwd) == ei.size(1)
    assert fwd == {(b, a) for a, b in fwd}


def counts_by_name(graph) -> dict[str, int]:
    return dict(
        zip(
            graph.class_names,
            torch.bincount(graph.y, minlength=graph.num_classes).tolist(),
            strict=True,
        )
    )


# ------------------------------------------------------------------------------------------
# real data


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_npz_matches_raw(graphs, root, name):
    g, raw = graphs[(name, "npz")], raw_npz(root, name)
    assert g.num_nodes == raw["labels"].size
    assert g.num_edges == raw["undirected"]
    assert g.class_names == raw["class_names"]
    assert g.node_ids == raw["node_names"]
    assert torch.equal(g.y, torch.from_numpy(raw["labels"]))
    assert g.features["bow"].dtype == torch.float32
    assert np.array_equal(g.features["bow"].numpy(), raw["attr"])
    assert_clean(g)


@pytest.mark.parametrize(
    "name, nodes, classes, placeholders", [("cora", 2708, 7, 0), ("citeseer", 3327, 6, 15)]
)
def test_planetoid_matches_raw(graphs, root, name, nodes, classes, placeholders):
    g, raw = graphs[(name, "planetoid")], raw_planetoid(root, name)
    assert g.num_nodes == raw["n"] == nodes
    assert g.num_classes == classes
    assert raw["placeholders"] == placeholders
    assert g.num_edges == raw["undirected"]
    assert torch.equal(g.y, torch.from_numpy(raw["y"]))
    assert np.array_equal(g.features["bow"].numpy(), raw["x"])
    assert g.node_ids is None
    assert_clean(g)


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_planetoid_agrees_with_pyg_reader(graphs, root, name):
    from torch_geometric.io import read_planetoid_data
    from torch_geometric.utils import coalesce

    d = read_planetoid_data(str(root / "planetoid"), name)
    g = graphs[(name, "planetoid")]
    assert torch.equal(g.features["bow"], d.x)
    assert torch.equal(g.y, d.y)
    assert torch.equal(g.edge_index, coalesce(d.edge_index))


def test_cora_sources_agree_on_label_distribution(graphs):
    # The two sources number the classes differently; by name they must agree.
    assert counts_by_name(graphs[("cora", "planetoid")]) == counts_by_name(graphs[("cora", "npz")])
    assert graphs[("cora", "planetoid")].num_edges == graphs[("cora", "npz")].num_edges == 5278


def test_citeseer_sources_agree_up_to_placeholders(graphs, root):
    raw = counts_by_name(graphs[("citeseer", "planetoid")])
    npz = counts_by_name(graphs[("citeseer", "npz")])
    # The 15 feature-less placeholder nodes of the raw files carry label 0 (AI), as in PyG.
    raw["AI"] -= raw_planetoid(root, "citeseer")["placeholders"]
    assert raw == npz


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_planetoid_class_names_match_npz_by_features(graphs, name):
    """Each node's class name agrees with the npz node that has the identical word vector."""
    raw, npz = graphs[(name, "planetoid")], graphs[(name, "npz")]
    rows = collections.defaultdict(list)
    for i, r in enumerate(npz.features["bow"].numpy().astype(bool)):
        rows[r.tobytes()].append(i)
    checked = 0
    for i, r in enumerate(raw.features["bow"].numpy().astype(bool)):
        match = rows.get(r.tobytes(), [])
        if len(match) == 1:
            assert raw.class_names[raw.y[i]] == npz.class_names[npz.y[match[0]]]
            checked += 1
    assert checked > 0.95 * npz.num_nodes


def test_citeseer_mm_matches_raw(graphs, root):
    g = graphs["citeseer_mm"]
    tape = root / "citeseer_tape"
    ids = json.loads((tape / "citeseer_minilm_ids.json").read_text())
    # From the data README.
    readme_counts = {"DB": 685, "IR": 641, "ML": 569, "Agents": 562, "HCI": 490, "AI": 239}
    assert g.name == "citeseer_mm"
    assert g.num_nodes == len(ids) == 3186
    assert g.node_ids == ids
    assert g.class_names == ["AI", "Agents", "DB", "HCI", "IR", "ML"]
    assert counts_by_name(g) == readme_counts

    lines = (tape / "citeseer_texts.txt").read_text(encoding="utf-8").split("\n")
    label = {lines[i].strip(): lines[i + 2].strip() for i in range(0, len(lines) - 2, 3)}
    assert [g.class_names[c] for c in g.y.tolist()] == [label[i] for i in ids]

    idset = set(ids)
    cites = [ln.split() for ln in (tape / "citeseer.cites").read_text().splitlines() if ln.strip()]
    inside = [(a, b) for a, b in cites if a in idset and b in idset]
    assert len(inside) == 4397  # README: 4,397 lines with both ends among the papers
    assert g.num_edges == len({tuple(sorted(p)) for p in inside if p[0] != p[1]})
    assert_clean(g)

    text = np.load(tape / "citeseer_minilm.npy")
    assert g.features["text"].dtype == torch.float32
    assert np.array_equal(g.features["text"].numpy(), text)
    npz = raw_npz(root, "citeseer")
    row_of = {n: i for i, n in enumerate(npz["node_names"])}
    assert np.array_equal(g.features["bow"].numpy(), npz["attr"][[row_of[i] for i in ids]])
    assert g.mask.all()


# ------------------------------------------------------------------------------------------
# data root and arguments


def test_data_root_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(tmp_path))
    assert data_root() == tmp_path
    assert data_root(tmp_path / "..") == tmp_path / ".."
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="FEDLIGHTNING_DATA") as e:
        data_root(missing)
    assert str(missing) in str(e.value)
    monkeypatch.setenv("FEDLIGHTNING_DATA", str(missing))
    with pytest.raises(DataError, match="nope"):
        data_root()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="name"):
        load_planetoid("pubmed", root=tmp_path)
    with pytest.raises(ValueError, match="source"):
        load_planetoid("cora", source="csv", root=tmp_path)


def test_missing_subdirectory_is_named(tmp_path):
    with pytest.raises(DataError, match="planetoid"):
        load_planetoid("cora", "planetoid", tmp_path)
    with pytest.raises(DataError, match="gnn_benchmark"):
        load_planetoid("cora", "npz", tmp_path)
    with pytest.raises(DataError, match="citeseer_tape"):
        load_citeseer_mm(tmp_path)


# ------------------------------------------------------------------------------------------
# broken files: always a DataError that names the file


def _link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """Mirror src's data folders into dst with symlinks (cheap), leaving out ``skip``."""
    for sub in ("planetoid", "gnn_benchmark", "citeseer_tape"):
        (dst / sub).mkdir(parents=True)
        for f in (src / sub).iterdir():
            if f.name not in skip:
                (dst / sub / f.name).symlink_to(f)


def _rewrite_npz(root: Path, tmp: Path, name: str, **changes) -> None:
    with np.load(root / "gnn_benchmark" / f"{name}.npz") as z:
        arrays = dict(z)
    for k, v in changes.items():
        if v is None:
            del arrays[k]
        else:
            arrays[k] = v
    target = tmp / "gnn_benchmark" / f"{name}.npz"
    target.unlink(missing_ok=True)
    np.savez(target, **arrays)


def test_truncated_npz(root, tmp_path):
    _link_tree(root, tmp_path, skip=("cora.npz",))
    (tmp_path / "gnn_benchmark" / "cora.npz").write_bytes(
        (root / "gnn_benchmark" / "cora.npz").read_bytes()[:100]
    )
    with pytest.raises(DataError, match=r"cora\.npz"):
        load_planetoid("cora", "npz", tmp_path)


def test_npz_missing_file(root, tmp_path):
    _link_tree(root, tmp_path, skip=("cora.npz",))
    with pytest.raises(DataError, match=r"cora\.npz"):
        load_planetoid("cora", "npz", tmp_path)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"labels": None}, "labels"),
        ({"labels": np.full(2708, 7, dtype=np.int8)}, "labels"),
        ({"labels": np.zeros(2707, dtype=np.int8)}, "labels"),
        ({"attr_shape": np.array([2700, 1433])}, "attr_shape"),
        ({"adj_indices": np.full(5429, 9999, dtype=np.int32)}, "adj_indices"),
        ({"node_names": np.array(["a", "b"])}, "node_names"),
    ],
)
def test_malformed_npz(root, tmp_path, change, field):
    _link_tree(root, tmp_path, skip=("cora.npz",))
    _rewrite_npz(root, tmp_path, "cora", **change)
    with pytest.raises(DataError, match=field) as e:
        load_planetoid("cora", "npz", tmp_path)
    assert "cora.npz" in str(e.value)


@pytest.mark.parametrize("part", ["graph", "allx", "ty", "test.index"])
def test_missing_planetoid_file(root, tmp_path, part):
    _link_tree(root, tmp_path, skip=(f"ind.cora.{part}",))
    with pytest.raises(DataError, match=f"ind.cora.{part}"):
        load_planetoid("cora", "planetoid", tmp_path)


@pytest.mark.parametrize("part", ["graph", "allx", "y"])
def test_truncated_planetoid_file(root, tmp_path, part):
    _link_tree(root, tmp_path, skip=(f"ind.cora.{part}",))
    raw = (root / "planetoid" / f"ind.cora.{part}").read_bytes()
    (tmp_path / "planetoid" / f"ind.cora.{part}").write_bytes(raw[:100])
    with pytest.raises(DataError, match=f"ind.cora.{part}"):
        load_planetoid("cora", "planetoid", tmp_path)


class _Sneaky:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_planetoid_pickle_with_foreign_code_is_refused(root, tmp_path, capsys):
    _link_tree(root, tmp_path, skip=("ind.cora.graph",))
    (tmp_path / "planetoid" / "ind.cora.graph").write_bytes(pickle.dumps(_Sneaky(), protocol=2))
    with pytest.raises(DataError, match=r"ind\.cora\.graph.*refusing"):
        load_planetoid("cora", "planetoid", tmp_path)
    assert "must never run" not in capsys.readouterr().out


def test_planetoid_inconsistent_rows(root, tmp_path):
    _link_tree(root, tmp_path, skip=("ind.cora.ty",))
    ty = pickle.loads((root / "planetoid" / "ind.cora.ty").read_bytes(), encoding="latin1")
    (tmp_path / "planetoid" / "ind.cora.ty").write_bytes(pickle.dumps(ty[:-1], protocol=2))
    with pytest.raises(DataError, match=r"ind\.cora\.ty.*1000 rows"):
        load_planetoid("cora", "planetoid", tmp_path)


def test_citeseer_mm_id_missing_from_npz(root, tmp_path):
    _link_tree(root, tmp_path, skip=("citeseer.npz",))
    with np.load(root / "gnn_benchmark" / "citeseer.npz") as z:
        names = z["node_names"].copy()
    first_id = json.loads((root / "citeseer_tape" / "citeseer_minilm_ids.json").read_text())[0]
    names[names == first_id] = "renamed"
    _rewrite_npz(root, tmp_path, "citeseer", node_names=names)
    with pytest.raises(DataError, match="citeseer.npz") as e:
        load_citeseer_mm(tmp_path)
    assert first_id in str(e.value)


def test_citeseer_mm_texts_without_a_record(root, tmp_path):
    _link_tree(root, tmp_path, skip=("citeseer_texts.txt",))
    lines = (root / "citeseer_tape" / "citeseer_texts.txt").read_text(encoding="utf-8").split("\n")
    dropped = lines[0]
    (tmp_path / "citeseer_tape" / "citeseer_texts.txt").write_text("\n".join(lines[3:]) + "\n")
    with pytest.raises(DataError, match="citeseer_texts.txt") as e:
        load_citeseer_mm(tmp_path)
    assert dropped in str(e.value)


def test_citeseer_mm_texts_out_of_step(root, tmp_path):
    _link_tree(root, tmp_path, skip=("citeseer_texts.txt",))
    lines = (root / "citeseer_tape" / "citeseer_texts.txt").read_text(encoding="utf-8").split("\n")
    del lines[4]  # the second record loses its text line: every record after it shifts
    lines.insert(9, "extra text line")
    (tmp_path / "citeseer_tape" / "citeseer_texts.txt").write_text("\n".join(lines))
    with pytest.raises(DataError, match=r"citeseer_texts\.txt.*line \d+"):
        load_citeseer_mm(tmp_path)


def test_citeseer_mm_embeddings_wrong_shape(root, tmp_path):
    _link_tree(root, tmp_path, skip=("citeseer_minilm.npy",))
    np.save(tmp_path / "citeseer_tape" / "citeseer_minilm.npy", np.zeros((10, 384), np.float32))
    with pytest.raises(DataError, match=r"citeseer_minilm\.npy.*3186"):
        load_citeseer_mm(tmp_path)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_planetoid_files_repickled_by_python3_load(root, tmp_path, protocol, graphs):
    _link_tree(root, tmp_path, skip=tuple(f"ind.cora.{p}" for p in ("allx", "ally", "graph")))
    for p in ("allx", "ally", "graph"):
        obj = pickle.loads((root / "planetoid" / f"ind.cora.{p}").read_bytes(), encoding="latin1")
        (tmp_path / "planetoid" / f"ind.cora.{p}").write_bytes(pickle.dumps(obj, protocol=protocol))
    g = load_planetoid("cora", "planetoid", tmp_path)
    ref = graphs[("cora", "planetoid")]
    assert torch.equal(g.features["bow"], ref.features["bow"])
    assert torch.equal(g.edge_index, ref.edge_index)
    assert torch.equal(g.y, ref.y)
