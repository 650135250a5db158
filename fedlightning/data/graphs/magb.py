"""MAGB / OpenMAG-style dataset folders (Grocery, Ele-Fashion, Movies, Toys, RedditS, ...):
``<Name>.csv``, ``TextFeature/*.npy``, ``ImageFeature/*.npy`` (layout in ``docs/datasets.md``)."""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch

from fedlightning.data.graphs.base import MultimodalGraph, clean_edges
from fedlightning.errors import DataError

__all__ = ["load_magb"]

MODALITY_DIRS = {"text": "TextFeature", "image": "ImageFeature"}
_INT = re.compile(r"-?\d+")


def _node_csv(folder: Path) -> Path:
    named = folder / f"{folder.resolve().name}.csv"
    if named.is_file():
        return named
    tables = sorted(p for p in folder.glob("*.csv") if p.name != "edges.csv")
    if len(tables) != 1:
        raise DataError(
            folder,
            f"expected one node table <Name>.csv (e.g. {folder.resolve().name}.csv), "
            f"found {[p.name for p in tables]}",
        )
    return tables[0]


def _read_table(path: Path, label_col: str, neighbors_col: str):
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # node texts can be long
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        columns = reader.fieldnames or []
    if not rows:
        raise DataError(path, "no node rows")
    if label_col not in columns:
        raise DataError(path, f"field `{label_col}`: column missing; the columns are {columns}")
    labels = []
    for i, r in enumerate(rows, 2):
        value = (r.get(label_col) or "").strip()
        if not value.lstrip("-").isdigit() or int(value) < 0:
            raise DataError(
                path, f"line {i}: field `{label_col}`: expected an integer >= 0, got {value!r}"
            )
        labels.append(int(value))
    neighbors = None
    if neighbors_col in columns:
        neighbors = [[int(x) for x in _INT.findall(r.get(neighbors_col) or "")] for r in rows]
    return np.array(labels, dtype=np.int64), neighbors


def _edges(folder: Path, table: Path, neighbors: list[list[int]] | None, n: int) -> torch.Tensor:
    if neighbors is not None:
        src = [i for i, ns in enumerate(neighbors) for _ in ns]
        dst = [j for ns in neighbors for j in ns]
        bad = [(i, j) for i, j in zip(src, dst, strict=True) if not 0 <= j < n]
        if bad:
            i, j = bad[0]
            raise DataError(
                table, f"line {i + 2}: field `neighbors`: node {j} is not in 0..{n - 1}"
            )
        return clean_edges(torch.tensor([src, dst], dtype=torch.long), n)
    if (folder / "edge_index.npy").is_file() or (folder / "edges.csv").is_file():
        from fedlightning.data.graphs.folder import _read_edges

        return _read_edges(folder, n, table.name)
    raise DataError(
        table,
        "no `neighbors` column and no edges.csv / edge_index.npy beside it; the graph's "
        "DGL file (<Name>Graph.pt) is not read here: export its edges as edges.csv (src,dst)",
    )


def _feature(folder: Path, modality: str, choice: str | None, n: int):
    """One modality's matrix and availability, or ``None`` when the folder has none."""
    sub, config_key = folder / MODALITY_DIRS[modality], f"dataset.{modality}_feature"
    if not sub.is_dir():
        if choice:
            raise DataError(sub, f"directory missing, but `{config_key}` names {choice!r}")
        return None
    files = sorted(p.name for p in sub.glob("*.npy"))
    if choice is None:
        if len(files) > 1:
            raise DataError(
                sub, f"several feature files {files}: choose one with `{config_key}=<file>`"
            )
        if not files:
            return None
        choice = files[0]
    path = sub / choice
    if not path.is_file():
        raise DataError(path, f"not found; `{config_key}` must be one of {files}")
    x = np.load(path, allow_pickle=False)
    if x.ndim != 2 or x.shape[0] != n:
        raise DataError(path, f"expected a matrix [{n}, d] (one row per node), got {x.shape}")
    x = x.astype(np.float32)
    available = np.isfinite(x).all(axis=1) & (x != 0).any(axis=1)
    x[~available] = 0.0
    return torch.from_numpy(x), torch.from_numpy(available)


def load_magb(
    path: str | os.PathLike[str],
    text_feature: str | None = None,
    image_feature: str | None = None,
    label_column: str = "label",
    neighbors_column: str = "neighbors",
    name: str | None = None,
) -> MultimodalGraph:
    """Load a MAGB / OpenMAG-style folder, e.g. ``Data/Grocery`` (module docstring).

    Args:
        text_feature, image_feature: the file in ``TextFeature/`` / ``ImageFeature/``
            (required when there are several).
        label_column: the integer class column of the node table.
        neighbors_column: the adjacency-list column; without one, ``edges.csv`` or
            ``edge_index.npy`` beside the table (folder format).
        name: the dataset name (default: the folder's name).

    Returns a graph with modalities ``text`` and/or ``image``; a row that is all zeros or
    not finite is a node without that modality (masked, zeroed). An optional
    ``class_names.json`` list in the folder names the classes."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(folder, "dataset folder does not exist (see docs/datasets.md, MAGB)")
    table = _node_csv(folder)
    y, neighbors = _read_table(table, label_column, neighbors_column)
    n = len(y)
    features, masks = {}, []
    for m, choice in (("text", text_feature), ("image", image_feature)):
        got = _feature(folder, m, choice, n)
        if got is not None:
            features[m], mask = got
            masks.append(mask)
    if not features:
        raise DataError(folder, "no TextFeature/ or ImageFeature/ .npy file")
    names_file = folder / "class_names.json"
    num_classes = int(y.max()) + 1
    class_names = [str(c) for c in range(num_classes)]
    if names_file.is_file():
        class_names = json.loads(names_file.read_text(encoding="utf-8"))
        if len(class_names) < num_classes:
            raise DataError(
                names_file, f"expected {num_classes} class names, got {len(class_names)}"
            )
    return MultimodalGraph(
        name=name or folder.resolve().name,
        features=features,
        mask=torch.stack(masks, dim=1),
        edge_index=_edges(folder, table, neighbors, n),
        y=torch.from_numpy(y),
        class_names=list(class_names),
    )
