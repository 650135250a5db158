"""The folder format: round trips, hand-written folders and every kind of broken file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlightning.data.graphs import MultimodalGraph, load_folder, make_synthetic, save_folder
from fedlightning.data.graphs.folder import FolderExistsError
from fedlightning.errors import ConfigError, DataError

N = 6


def write_small(folder: Path) -> Path:
    """A hand-written 6-node folder using the CSV variants, masks and all optional files."""
    (folder / "features").mkdir(parents=True)
    (folder / "masks").mkdir()
    # Directed, duplicated, one self loop (4,4) and one pair in both directions (0,1)/(1,0).
    (folder / "edges.csv").write_text("src,dst\n0,1\n1,0\n1,2\n1,2\n\n2,3\n4,4\n3,5\n")
    (folder / "labels.csv").write_text("label\n0\n1\n1\n2\n0\n2\n")
    rng = np.random.default_rng(0)
    np.save(folder / "features" / "text.npy", rng.standard_normal((N, 4)).astype(np.float64))
    np.save(folder / "features" / "image.npy", np.arange(N * 3).reshape(N, 3).astype(np.int32))
    np.save(folder / "masks" / "image.npy", np.array([1, 1, 0, 1, 0, 1], dtype=np.int8))
    (folder / "class_names.json").write_text(json.dumps(["a", "b", "c"]))
    (folder / "node_ids.json").write_text(json.dumps([f"n{i}" for i in range(N)]))
    (folder / "meta.json").write_text(json.dumps({"name": "small"}))
    return folder


def write_npy_variant(folder: Path) -> Path:
    """The minimal folder with the .npy variants and no optional files."""
    (folder / "features").mkdir(parents=True)
    np.save(folder / "edge_index.npy", np.array([[0, 1, 2], [1, 2, 3]]))
    np.save(folder / "labels.npy", np.array([0, 1, 0, 1, 0, 1]))
    np.save(folder / "features" / "text.npy", np.ones((N, 2), dtype=np.float32))
    return folder


def test_hand_written_folder(tmp_path):
    g = load_folder(write_small(tmp_path / "ds"))
    assert g.name == "small"
    assert g.modalities == ["image", "text"]  # sorted file names
    assert g.num_nodes == N
    # Undirected pairs by hand: {0,1}, {1,2}, {2,3}, {3,5}; the self loop is dropped.
    pairs = {tuple(sorted(p)) for p in g.edge_index.t().tolist()}
    assert pairs == {(0, 1), (1, 2), (2, 3), (3, 5)}
    assert g.num_edges == 4
    assert g.y.tolist() == [0, 1, 1, 2, 0, 2]
    assert g.class_names == ["a", "b", "c"]
    assert g.node_ids == [f"n{i}" for i in range(N)]
    assert g.mask[:, 0].tolist() == [True, True, False, True, False, True]
    assert g.mask[:, 1].all()
    image = g.features["image"]
    assert image.dtype == torch.float32
    assert image[[2, 4]].abs().sum() == 0  # unavailable rows zeroed
    assert image[3].tolist() == [9.0, 10.0, 11.0]
    assert g.features["text"].dtype == torch.float32


def test_npy_variant_and_defaults(tmp_path):
    g = load_folder(write_npy_variant(tmp_path / "mygraph"))
    assert g.name == "mygraph"  # folder name without meta.json
    assert g.class_names == ["class_0", "class_1"]
    assert g.node_ids is None
    assert g.mask.all()
    assert g.num_edges == 3
    assert load_folder(tmp_path / "mygraph", name="other").name == "other"


def test_round_trip_synthetic_with_missing(tmp_path):
    g = make_synthetic(num_nodes=200, num_classes=4, missing_rate=0.3, seed=3)
    g = MultimodalGraph(
        g.name,
        g.features,
        g.mask,
        g.edge_index,
        g.y,
        g.class_names,
        node_ids=[f"p{i}" for i in range(g.num_nodes)],
    )
    save_folder(g, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "masks").iterdir()) == [
        "image.npy",
        "text.npy",
    ]
    h = load_folder(tmp_path / "out")
    assert h.name == g.name
    assert set(h.modalities) == set(g.modalities)
    for m in g.modalities:
        assert torch.equal(h.features[m], g.features[m])
        assert torch.equal(h.mask[:, h.modalities.index(m)], g.mask[:, g.modalities.index(m)])
    assert torch.equal(h.edge_index, g.edge_index)
    assert torch.equal(h.y, g.y)
    assert h.class_names == g.class_names
    assert h.node_ids == g.node_ids
    assert h.fingerprint() == load_folder(tmp_path / "out").fingerprint()


def test_round_trip_without_masks(tmp_path):
    g = make_synthetic(num_nodes=50, num_classes=2, modalities={"a": 3}, seed=1)
    save_folder(g, tmp_path / "out")
    assert not (tmp_path / "out" / "masks").exists()
    h = load_folder(tmp_path / "out")
    assert torch.equal(h.features["a"], g.features["a"]) and torch.equal(h.edge_index, g.edge_index)


def test_save_refuses_non_empty_folder(tmp_path):
    g = make_synthetic(num_nodes=20, num_classes=2, seed=0)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(FolderExistsError, match="full") as e:
        save_folder(g, tmp_path / "full")
    assert isinstance(e.value, DataError) and isinstance(e.value, FileExistsError)
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FolderExistsError):
        save_folder(g, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    save_folder(g, tmp_path / "empty")  # an empty existing folder is fine
    assert load_folder(tmp_path / "empty").num_nodes == 20


def test_save_refuses_unsafe_modality_name(tmp_path):
    g = make_synthetic(num_nodes=20, num_classes=2, modalities={"../x": 2}, seed=0)
    with pytest.raises(ValueError, match="modality"):
        save_folder(g, tmp_path / "out")


def _npy(path: Path, arr) -> None:
    np.save(path, arr)


# (mutation of the small folder, file named in the message, other text expected)
BROKEN = {
    "missing labels": (lambda f: (f / "labels.csv").unlink(), "labels.npy", "labels.csv"),
    "both label files": (lambda f: _npy(f / "labels.npy", np.zeros(N, int)), "ds", "keep one"),
    "labels.csv bad line": (
        lambda f: (f / "labels.csv").write_text("label\n0\n1\nx\n2\n0\n2\n"),
        "labels.csv",
        "line 4",
    ),
    "negative label": (
        lambda f: (f / "labels.csv").write_text("0\n1\n-1\n2\n0\n2\n"),
        "labels.csv",
        ">= 0",
    ),
    "label out of range": (
        lambda f: (f / "labels.csv").write_text("0\n1\n3\n2\n0\n2\n"),
        "labels.csv",
        "0..2",
    ),
    "labels wrong N": (
        lambda f: (f / "labels.csv").write_text("0\n1\n1\n2\n0\n"),
        "image.npy",
        "[5, d]",
    ),
    "labels.npy 2-D": (
        lambda f: ((f / "labels.csv").unlink(), _npy(f / "labels.npy", np.zeros((N, 1), int))),
        "labels.npy",
        "1-D integer",
    ),
    "labels.npy float": (
        lambda f: ((f / "labels.csv").unlink(), _npy(f / "labels.npy", np.zeros(N))),
        "labels.npy",
        "integer",
    ),
    "features 1-D": (lambda f: _npy(f / "features" / "text.npy", np.zeros(N)), "text.npy", "2-D"),
    "features wrong rows": (
        lambda f: _npy(f / "features" / "text.npy", np.zeros((N + 1, 2))),
        "text.npy",
        "[6, d]",
    ),
    "features NaN": (
        lambda f: _npy(f / "features" / "text.npy", np.where(np.eye(N, 2) > 0, np.nan, 0.0)),
        "text.npy",
        "NaN",
    ),
    "features strings": (
        lambda f: _npy(f / "features" / "text.npy", np.full((N, 2), "a")),
        "text.npy",
        "dtype",
    ),
    "features object": (
        lambda f: np.save(
            f / "features" / "text.npy", np.full((N, 2), None, dtype=object), allow_pickle=True
        ),
        "text.npy",
        "readable",
    ),
    "features truncated": (
        lambda f: (f / "features" / "text.npy").write_bytes(
            (f / "features" / "text.npy").read_bytes()[:50]
        ),
        "text.npy",
        "readable",
    ),
    "features none": (
        lambda f: [p.unlink() for p in (f / "features").iterdir()],
        "features",
        "at least one",
    ),
    "features dir missing": (
        lambda f: (
            [p.rename(f / p.name) for p in (f / "features").iterdir()] and (f / "features").rmdir()
        ),
        "features",
        "directory missing",
    ),
    "features stray file": (
        lambda f: (f / "features" / "notes.txt").write_text("x"),
        "features",
        "notes.txt",
    ),
    "edges missing": (lambda f: (f / "edges.csv").unlink(), "edge_index.npy", "edges.csv"),
    "edges out of range": (
        lambda f: (f / "edges.csv").write_text("0,1\n2,6\n"),
        "edges.csv",
        "0..5",
    ),
    "edges negative": (lambda f: (f / "edges.csv").write_text("0,-1\n"), "edges.csv", "0..5"),
    "edges.csv bad line": (
        lambda f: (f / "edges.csv").write_text("src,dst\n0,1\n1;2\n"),
        "edges.csv",
        "line 3",
    ),
    "edges.csv three columns": (
        lambda f: (f / "edges.csv").write_text("0,1\n1,2,3\n"),
        "edges.csv",
        "line 2",
    ),
    "edge_index transposed": (
        lambda f: ((f / "edges.csv").unlink(), _npy(f / "edge_index.npy", np.zeros((5, 2), int))),
        "edge_index.npy",
        "transpose",
    ),
    "edge_index float": (
        lambda f: ((f / "edges.csv").unlink(), _npy(f / "edge_index.npy", np.zeros((2, 5)))),
        "edge_index.npy",
        r"\[2, E\]",
    ),
    "mask wrong length": (
        lambda f: _npy(f / "masks" / "image.npy", np.ones(N - 1, bool)),
        "image.npy",
        r"\(6,\)",
    ),
    "mask not 0/1": (lambda f: _npy(f / "masks" / "image.npy", np.full(N, 2)), "image.npy", "0/1"),
    "mask unknown modality": (
        lambda f: _npy(f / "masks" / "audio.npy", np.ones(N, bool)),
        "audio.npy",
        "modalities",
    ),
    "class_names not a list": (
        lambda f: (f / "class_names.json").write_text('{"a": 1}'),
        "class_names.json",
        "list",
    ),
    "class_names bad json": (
        lambda f: (f / "class_names.json").write_text('["a", '),
        "class_names.json",
        "JSON",
    ),
    "class_names duplicated": (
        lambda f: (f / "class_names.json").write_text('["a", "a", "b"]'),
        "class_names.json",
        "distinct",
    ),
    "node_ids wrong length": (
        lambda f: (f / "node_ids.json").write_text('["a"]'),
        "node_ids.json",
        "6 node ids",
    ),
    "node_ids not strings": (
        lambda f: (f / "node_ids.json").write_text(json.dumps(list(range(N)))),
        "node_ids.json",
        "strings",
    ),
    "meta name not a string": (
        lambda f: (f / "meta.json").write_text('{"name": 3}'),
        "meta.json",
        "name",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_folder_raises_data_error_naming_file(tmp_path, case):
    mutate, filename, text = BROKEN[case]
    folder = write_small(tmp_path / "ds")
    mutate(folder)
    with pytest.raises(DataError, match=text) as e:
        load_folder(folder)
    assert filename in str(e.value)


def test_missing_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist") as e:
        load_folder(tmp_path / "absent")
    assert "absent" in str(e.value)


def test_empty_edge_list_is_allowed(tmp_path):
    folder = write_small(tmp_path / "ds")
    (folder / "edges.csv").write_text("src,dst\n")
    g = load_folder(folder)
    assert g.num_edges == 0 and tuple(g.edge_index.shape) == (2, 0)


# ------------------------------------------------------------------------------------------
# named edge columns, headers, class-name labels


def test_edges_named_columns_in_any_order(tmp_path):
    folder = write_small(tmp_path / "ds")
    # A weight column before the ends and the ends swapped: (dst=1, src=0) is edge {0, 1}.
    (folder / "edges.csv").write_text("weight,to,from\n0.5,1,0\n1.5,2,1\nx,5,3\n")
    g = load_folder(folder, src_column="from", dst_column="to")
    assert {tuple(sorted(p)) for p in g.edge_index.t().tolist()} == {(0, 1), (1, 2), (3, 5)}
    # Names are matched exactly, else ignoring case; positions are 0-based.
    assert torch.equal(
        load_folder(folder, src_column="FROM", dst_column="To").edge_index, g.edge_index
    )
    assert torch.equal(load_folder(folder, src_column=2, dst_column=1).edge_index, g.edge_index)


def test_edges_header_detected_or_not(tmp_path):
    folder = write_small(tmp_path / "ds")
    # Any header names: line 1 is a header because its edge columns are not integers.
    (folder / "edges.csv").write_text("a,b\n0,1\n2,3\n")
    assert load_folder(folder).num_edges == 2
    # No header: the first line is an edge, and a third column of any content is ignored.
    (folder / "edges.csv").write_text("0,1,0.25\n2,3,note\n")
    pairs = {tuple(sorted(p)) for p in load_folder(folder).edge_index.t().tolist()}
    assert pairs == {(0, 1), (2, 3)}
    # Header only: no edges.
    (folder / "edges.csv").write_text("from,to\n")
    assert load_folder(folder, src_column="from", dst_column="to").num_edges == 0


def test_class_name_labels_sorted(tmp_path):
    folder = write_small(tmp_path / "ds")
    (folder / "class_names.json").unlink()
    (folder / "labels.csv").write_text('label\nML\nAI\nIR\n"AI"\nML\nIR\n')
    g = load_folder(folder)
    assert g.class_names == ["AI", "IR", "ML"]  # sorted names -> ids 0, 1, 2
    assert g.y.tolist() == [2, 0, 1, 0, 2, 1]
    save_folder(g, tmp_path / "out")  # the mapping is written out with the graph
    assert json.loads((tmp_path / "out" / "class_names.json").read_text()) == ["AI", "IR", "ML"]
    assert load_folder(tmp_path / "out").y.tolist() == g.y.tolist()


def test_class_name_labels_follow_class_names_json(tmp_path):
    folder = write_small(tmp_path / "ds")
    (folder / "class_names.json").write_text(json.dumps(["ML", "IR", "AI", "DB"]))
    (folder / "labels.csv").write_text("ML\nAI\nIR\nAI\nML\nIR\n")
    g = load_folder(folder)
    assert g.class_names == ["ML", "IR", "AI", "DB"]  # DB has no node: a class all the same
    assert g.y.tolist() == [0, 2, 1, 2, 0, 1]


def test_class_name_labels_npy_and_numeric_names(tmp_path):
    folder = write_npy_variant(tmp_path / "ds")
    np.save(folder / "labels.npy", np.array(["b", "a", "b", "c", "a", "a"]))
    g = load_folder(folder)
    assert g.class_names == ["a", "b", "c"] and g.y.tolist() == [1, 0, 1, 2, 0, 0]
    # Years read as names (sorted as strings), not as class ids.
    np.save(folder / "labels.npy", np.array([2001, 1999, 2001, 2010, 1999, 1999]))
    g = load_folder(folder, labels_as="names")
    assert g.class_names == ["1999", "2001", "2010"] and g.y.tolist() == [1, 0, 1, 2, 0, 0]


# (labels.csv text, labels_as, text expected in the message)
BAD_LABELS = {
    "name after ids": ("0\n1\nAI\n2\n0\n2\n", "auto", "line 3"),
    "id after names": ("AI\nML\n3\nAI\nML\nAI\n", "auto", "line 3"),
    "name under ids": ("AI\nML\nAI\nML\nAI\nML\n", "ids", "integer class id"),
    "two fields": ("a,b\nc\nd\ne\nf\ng\n", "auto", "one label per line"),
    "empty name": ('a\n""\nb\na\nb\na\n', "names", "non-empty"),
    "name not in class_names.json": ("a\nb\nc\nzz\na\nb\n", "auto", "'zz'"),
}


@pytest.mark.parametrize("case", list(BAD_LABELS))
def test_bad_labels_name_file_line_and_field(tmp_path, case):
    text, labels_as, expected = BAD_LABELS[case]
    folder = write_small(tmp_path / "ds")  # class_names.json: a, b, c
    (folder / "labels.csv").write_text(text)
    with pytest.raises(DataError, match=expected) as e:
        load_folder(folder, labels_as=labels_as)
    msg = str(e.value)
    assert "labels.csv" in msg and "label" in msg and "\n" not in msg


# (edges.csv text, keyword arguments, error type, text expected in the message)
BAD_EDGES = {
    "unknown column": (
        "from,to\n0,1\n",
        {"src_column": "src", "dst_column": "to"},
        DataError,
        "'src'",
    ),
    "position past the end": ("0,1\n", {"src_column": 2}, ConfigError, "dataset.src_column"),
    "same column": ("0,1\n", {"src_column": 1}, ConfigError, "dataset.dst_column"),
    "not an integer": (
        "w,from,to\n0.5,0,1\n0.5,x,2\n",
        {"src_column": "from", "dst_column": "to"},
        DataError,
        "line 3: field `from` (column 2)",
    ),
    "one column": ("0\n1\n", {}, DataError, "at least 2"),
    "bad type": ("0,1\n", {"src_column": 1.5}, ConfigError, "dataset.src_column"),
}


@pytest.mark.parametrize("case", list(BAD_EDGES))
def test_bad_edge_columns(tmp_path, case):
    text, kw, err, expected = BAD_EDGES[case]
    folder = write_small(tmp_path / "ds")
    (folder / "edges.csv").write_text(text)
    with pytest.raises(err, match=re.escape(expected)) as e:
        load_folder(folder, **kw)
    assert "\n" not in str(e.value)
    if err is DataError:
        assert "edges.csv" in str(e.value)


def test_edge_columns_refused_for_edge_index_npy(tmp_path):
    with pytest.raises(ConfigError, match="dataset.src_column"):
        load_folder(write_npy_variant(tmp_path / "ds"), src_column="a", dst_column="b")


def test_bad_labels_as():
    with pytest.raises(ConfigError, match="dataset.labels_as"):
        load_folder(Path(__file__).parent, labels_as="strings")


def test_folder_config_passes_the_keys(tmp_path, compose):
    from hydra.utils import instantiate

    from fedlightning.config import dataset_node

    folder = write_small(tmp_path / "ds")
    (folder / "edges.csv").write_text("to,from\n1,0\n")
    cfg = compose(
        [
            "dataset=folder",
            f"dataset.path={folder}",
            "dataset.src_column=from",
            "dataset.dst_column=to",
        ]
    )
    node, taken = dataset_node(cfg)  # the loader's arguments, as the trainer builds them
    assert node["labels_as"] == "auto" and taken["display_name"] == "small"  # meta.json's
    assert instantiate(node).num_edges == 1


# --- sparse modalities: features/<m>.npz ---------------------------------------------------


def _bag_of_words_graph(sparse: bool) -> MultimodalGraph:
    return make_synthetic(num_nodes=120, num_classes=3, modalities={"text": 4},
                          multi_hot={"words": 60}, density=0.1, missing_rate=0.3, seed=1,
                          sparse=sparse)  # fmt: skip


def test_sparse_modality_round_trip_stays_sparse_and_equals_dense(tmp_path):
    g = _bag_of_words_graph(sparse=True)
    dense = _bag_of_words_graph(sparse=False)
    words = g.features["words"]
    assert words.layout == torch.sparse_coo and words.is_coalesced()
    assert torch.equal(words.to_dense(), dense.features["words"])  # the same draws
    hidden = ~g.mask[:, g.modalities.index("words")]
    assert hidden.any() and words.to_dense()[hidden].abs().sum() == 0  # missing rows are empty
    save_folder(g, tmp_path / "out")
    assert (tmp_path / "out" / "features" / "words.npz").exists()
    import scipy.sparse

    stored = scipy.sparse.load_npz(tmp_path / "out" / "features" / "words.npz")
    assert stored.format == "csr" and stored.nnz == words._nnz()
    h = load_folder(tmp_path / "out")
    assert h.features["words"].layout == torch.sparse_coo
    assert torch.equal(h.features["words"].to_dense(), dense.features["words"])
    assert torch.equal(h.features["text"], g.features["text"])
    sub = h.subgraph(torch.tensor([5, 1, 7]))  # row selection keeps it sparse
    assert sub.features["words"].layout == torch.sparse_coo
    assert torch.equal(sub.features["words"].to_dense(), dense.features["words"][[1, 5, 7]])


def test_a_hand_written_npz_with_a_mask_and_duplicates(tmp_path):
    import scipy.sparse

    folder = write_npy_variant(tmp_path / "f")
    rows, cols, vals = [0, 0, 2, 5, 5], [1, 1, 0, 3, 2], [1.0, 2.0, 4.0, 1.0, 1.0]
    m = scipy.sparse.coo_matrix((vals, (rows, cols)), shape=(N, 4))  # (0, 1) twice: summed
    scipy.sparse.save_npz(folder / "features" / "bow.npz", m)
    (folder / "masks").mkdir()
    np.save(folder / "masks" / "bow.npy", np.array([1, 1, 1, 1, 1, 0], dtype=bool))
    g = load_folder(folder)
    expected = torch.zeros(N, 4)
    expected[0, 1], expected[2, 0] = 3.0, 4.0  # node 5 is masked: its words are dropped
    assert g.modalities == ["bow", "text"]
    assert torch.equal(g.features["bow"].to_dense(), expected)


@pytest.mark.parametrize(
    ("write", "pattern"),
    [
        (lambda f: (f / "features" / "bow.npz").write_bytes(b"PK\x03\x04broken"),
         r"bow\.npz: not a readable SciPy sparse matrix"),
        (lambda f: np.savez(f / "features" / "bow.npz", a=np.ones(3)),
         r"bow\.npz: not a readable SciPy sparse matrix"),
        (lambda f: __import__("scipy.sparse").sparse.save_npz(
            f / "features" / "bow.npz", __import__("scipy.sparse").sparse.csr_matrix(np.ones((N + 1, 2)))),
         r"bow\.npz: field `features` of modality 'bow': expected a 2-D matrix \[6, d\]"),
        (lambda f: __import__("scipy.sparse").sparse.save_npz(
            f / "features" / "bow.npz", __import__("scipy.sparse").sparse.csr_matrix(
                np.array([[0, np.nan]] * 3 + [[1, 0]] * 3))),
         r"expected finite values, found NaN or inf in 3 row\(s\), first row 0"),
        (lambda f: (f / "features" / "text.npz").write_bytes(b""),
         r"modality 'text' is given twice \(\.npy and \.npz\)"),
    ],
)  # fmt: skip
def test_bad_sparse_modality_is_named(tmp_path, write, pattern):
    folder = write_npy_variant(tmp_path / "f")
    write(folder)
    with pytest.raises(DataError, match=pattern):
        load_folder(folder)
