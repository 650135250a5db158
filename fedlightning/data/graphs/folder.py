"""The folder format for a user's own multimodal graph (``docs/datasets.md``): labels, edges,
``features/``, optional ``masks/``, ``class_names.json``, ``node_ids.json``, ``meta.json``."""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from fedlightning.data.files import field_error, load_npy, read_json, read_lines, split_rows
from fedlightning.data.graphs.base import MultimodalGraph, clean_edges, zero_missing
from fedlightning.errors import ConfigError, DataError

__all__ = ["load_folder", "save_folder", "FolderExistsError"]


log = logging.getLogger(__name__)

LABELS_AS = ("auto", "ids", "names")


class FolderExistsError(DataError, FileExistsError):
    """:func:`save_folder` refused to write into a folder that already holds files."""


def _one_of(folder: Path, npy: str, csv: str, what: str) -> Path:
    a, b = folder / npy, folder / csv
    if a.exists() and b.exists():
        raise DataError(folder, f"both {npy} and {csv} are present; keep one ({what})")
    if not (a.exists() or b.exists()):
        raise DataError(folder / npy, f"file missing: expected {npy} or {csv} ({what})")
    return a if a.exists() else b


def _is_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return False
    return True


# -------------------------------------------------------------- labels: integer ids or class names


def _read_label_csv(path: Path) -> tuple[list[str], list[int]]:
    """One label per non-blank line (stripped; CSV quoting allowed), without the header."""
    rows = read_lines(path, "one label per line")
    if rows and rows[0][1].strip().lower() == "label":
        rows = rows[1:]
    values = []
    for lineno, ln in rows:
        fields = next(csv.reader([ln])) if '"' in ln else ln.split(",")
        if len(fields) != 1:
            raise DataError(
                path,
                f"line {lineno}: field `label`: expected one label per line (an integer id or a "
                f"class name), got {len(fields)} comma-separated fields {ln[:80]!r}",
            )
        values.append(fields[0].strip())
    return values, [lineno for lineno, _ in rows]


def _class_names_json(folder: Path) -> list[str] | None:
    """The names of ``class_names.json``, ``None`` if the folder has none."""
    path = folder / "class_names.json"
    if not path.exists():
        return None
    names = read_json(path)
    if not isinstance(names, list) or not names or not all(isinstance(s, str) and s for s in names):
        raise DataError(path, "expected a non-empty JSON list of class-name strings")
    if len(set(names)) != len(names):
        raise DataError(path, "expected distinct class names")
    return names


def _names_to_ids(
    folder: Path, path: Path, values: list[str], where: list[str]
) -> tuple[np.ndarray, list[str]]:
    """Class names -> ids: the order of ``class_names.json`` if present, else sorted names."""
    for v, at in zip(values, where, strict=True):
        if not v:
            raise DataError(path, f"{at}field `label`: expected a non-empty class name, got ''")
    names, source = _class_names_json(folder), "the order of class_names.json"
    if names is None:
        names, source = sorted(set(values)), "sorted order"
    index = {c: i for i, c in enumerate(names)}
    for v, at in zip(values, where, strict=True):
        if v not in index:
            shown = ", ".join(map(repr, names[:10])) + (", ..." if len(names) > 10 else "")
            raise DataError(
                path,
                f"{at}field `label`: class name {v!r} is not in class_names.json "
                f"({len(names)} names: {shown})",
            )
    y = np.fromiter((index[v] for v in values), dtype=np.int64, count=len(values))
    log.info(
        "%s: %d class names mapped to ids 0..%d in %s", path, len(names), len(names) - 1, source
    )
    return y, names


def _read_labels(folder: Path, labels_as: str) -> tuple[np.ndarray, list[str], Path]:
    """``(y, class names, the labels file)``; the names are those the labels give, else
    ``class_names.json``'s, else ``class_<i>``."""
    if labels_as not in LABELS_AS:
        raise ConfigError(
            "dataset.labels_as", f"must be one of {list(LABELS_AS)}, got {labels_as!r}"
        )
    path = _one_of(
        folder,
        "labels.npy",
        "labels.csv",
        "one label per node: an integer class id or a class name",
    )
    names: list[str] | None = None
    if path.suffix == ".csv":
        values, linenos = _read_label_csv(path)
        if not values:
            raise DataError(path, "field `labels`: expected at least one node, got none")
        first_int = _is_int(values[0])
        for v, lineno in zip(values, linenos, strict=True):
            if labels_as == "auto" and _is_int(v) != first_int:
                expected = "an integer class id" if first_int else "a class name"
                raise DataError(
                    path,
                    f"line {lineno}: field `label`: expected {expected} like line "
                    f"{linenos[0]} ({values[0]!r}), got {v!r}; use integer ids 0..C-1 or class "
                    "names throughout (dataset.labels_as=names reads every label as a name)",
                )
            if labels_as == "ids" and not _is_int(v):
                raise DataError(
                    path,
                    f"line {lineno}: field `label`: expected an integer class id "
                    f"(dataset.labels_as=ids), got {v!r}",
                )
        if labels_as == "ids" or (labels_as == "auto" and first_int):
            y = np.array([int(v) for v in values], dtype=np.int64)
        else:
            y, names = _names_to_ids(folder, path, values, [f"line {i}: " for i in linenos])
    else:
        arr = load_npy(path)
        text = arr.dtype.kind in "US"
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or text):
            raise DataError(
                path,
                f"field `labels`: expected a 1-D integer array [N] of class ids or a 1-D string "
                f"array of class names, got shape {arr.shape} dtype {arr.dtype}",
            )
        if text and labels_as == "ids":
            raise DataError(
                path,
                f"field `labels`: expected integer class ids (dataset.labels_as=ids), got "
                f"strings of dtype {arr.dtype}",
            )
        if arr.size == 0:
            raise DataError(path, "field `labels`: expected at least one node, got none")
        if text or labels_as == "names":
            values = [
                (v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)).strip()
                for v in arr.tolist()
            ]
            y, names = _names_to_ids(folder, path, values, [f"node {i}: " for i in range(arr.size)])
        else:
            y = arr.astype(np.int64)
    if y.min() < 0:
        i = int(np.argmin(y))
        raise DataError(path, f"field `labels`: expected labels >= 0, node {i} has {y[i]}")
    if names is None:
        names = _class_names_json(folder)
        if names is None:
            check_class_count(path, y)
            names = [f"class_{i}" for i in range(int(y.max()) + 1)]
        elif y.max() >= len(names):
            i = int(np.argmax(y))
            raise DataError(
                path,
                f"field `labels`: expected labels in 0..{len(names) - 1} "
                f"({len(names)} names in class_names.json), node {i} has {y[i]}",
            )
    return y, names, path


MAX_CLASS_IDS = 2**16  # class ids beyond this and beyond the node count: a broken file


def check_class_count(path: Path, y: np.ndarray) -> None:
    """Refuse (one line naming the node and its label) labels whose class count, the
    largest id plus one, exceeds both the number of nodes and :data:`MAX_CLASS_IDS`: such
    a label (2**31, say) is a broken file, and allocating its classes would exhaust memory."""
    top = int(y.max())
    if top >= max(len(y), MAX_CLASS_IDS):
        i = int(np.argmax(y))
        raise DataError(
            path,
            f"field `labels`: node {i} has class id {top}, which would make {top + 1} classes "
            f"for {len(y)} nodes; expected ids 0..C-1 with C at most "
            f"{max(len(y), MAX_CLASS_IDS)}",
        )


def _load_sparse(path: Path) -> object:
    """A SciPy sparse matrix saved by ``scipy.sparse.save_npz``, as COO, duplicates summed."""
    import scipy.sparse

    try:
        coo = scipy.sparse.load_npz(path).tocoo()
    except Exception as e:  # a zip that is no sparse matrix, a truncated file, ...
        raise DataError(
            path,
            "not a readable SciPy sparse matrix (written by scipy.sparse.save_npz): "
            f"{type(e).__name__}: {str(e)[:120]}",
        ) from None
    coo.sum_duplicates()
    return coo


def _read_features(folder: Path, n: int, labels_file: str) -> dict[str, torch.Tensor]:
    feat_dir = folder / "features"
    if not feat_dir.is_dir():
        raise DataError(
            feat_dir,
            "directory missing: expected features/<modality>.npy (dense) or .npz (SciPy "
            "sparse), one float [N, d] matrix per modality",
        )
    files = sorted(p for p in feat_dir.iterdir() if not p.name.startswith("."))
    other = [p.name for p in files if p.suffix not in (".npy", ".npz") or not p.is_file()]
    if other:
        raise DataError(feat_dir, f"expected only <modality>.npy or .npz files, found {other}")
    if not files:
        raise DataError(feat_dir, "expected at least one <modality>.npy file, found none")
    stems = [p.stem for p in files]
    twice = sorted({m for m in stems if stems.count(m) > 1})
    if twice:
        raise DataError(
            feat_dir, f"modality {twice[0]!r} is given twice (.npy and .npz): keep one of them"
        )
    features = {}
    for p in files:
        sparse = p.suffix == ".npz"
        x = _load_sparse(p) if sparse else load_npy(p)
        field = f"field `features` of modality {p.stem!r}"
        if x.ndim != 2 or x.shape[0] != n or x.shape[1] < 1:
            raise DataError(
                p,
                f"{field}: expected a 2-D matrix [{n}, d] ({n} nodes as in "
                f"{labels_file}, d >= 1), got shape {x.shape}",
            )
        if x.dtype.kind not in "biuf":
            raise DataError(p, f"{field}: expected a real numeric dtype, got {x.dtype}")
        values = x.data if sparse else x
        with np.errstate(over="ignore", invalid="ignore"):  # told below, in the one line
            cast = values.astype(np.float32)
        for bad_values, what in (
            (~np.isfinite(values), "NaN or inf"),
            (np.isfinite(values) & ~np.isfinite(cast), "values beyond float32 (|x| > 3.4e38)"),
        ):
            if sparse:
                bad = np.zeros(n, dtype=bool)
                bad[x.row[bad_values]] = True
            else:
                bad = bad_values.any(axis=1)
            if bad.any():
                raise DataError(
                    p,
                    f"{field}: expected finite values, found {what} in "
                    f"{int(bad.sum())} row(s), first row {int(np.argmax(bad))}",
                )
        if sparse:
            index = torch.from_numpy(np.vstack([x.row, x.col]).astype(np.int64))
            x = torch.sparse_coo_tensor(index, cast, x.shape).coalesce()
        else:
            x = cast
        features[p.stem] = x if sparse else torch.from_numpy(x)
    return features


def _read_masks(folder: Path, n: int, modalities: list[str]) -> torch.Tensor:
    mask = torch.ones(n, len(modalities), dtype=torch.bool)
    mask_dir = folder / "masks"
    if not mask_dir.exists():
        return mask
    if not mask_dir.is_dir():
        raise DataError(mask_dir, "expected a directory of masks/<modality>.npy files")
    for p in sorted(q for q in mask_dir.iterdir() if not q.name.startswith(".")):
        if p.suffix != ".npy" or p.stem not in modalities:
            raise DataError(
                p,
                f"expected masks/<modality>.npy for one of the modalities "
                f"{modalities} (from features/)",
            )
        m = load_npy(p)
        if m.shape != (n,):
            raise DataError(
                p,
                f"field `mask` of modality {p.stem!r}: expected shape ({n},) "
                f"(one entry per node), got {m.shape}",
            )
        if m.dtype != np.bool_ and (m.dtype.kind not in "iuf" or not np.isin(m, (0, 1)).all()):
            raise DataError(
                p,
                f"field `mask` of modality {p.stem!r}: expected bool or 0/1 "
                f"values, got dtype {m.dtype} with values {np.unique(m)[:5]}",
            )
        mask[:, modalities.index(p.stem)] = torch.from_numpy(m.astype(np.bool_))
    return mask


def _edge_column(
    path: Path, first: list[str], value: str | int | None, key: str, default: int
) -> int:
    """The 0-based column of one edge end: a name in the header ``first`` (line 1), a 0-based
    position among its columns, or ``default``."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(
            f"dataset.{key}", f"expected a column name or a 0-based position, got {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"dataset.{key}", f"a 0-based column position >= 0, got {value}")
        if value >= len(first):
            raise ConfigError(
                f"dataset.{key}",
                f"column position {value} (0-based) does not exist: {path} has {len(first)} "
                "columns",
            )
        return value
    if value in first:
        return first.index(value)
    folded = [h.lower() for h in first]
    if value.strip().lower() in folded:
        return folded.index(value.strip().lower())
    raise DataError(
        path,
        f"header line: field `{key}`: expected a column named {value!r} "
        f"(dataset.{key}), the header has {first}",
    )


def _read_edge_csv(
    path: Path, src_column: str | int | None = None, dst_column: str | int | None = None
) -> tuple[np.ndarray, str]:
    """``(edges [E, 2] int64, "<src name>,<dst name>")`` from a comma-separated file.

    The first line is a header when a column name is asked for, or else when one of the two
    edge columns on it is not an integer. Every line has as many columns as the first."""
    rows = read_lines(path, "comma-separated edges")
    if not rows:
        return np.zeros((0, 2), dtype=np.int64), "src,dst"
    first_no, first_ln = rows[0]
    first = [f.strip() for f in first_ln.split(",")]
    ncols = len(first)
    if ncols < 2:
        raise DataError(
            path,
            f"line {first_no}: expected at least 2 comma-separated columns (the two ends of an "
            f"edge), got {first_ln[:80]!r}",
        )
    named = isinstance(src_column, str) or isinstance(dst_column, str)
    cols = (
        _edge_column(path, first, src_column, "src_column", 0),
        _edge_column(path, first, dst_column, "dst_column", 1),
    )
    # A name makes line 1 the header; else it is one when an edge column on it is no integer.
    header = first if named or not all(_is_int(first[c]) for c in cols) else None
    if cols[0] == cols[1]:
        raise ConfigError(
            "dataset.dst_column", f"names the same column as dataset.src_column (column {cols[0]})"
        )
    names = [header[c] if header else f"column {c + 1}" for c in cols]
    label = ",".join(names) if header else "src,dst"
    if header is not None:
        rows = rows[1:]
    if not rows:
        return np.zeros((0, 2), dtype=np.int64), label
    layout = f"as the header `{first_ln.strip()[:60]}`" if header else f"as line {first_no}"
    # np.loadtxt with usecols lets the column count vary: every line is checked first.
    parts = list(split_rows(path, rows, ",", ncols, f"{ncols} comma-separated columns ({layout})"))
    try:  # the fast path; on failure the slow scan below finds the offending line
        lines = [ln for _, ln in rows]
        out = np.loadtxt(lines, delimiter=",", dtype=np.int64, usecols=cols, ndmin=2, comments=None)
        return out, label
    except ValueError:
        pass
    for (lineno, _), p in zip(rows, parts, strict=True):
        for name, c in zip(names, cols, strict=True):
            if not _is_int(p[c]):
                got = repr(p[c][:40])
                raise field_error(path, lineno, name, c + 1, "an integer node index", got)
    raise DataError(
        path, f"expected integer node indices in the columns {names}"
    )  # pragma: no cover


def _read_edges(
    folder: Path,
    n: int,
    labels_file: str,
    src_column: str | int | None = None,
    dst_column: str | int | None = None,
) -> torch.Tensor:
    path = _one_of(folder, "edge_index.npy", "edges.csv", "the edges")
    if path.suffix == ".csv":
        edges, field = _read_edge_csv(path, src_column, dst_column)
        ei = edges.T
    else:
        for key, value in (("src_column", src_column), ("dst_column", dst_column)):
            if value is not None:
                raise ConfigError(
                    f"dataset.{key}",
                    f"applies to edges.csv only, but {folder} holds edge_index.npy; unset it",
                )
        field = "edge_index"
        ei = load_npy(path)
        if ei.ndim != 2 or ei.shape[0] != 2 or not np.issubdtype(ei.dtype, np.integer):
            hint = "; transpose it (edge_index.T)" if ei.ndim == 2 and ei.shape[1] == 2 else ""
            raise DataError(
                path,
                f"field `edge_index`: expected an integer array of shape "
                f"[2, E], got shape {ei.shape} dtype {ei.dtype}{hint}",
            )
    ei = ei.astype(np.int64)
    if ei.size and (ei.min() < 0 or ei.max() >= n):
        raise DataError(
            path,
            f"field `{field}`: expected node ids in 0..{n - 1} ({n} nodes as "
            f"in {labels_file}), got {ei.min()}..{ei.max()}",
        )
    return clean_edges(torch.from_numpy(np.ascontiguousarray(ei)), n)


def _read_node_ids(folder: Path, n: int) -> list[str] | None:
    path = folder / "node_ids.json"
    if not path.exists():
        return None
    ids = read_json(path)
    if not isinstance(ids, list) or not all(isinstance(s, str) for s in ids):
        raise DataError(path, "expected a JSON list of node-id strings")
    if len(ids) != n:
        raise DataError(path, f"expected {n} node ids (one per node), got {len(ids)}")
    if len(set(ids)) != n:
        raise DataError(path, "expected distinct node ids")
    return ids


def _read_name(folder: Path) -> str:
    path = folder / "meta.json"
    if not path.exists():
        return folder.resolve().name
    meta = read_json(path)
    if not isinstance(meta, dict):
        raise DataError(path, 'expected a JSON object such as {"name": "mygraph"}')
    name = meta.get("name", folder.resolve().name)
    if not isinstance(name, str) or not name:
        raise DataError(path, f"field `name`: expected a non-empty string, got {name!r}")
    return name


def load_folder(
    path: str | os.PathLike[str],
    name: str | None = None,
    src_column: str | int | None = None,
    dst_column: str | int | None = None,
    labels_as: str = "auto",
) -> MultimodalGraph:
    """Load a multimodal graph stored in the folder format (``docs/datasets.md``).

    Edges are made undirected, coalesced and free of self loops; rows that a mask marks
    unavailable are zeroed; modalities come in the sorted order of their file names.

    Args:
        path: the dataset folder.
        name: the graph's name (default: ``meta.json``'s ``name``, else the folder's name).
        src_column, dst_column: the columns of ``edges.csv`` holding the edge ends, header
            names or 0-based positions (default: the first two).
        labels_as: ``"auto"`` (integer ids when every label is an integer, class names when
            none is), ``"ids"`` or ``"names"`` (e.g. years read as names).

    Raises a DataError naming the file, field and expectation, a ConfigError naming a bad
    argument."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(
            folder, "dataset folder does not exist (see docs/datasets.md for the folder format)"
        )
    y, class_names, labels_path = _read_labels(folder, labels_as)
    n = y.size
    features = _read_features(folder, n, labels_path.name)
    mask = _read_masks(folder, n, list(features))
    return MultimodalGraph(
        name=name if name is not None else _read_name(folder),
        features=zero_missing(features, mask),
        mask=mask,
        edge_index=_read_edges(folder, n, labels_path.name, src_column, dst_column),
        y=torch.from_numpy(y),
        class_names=class_names,
        node_ids=_read_node_ids(folder, n),
    )


def save_folder(graph: MultimodalGraph, path: str | os.PathLike[str]) -> None:
    """Write ``graph`` in the folder format for :func:`load_folder`: a sparse modality as
    SciPy CSR ``.npz``, ``masks/`` only for modalities with missing rows, ``node_ids.json``
    only if the graph has ids.

    Raises a :class:`FolderExistsError` if ``path`` exists and is not an empty directory,
    a ValueError if a modality name cannot be a file name."""
    folder = Path(path).expanduser()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FolderExistsError(
            folder, "exists and is not an empty directory; refusing to overwrite, choose a new path"
        )
    for m in graph.modalities:
        if not m or m.startswith(".") or any(ch in m for ch in "/\\:\0"):
            raise ValueError(f"save_folder: modality name {m!r} cannot be a file name")
    (folder / "features").mkdir(parents=True, exist_ok=True)
    np.save(folder / "edge_index.npy", graph.edge_index.cpu().numpy().astype(np.int64))
    np.save(folder / "labels.npy", graph.y.cpu().numpy().astype(np.int64))
    mask = graph.mask.cpu().numpy().astype(np.bool_)
    for j, (m, x) in enumerate(graph.features.items()):
        if x.layout == torch.sparse_coo:  # stays sparse: SciPy CSR
            import scipy.sparse

            x = x.detach().cpu().coalesce()
            csr = scipy.sparse.csr_matrix((x.values().numpy(), tuple(x.indices().numpy())), x.shape)
            scipy.sparse.save_npz(folder / "features" / f"{m}.npz", csr)
        else:
            np.save(folder / "features" / f"{m}.npy", x.detach().cpu().numpy().astype(np.float32))
        if not mask[:, j].all():
            (folder / "masks").mkdir(exist_ok=True)
            np.save(folder / "masks" / f"{m}.npy", mask[:, j])
    (folder / "class_names.json").write_text(json.dumps(list(graph.class_names)), encoding="utf-8")
    if graph.node_ids is not None:
        (folder / "node_ids.json").write_text(json.dumps(list(graph.node_ids)), encoding="utf-8")
    (folder / "meta.json").write_text(json.dumps({"name": graph.name}), encoding="utf-8")
