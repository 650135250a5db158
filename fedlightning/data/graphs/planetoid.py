"""Cora and CiteSeer, from the raw Planetoid files or the gnn-benchmark ``.npz`` files; the
data-directory lookup and the ``.npz`` reader that ``citeseer_mm`` shares."""

from __future__ import annotations

import codecs
import collections
import os
import pickle
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedlightning.data.files import require_dir, require_file
from fedlightning.data.graphs.base import MultimodalGraph, clean_edges, full_mask
from fedlightning.errors import DataError

if TYPE_CHECKING:
    import scipy.sparse as sp

try:  # numpy >= 2 moved the pickling helpers to numpy._core
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
    from numpy._core.numeric import _frombuffer as _np_frombuffer
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct as _np_reconstruct
    from numpy.core.numeric import _frombuffer as _np_frombuffer

__all__ = ["data_root", "load_planetoid", "read_gnn_benchmark_npz", "GnnBenchmarkNpz"]

#: The environment variable naming the data directory.
DATA_ENV = "FEDLIGHTNING_DATA"

# Class names of the raw Planetoid label columns (the files carry none), found by matching
# each node's word vector with the named gnn-benchmark npz files (docs/datasets.md).
PLANETOID_CLASS_NAMES = {
    "cora": [
        "Theory",
        "Reinforcement_Learning",
        "Genetic_Algorithms",
        "Neural_Networks",
        "Probabilistic_Methods",
        "Case_Based",
        "Rule_Learning",
    ],
    "citeseer": ["AI", "ML", "IR", "DB", "Agents", "HCI"],
}

_NAMES = ("cora", "citeseer")
_SOURCES = ("planetoid", "npz")
_PLANETOID_PARTS = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


def data_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The directory the built-in loaders read from: ``root``, else the environment variable
    ``FEDLIGHTNING_DATA``, else ``./data``; a DataError if it does not exist."""
    if root is None:
        root = os.environ.get(DATA_ENV) or "data"
    path = Path(root).expanduser()
    if not path.is_dir():
        raise DataError(
            path,
            f"data directory does not exist; pass root=... or set {DATA_ENV} to the folder "
            "holding planetoid/, gnn_benchmark/ and citeseer_tape/ (see docs/datasets.md)",
        )
    return path


# ------------------------------------------------------------------------- gnn-benchmark npz files


@dataclass
class GnnBenchmarkNpz:
    """The parsed content of a gnn-benchmark ``.npz`` file (shchur/gnn-benchmark format):
    the CSR adjacency ``[N, N]`` as stored (may be directed, with self loops), the CSR node
    attributes ``[N, d]``, int64 labels in ``0..C-1``, node names (or ``None``) and ``C``
    class names (``class_<i>`` if the file has none)."""

    adj: sp.csr_matrix
    attr: sp.csr_matrix
    labels: np.ndarray
    node_names: list[str] | None
    class_names: list[str]


def _npz_csr(path: Path, z: Mapping[str, np.ndarray], prefix: str, rows: int | None):
    """Assemble and validate the CSR matrix stored as ``<prefix>_{data,indices,indptr,shape}``."""
    data, indices, indptr, shape = (
        z[f"{prefix}_{k}"] for k in ("data", "indices", "indptr", "shape")
    )
    if shape.shape != (2,) or not np.issubdtype(shape.dtype, np.integer) or (shape < 0).any():
        raise DataError(
            path, f"field `{prefix}_shape`: expected two non-negative integers, got {shape!r}"
        )
    n, d = int(shape[0]), int(shape[1])
    if rows is not None and n != rows:
        raise DataError(path, f"field `{prefix}_shape`: expected {rows} rows, got {n}")
    if indptr.ndim != 1 or indptr.size != n + 1 or not np.issubdtype(indptr.dtype, np.integer):
        raise DataError(
            path,
            f"field `{prefix}_indptr`: expected {n + 1} integers (rows + 1), "
            f"got shape {indptr.shape} dtype {indptr.dtype}",
        )
    if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        raise DataError(
            path,
            f"field `{prefix}_indices`: expected a 1-D integer array, "
            f"got shape {indices.shape} dtype {indices.dtype}",
        )
    if data.shape != indices.shape or not np.issubdtype(data.dtype, np.number):
        raise DataError(
            path,
            f"field `{prefix}_data`: expected {indices.size} numbers (one per "
            f"index), got shape {data.shape} dtype {data.dtype}",
        )
    if indptr[0] != 0 or indptr[-1] != indices.size or (np.diff(indptr) < 0).any():
        raise DataError(
            path,
            f"field `{prefix}_indptr`: expected a non-decreasing array from 0 to {indices.size}",
        )
    if indices.size and (indices.min() < 0 or indices.max() >= d):
        raise DataError(
            path,
            f"field `{prefix}_indices`: expected column indices in 0..{d - 1}, "
            f"got {indices.min()}..{indices.max()}",
        )
    if not np.isfinite(data).all():
        raise DataError(path, f"field `{prefix}_data`: expected finite values, found NaN or inf")
    import scipy.sparse as sp  # imported by the loaders that read CSR files, not at start-up

    return sp.csr_matrix((data, indices, indptr), shape=(n, d))


def read_gnn_benchmark_npz(path: str | os.PathLike[str]) -> GnnBenchmarkNpz:
    """Read and validate a gnn-benchmark ``.npz`` file: the CSR parts
    ``{adj,attr}_{data,indices,indptr,shape}``, ``labels`` ``[N]``, and optionally
    ``node_names`` ``[N]`` and ``class_names`` ``[C]``. Anything missing or malformed is a
    DataError naming the file and the field."""
    path = Path(path)
    require_file(path, "a gnn-benchmark .npz file (shchur/gnn-benchmark, data/npz/)")
    required = [f"{p}_{k}" for p in ("adj", "attr") for k in ("data", "indices", "indptr", "shape")]
    required.append("labels")
    try:
        # allow_pickle=False: names are stored as fixed-width unicode, never as objects.
        with np.load(path, allow_pickle=False) as f:
            z = dict(f)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as e:
        raise DataError(path, f"not a readable .npz archive ({type(e).__name__}: {e})") from e
    missing = [k for k in required if k not in z]
    if missing:
        raise DataError(path, f"missing field(s) {missing}; the file has {sorted(z)}")

    adj = _npz_csr(path, z, "adj", rows=None)
    n = adj.shape[0]
    if adj.shape[1] != n:
        raise DataError(
            path, f"field `adj_shape`: expected a square [N, N] matrix, got {adj.shape}"
        )
    attr = _npz_csr(path, z, "attr", rows=n)

    labels = z["labels"]
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            path,
            f"field `labels`: expected {n} integers (one per node), got shape "
            f"{labels.shape} dtype {labels.dtype}",
        )
    labels = labels.astype(np.int64)
    if n and labels.min() < 0:
        raise DataError(path, f"field `labels`: expected labels >= 0, got {labels.min()}")

    node_names = None
    if "node_names" in z:
        nn = z["node_names"]
        if nn.shape != (n,):
            raise DataError(path, f"field `node_names`: expected {n} names, got shape {nn.shape}")
        node_names = [str(s) for s in nn.tolist()]

    if "class_names" in z:
        cn = z["class_names"]
        if cn.ndim != 1:
            raise DataError(
                path, f"field `class_names`: expected a 1-D array, got shape {cn.shape}"
            )
        class_names = [str(s) for s in cn.tolist()]
    else:
        class_names = [f"class_{i}" for i in range(int(labels.max()) + 1 if n else 0)]
    if n and labels.max() >= len(class_names):
        raise DataError(
            path,
            f"field `labels`: expected labels in 0..{len(class_names) - 1} "
            f"({len(class_names)} class_names), got {labels.max()}",
        )
    return GnnBenchmarkNpz(adj, attr, labels, node_names, class_names)


def _bow_graph(
    name: str,
    bow: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    labels: np.ndarray,
    class_names: list[str],
    node_ids: list[str] | None = None,
) -> MultimodalGraph:
    """The one-modality graph of either source: float32 ``bow`` ``[N, d]``, the edges
    ``src -> dst`` made undirected, int64 ``labels``."""
    n = labels.size
    return MultimodalGraph(
        name=name,
        features={"bow": torch.from_numpy(bow)},
        mask=full_mask(n, 1),
        edge_index=clean_edges(torch.from_numpy(np.stack([src, dst]).astype(np.int64)), n),
        y=torch.from_numpy(labels),
        class_names=list(class_names),
        node_ids=node_ids,
    )


def _load_npz(name: str, root: Path) -> MultimodalGraph:
    folder = require_dir(root / "gnn_benchmark", f"the gnn-benchmark file {name}.npz")
    z = read_gnn_benchmark_npz(folder / f"{name}.npz")
    coo = z.adj.tocoo()
    bow = z.attr.toarray().astype(np.float32)
    return _bow_graph(name, bow, coo.row, coo.col, z.labels, z.class_names, z.node_names)


# ----------------------------------------------------------------------------- raw Planetoid files


class _PlanetoidUnpickler(pickle.Unpickler):
    """An unpickler that builds only numpy arrays, scipy CSR matrices and a ``defaultdict``
    of lists (unpickling anything else could run code), under their Python 2 names (the files
    were written by Python 2) and their Python 3 / numpy 2 names (files re-saved)."""

    _ALLOWED = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("numpy.core.multiarray", "_reconstruct"): _np_reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _np_reconstruct,
        ("numpy.core.numeric", "_frombuffer"): _np_frombuffer,
        ("numpy._core.numeric", "_frombuffer"): _np_frombuffer,
        # Python 3 pickles array bytes with protocol 2 as _codecs.encode(str, "latin1").
        ("_codecs", "encode"): codecs.encode,
        ("collections", "defaultdict"): collections.defaultdict,
        ("__builtin__", "list"): list,
        ("builtins", "list"): list,
    }

    # scipy's CSR matrix, by the names old and new scipy pickle it under
    _SCIPY_CSR = {("scipy.sparse.csr", "csr_matrix"), ("scipy.sparse._csr", "csr_matrix")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._SCIPY_CSR:
            import scipy.sparse as sp

            return sp.csr_matrix
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: Planetoid files hold only numpy "
                "arrays, scipy CSR matrices and a dict of lists"
            ) from None


def _read_planetoid_part(folder: Path, name: str, part: str) -> Any:
    path = require_file(folder / f"ind.{name}.{part}", f"the raw Planetoid file ind.{name}.{part}")
    if part == "test.index":
        try:
            text = path.read_text(encoding="ascii")
            return np.array([int(t) for t in text.split()], dtype=np.int64)
        except (UnicodeDecodeError, ValueError) as e:
            raise DataError(path, f"field `test.index`: expected one integer per line ({e})") from e
    try:
        with open(path, "rb") as f:
            # latin1: the files were pickled by Python 2 and hold numpy byte buffers.
            obj = _PlanetoidUnpickler(f, encoding="latin1").load()
    except Exception as e:  # any unpickling failure means a malformed file
        raise DataError(path, f"not a readable Planetoid pickle ({type(e).__name__}: {e})") from e
    if part == "graph":
        if not isinstance(obj, Mapping):
            raise DataError(
                path,
                f"field `graph`: expected a dict node -> list of neighbours, "
                f"got {type(obj).__name__}",
            )
        return obj
    import scipy.sparse as sp

    if not (sp.issparse(obj) or isinstance(obj, np.ndarray)) or obj.ndim != 2:
        raise DataError(
            path,
            f"field `{part}`: expected a 2-D matrix, got {type(obj).__name__} "
            f"with shape {getattr(obj, 'shape', None)}",
        )
    try:
        arr = np.asarray(obj.toarray() if sp.issparse(obj) else obj, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise DataError(path, f"field `{part}`: expected a numeric matrix ({e})") from e
    if not np.isfinite(arr).all():
        raise DataError(path, f"field `{part}`: expected finite values, found NaN or inf")
    return arr


def _load_raw(name: str, root: Path) -> MultimodalGraph:
    folder = require_dir(root / "planetoid", f"the raw Planetoid files ind.{name}.*")
    parts = {p: _read_planetoid_part(folder, name, p) for p in _PLANETOID_PARTS}
    f = {p: folder / f"ind.{name}.{p}" for p in _PLANETOID_PARTS}
    tx, allx, ty, ally = parts["tx"], parts["allx"], parts["ty"], parts["ally"]
    graph, test_index = parts["graph"], parts["test.index"]

    d, c = allx.shape[1], ally.shape[1]
    for p, lp in (("x", "y"), ("tx", "ty"), ("allx", "ally")):
        feats, labs = parts[p], parts[lp]
        if feats.shape[1] != d:
            raise DataError(
                f[p],
                f"field `{p}`: expected {d} feature columns (as in allx), got {feats.shape[1]}",
            )
        if labs.shape[1] != c:
            raise DataError(
                f[lp],
                f"field `{lp}`: expected {c} one-hot class columns (as in ally), got {labs.shape[1]}",
            )
        if labs.shape[0] != feats.shape[0]:
            raise DataError(
                f[lp],
                f"field `{lp}`: expected {feats.shape[0]} rows (one per row of "
                f"ind.{name}.{p}), got {labs.shape[0]}",
            )
    if parts["x"].shape[0] > allx.shape[0]:
        raise DataError(
            f["x"],
            f"field `x`: expected at most {allx.shape[0]} rows (allx holds "
            f"the training rows first), got {parts['x'].shape[0]}",
        )
    n_all = allx.shape[0]
    if test_index.size != tx.shape[0]:
        raise DataError(
            f["test.index"],
            f"field `test.index`: expected {tx.shape[0]} indices "
            f"(one per row of ind.{name}.tx), got {test_index.size}",
        )
    if test_index.size and (
        test_index.min() < n_all or np.unique(test_index).size != test_index.size
    ):
        raise DataError(
            f["test.index"],
            f"field `test.index`: expected distinct indices >= {n_all} (after the allx rows)",
        )

    # Test nodes sit at the indices of test.index; CiteSeer's range of test indices has
    # gaps (nodes of the graph whose features were never released). Like PyG, those nodes
    # are kept, with all-zero features and label 0.
    n = max(n_all, int(test_index.max()) + 1 if test_index.size else 0)
    feats = np.zeros((n, d), dtype=np.float32)
    onehot = np.zeros((n, c), dtype=np.float32)
    feats[:n_all], onehot[:n_all] = allx, ally
    feats[test_index], onehot[test_index] = tx, ty
    labels = onehot.argmax(axis=1).astype(np.int64)

    try:
        keys = list(graph.keys())
        nbrs = [np.asarray(list(graph[k]), dtype=np.int64).reshape(-1) for k in keys]
        src = np.repeat(np.asarray(keys, dtype=np.int64), [v.size for v in nbrs])
        dst = np.concatenate(nbrs) if nbrs else np.zeros(0, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise DataError(f["graph"], f"field `graph`: expected integer node ids ({e})") from e
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n):
        raise DataError(
            f["graph"],
            f"field `graph`: expected node ids in 0..{n - 1}, got "
            f"{min(src.min(), dst.min())}..{max(src.max(), dst.max())}",
        )
    names = PLANETOID_CLASS_NAMES.get(name, [])
    class_names = names if len(names) == c else [f"class_{i}" for i in range(c)]
    return _bow_graph(name, feats, src, dst, labels, class_names)


def load_planetoid(
    name: str = "cora", source: str = "planetoid", root: str | os.PathLike[str] | None = None
) -> MultimodalGraph:
    """Load Cora or CiteSeer as a one-modality (``bow``, 0/1 word indicators, float32)
    :class:`MultimodalGraph`, edges undirected, coalesced and free of self loops (sizes and
    sources in ``docs/datasets.md``). The two sources number the classes differently:
    compare them by ``class_names``.

    Args:
        name: ``"cora"`` or ``"citeseer"``.
        source: ``"planetoid"`` reads ``<root>/planetoid/ind.<name>.*``; ``"npz"`` reads
            ``<root>/gnn_benchmark/<name>.npz`` (which also gives ``node_ids``).
        root: the data directory (:func:`data_root`).

    Raises a ValueError for an unknown ``name`` or ``source``, a DataError naming the file
    and the field for a missing or malformed file."""
    key = str(name).lower()
    if key not in _NAMES:
        raise ValueError(f"load_planetoid: name must be one of {list(_NAMES)}, got {name!r}")
    if source not in _SOURCES:
        raise ValueError(f"load_planetoid: source must be one of {list(_SOURCES)}, got {source!r}")
    base = data_root(root)
    return _load_raw(key, base) if source == "planetoid" else _load_npz(key, base)
