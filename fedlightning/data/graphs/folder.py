"""A plain on-disk format for a user's own multimodal graph (see ``docs/datasets.md``).

A dataset folder holds::

    edge_index.npy | edges.csv      int [2, E] | lines `src,dst` (optional header `src,dst`)
    labels.npy     | labels.csv     int [N]    | one label per line (optional header `label`)
    features/<modality>.npy         float [N, d], one file per modality (at least one)
    masks/<modality>.npy            optional bool or 0/1 [N]: True where the node has it
    class_names.json                optional list of C strings
    node_ids.json                   optional list of N strings
    meta.json                       optional {"name": "..."}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlightning.data.graphs.base import MultimodalGraph, clean_edges
from fedlightning.errors import DataError

__all__ = ["load_folder", "save_folder", "FolderExistsError"]


class FolderExistsError(DataError, FileExistsError):
    """:func:`save_folder` refused to write into a folder that already holds files."""


# ------------------------------------------------------------------------------------------
# readers; each raises DataError naming the file, the field and what was expected


def _one_of(folder: Path, npy: str, csv: str, what: str) -> Path:
    a, b = folder / npy, folder / csv
    if a.exists() and b.exists():
        raise DataError(folder, f"both {npy} and {csv} are present; keep one ({what})")
    if not (a.exists() or b.exists()):
        raise DataError(folder / npy, f"file missing: expected {npy} or {csv} ({what})")
    return a if a.exists() else b


def _load_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise DataError(path, "file missing or not a regular file")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        # allow_pickle=False: object arrays would run code on load; numeric arrays need none.
        raise DataError(path, f"not a readable numeric .npy array ({type(e).__name__}: {e})") from e


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(path, f"not valid UTF-8 JSON ({type(e).__name__}: {e})") from e


def _read_int_csv(path: Path, columns: tuple[str, ...]) -> np.ndarray:
    """Integer rows of ``len(columns)`` comma-separated values; optional header; blank lines skipped."""
    try:
        # utf-8-sig: spreadsheet programs often prepend a byte-order mark.
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(path, f"not readable UTF-8 text ({type(e).__name__}: {e})") from e
    rows = [(i, ln) for i, ln in enumerate(text.splitlines(), start=1) if ln.strip()]
    header = ",".join(columns)
    if rows and rows[0][1].replace(" ", "").lower() == header:
        rows = rows[1:]
    if not rows:
        return np.zeros((0, len(columns)), dtype=np.int64)
    try:
        # The fast path; on failure the slow scan below finds the offending line.
        out = np.loadtxt([ln for _, ln in rows], delimiter=",", dtype=np.int64, ndmin=2)
        if out.shape == (len(rows), len(columns)):
            return out
    except ValueError:
        pass
    for lineno, ln in rows:
        parts = ln.split(",")
        try:
            if len(parts) != len(columns):
                raise ValueError
            [int(p) for p in parts]
        except ValueError:
            raise DataError(
                path,
                f"line {lineno}: expected {len(columns)} integer(s) `{header}`, got {ln[:80]!r}",
            ) from None
    raise DataError(path, f"expected integer rows `{header}`")  # pragma: no cover


def _read_labels(folder: Path) -> tuple[np.ndarray, Path]:
    path = _one_of(folder, "labels.npy", "labels.csv", "one integer class label per node")
    if path.suffix == ".csv":
        y = _read_int_csv(path, ("label",))[:, 0]
    else:
        y = _load_npy(path)
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DataError(
                path,
                f"field `labels`: expected a 1-D integer array [N], got shape "
                f"{y.shape} dtype {y.dtype}",
            )
    y = y.astype(np.int64)
    if y.size == 0:
        raise DataError(path, "field `labels`: expected at least one node, got none")
    if y.min() < 0:
        i = int(np.argmin(y))
        raise DataError(path, f"field `labels`: expected labels >= 0, node {i} has {y[i]}")
    return y, path


def _read_class_names(folder: Path, y: np.ndarray, labels_path: Path) -> list[str]:
    path = folder / "class_names.json"
    if not path.exists():
        return [f"class_{i}" for i in range(int(y.max()) + 1)]
    names = _read_json(path)
    if not isinstance(names, list) or not names or not all(isinstance(s, str) and s for s in names):
        raise DataError(path, "expected a non-empty JSON list of class-name strings")
    if len(set(names)) != len(names):
        raise DataError(path, "expected distinct class names")
    if y.max() >= len(names):
        i = int(np.argmax(y))
        raise DataError(
            labels_path,
            f"field `labels`: expected labels in 0..{len(names) - 1} "
            f"({len(names)} names in class_names.json), node {i} has {y[i]}",
        )
    return names


def _read_features(folder: Path, n: int, labels_file: str) -> dict[str, torch.Tensor]:
    feat_dir = folder / "features"
    if not feat_dir.is_dir():
        raise DataError(
            feat_dir,
            "directory missing: expected features/<modality>.npy, one "
            "float [N, d] matrix per modality",
        )
    files = sorted(p for p in feat_dir.iterdir() if not p.name.startswith("."))
    other = [p.name for p in files if p.suffix != ".npy" or not p.is_file()]
    if other:
        raise DataError(feat_dir, f"expected only <modality>.npy files, found {other}")
    if not files:
        raise DataError(feat_dir, "expected at least one <modality>.npy file, found none")
    features = {}
    for p in files:
        x = _load_npy(p)
        field = f"field `features` of modality {p.stem!r}"
        if x.ndim != 2 or x.shape[0] != n or x.shape[1] < 1:
            raise DataError(
                p,
                f"{field}: expected a 2-D matrix [{n}, d] ({n} nodes as in "
                f"{labels_file}, d >= 1), got shape {x.shape}",
            )
        if not (
            np.issubdtype(x.dtype, np.floating)
            or np.issubdtype(x.dtype, np.integer)
            or x.dtype == np.bool_
        ):
            raise DataError(p, f"{field}: expected a real numeric dtype, got {x.dtype}")
        x = x.astype(np.float32)
        bad = ~np.isfinite(x).all(axis=1)
        if bad.any():
            raise DataError(
                p,
                f"{field}: expected finite values, found NaN or inf in "
                f"{int(bad.sum())} row(s), first row {int(np.argmax(bad))}",
            )
        features[p.stem] = torch.from_numpy(x)
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
        m = _load_npy(p)
        if m.shape != (n,):
            raise DataError(
                p,
                f"field `mask` of modality {p.stem!r}: expected shape ({n},) "
                f"(one entry per node), got {m.shape}",
            )
        if m.dtype != np.bool_:
            numeric = np.issubdtype(m.dtype, np.integer) or np.issubdtype(m.dtype, np.floating)
            if not numeric or not np.isin(m, (0, 1)).all():
                raise DataError(
                    p,
                    f"field `mask` of modality {p.stem!r}: expected bool or 0/1 "
                    f"values, got dtype {m.dtype} with values {np.unique(m)[:5]}",
                )
        mask[:, modalities.index(p.stem)] = torch.from_numpy(m.astype(np.bool_))
    return mask


def _read_edges(folder: Path, n: int, labels_file: str) -> torch.Tensor:
    path = _one_of(folder, "edge_index.npy", "edges.csv", "the edges")
    if path.suffix == ".csv":
        ei = _read_int_csv(path, ("src", "dst")).T
    else:
        ei = _load_npy(path)
        if ei.ndim != 2 or ei.shape[0] != 2 or not np.issubdtype(ei.dtype, np.integer):
            hint = "; transpose it (edge_index.T)" if ei.ndim == 2 and ei.shape[1] == 2 else ""
            raise DataError(
                path,
                f"field `edge_index`: expected an integer array of shape "
                f"[2, E], got shape {ei.shape} dtype {ei.dtype}{hint}",
            )
    ei = ei.astype(np.int64)
    if ei.size and (ei.min() < 0 or ei.max() >= n):
        field = "src,dst" if path.suffix == ".csv" else "edge_index"
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
    ids = _read_json(path)
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
    meta = _read_json(path)
    if not isinstance(meta, dict):
        raise DataError(path, 'expected a JSON object such as {"name": "mygraph"}')
    name = meta.get("name", folder.resolve().name)
    if not isinstance(name, str) or not name:
        raise DataError(path, f"field `name`: expected a non-empty string, got {name!r}")
    return name


def load_folder(path: str | os.PathLike[str], name: str | None = None) -> MultimodalGraph:
    r"""Load a multimodal graph stored in the folder format (see ``docs/datasets.md``).

    Edges are made undirected, coalesced and free of self loops; rows of nodes that a mask
    marks unavailable are zeroed; modalities come in the sorted order of their file names.

    Args:
        path (str or Path): the dataset folder.
        name (str, optional): the graph's name. If :obj:`None` (default), ``meta.json``'s
            ``name``, else the folder's name.

    Returns:
        MultimodalGraph: ``features[m]`` float32 ``[N, d_m]``, ``mask`` bool ``[N, M]``,
        ``y`` long ``[N]``.

    Raises:
        DataError: for a missing or malformed file, naming the file, the field and what was
            expected.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(
            folder, "dataset folder does not exist (see docs/datasets.md for the folder format)"
        )
    y, labels_path = _read_labels(folder)
    n = y.size
    class_names = _read_class_names(folder, y, labels_path)
    features = _read_features(folder, n, labels_path.name)
    modalities = list(features)
    mask = _read_masks(folder, n, modalities)
    # Unavailable rows are zeroed so that no model can read a value that "is not there".
    features = {m: x * mask[:, j : j + 1].to(x.dtype) for j, (m, x) in enumerate(features.items())}
    return MultimodalGraph(
        name=name if name is not None else _read_name(folder),
        features=features,
        mask=mask,
        edge_index=_read_edges(folder, n, labels_path.name),
        y=torch.from_numpy(y),
        class_names=class_names,
        node_ids=_read_node_ids(folder, n),
    )


def save_folder(graph: MultimodalGraph, path: str | os.PathLike[str]) -> None:
    r"""Write ``graph`` in the folder format, so that :func:`load_folder` reads it back.

    Writes ``edge_index.npy``, ``labels.npy``, ``features/<modality>.npy``,
    ``masks/<modality>.npy`` (only for modalities with missing rows), ``class_names.json``,
    ``node_ids.json`` (if the graph has ids) and ``meta.json``.

    Args:
        graph (MultimodalGraph): the graph.
        path (str or Path): the folder; created if needed, and must be empty.

    Raises:
        FolderExistsError: (a :class:`DataError` and a :class:`FileExistsError`) if ``path``
            exists and is not an empty directory.
        ValueError: if a modality name cannot be a file name.
    """
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
        np.save(folder / "features" / f"{m}.npy", x.detach().cpu().numpy().astype(np.float32))
        if not mask[:, j].all():
            (folder / "masks").mkdir(exist_ok=True)
            np.save(folder / "masks" / f"{m}.npy", mask[:, j])
    (folder / "class_names.json").write_text(json.dumps(list(graph.class_names)), encoding="utf-8")
    if graph.node_ids is not None:
        (folder / "node_ids.json").write_text(json.dumps(list(graph.node_ids)), encoding="utf-8")
    (folder / "meta.json").write_text(json.dumps({"name": graph.name}), encoding="utf-8")
