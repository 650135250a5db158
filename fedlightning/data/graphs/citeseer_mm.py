"""CiteSeer with two real modalities: MiniLM text embeddings and the bag-of-words."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from fedlightning.data.files import load_npy, read_json, read_lines, require_dir, require_file
from fedlightning.data.graphs.base import MultimodalGraph, clean_edges, full_mask
from fedlightning.data.graphs.planetoid import data_root, read_gnn_benchmark_npz
from fedlightning.errors import DataError

__all__ = ["load_citeseer_mm"]


def _read_ids(path: Path) -> list[str]:
    require_file(path, "the JSON list of paper ids, one per row of citeseer_minilm.npy")
    ids = read_json(path)
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise DataError(path, "expected a JSON list of non-empty paper-id strings")
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(path, f"expected distinct paper ids, {dup!r} appears more than once")
    return ids


def _read_embeddings(path: Path, n: int) -> np.ndarray:
    x = load_npy(require_file(path, f"the float32 [{n}, 384] MiniLM text embeddings"))
    if x.ndim != 2 or x.shape[0] != n or not np.issubdtype(x.dtype, np.floating):
        raise DataError(
            path,
            f"expected a float matrix [{n}, d] (one row per id of "
            f"citeseer_minilm_ids.json), got shape {x.shape} dtype {x.dtype}",
        )
    if not np.isfinite(x).all():
        raise DataError(path, "expected finite values, found NaN or inf")
    return x.astype(np.float32, copy=False)


def read_tape_records(path: Path) -> dict[str, tuple[str, str]]:
    """Paper id -> (title and abstract, class name) from the TAPE records (three lines each)."""
    require_file(path, "the TAPE records: paper id, title and abstract, class name")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(path, f"expected UTF-8 text ({e})") from e
    # splitlines also handles CRLF; trailing blank lines (a final newline) carry no record.
    lines = [ln.strip() for ln in text.rstrip().splitlines()]
    if len(lines) % 3:
        raise DataError(
            path,
            f"expected records of three lines (id, text, class), got "
            f"{len(lines)} lines, not a multiple of 3",
        )
    records: dict[str, tuple[str, str]] = {}
    for start in range(0, len(lines), 3):
        pid, label = lines[start], lines[start + 2]
        # Ids and class names are single tokens; a text line in either slot means the
        # records are out of step (e.g. a text that spans two lines).
        for what, value, offset in (("paper id", pid, 0), ("class name", label, 2)):
            if not value or len(value.split()) != 1:
                raise DataError(
                    path,
                    f"line {start + offset + 1}: expected a {what} (one token), got {value[:60]!r}",
                )
        old = records.setdefault(pid, (lines[start + 1], label))[1]
        if old != label:
            raise DataError(
                path, f"line {start + 1}: paper {pid!r} has two classes, {old!r} and {label!r}"
            )
    return records


def _read_cites(path: Path, index: dict[str, int]) -> torch.Tensor:
    pairs: list[tuple[int, int]] = []
    what = "the citations, one `cited citing` pair of paper ids per line"
    for lineno, line in read_lines(require_file(path, what), what):
        tok = line.split()
        if len(tok) != 2:
            raise DataError(
                path, f"line {lineno}: expected two paper ids `cited citing`, got {line[:80]!r}"
            )
        # Citations of papers outside the 3,186 (no text, hence no embedding) are dropped.
        if tok[0] in index and tok[1] in index:
            pairs.append((index[tok[0]], index[tok[1]]))
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).T


def load_citeseer_mm(root: str | os.PathLike[str] | None = None) -> MultimodalGraph:
    """Load ``citeseer_mm`` (``docs/datasets.md``): the 3,186 CiteSeer papers with known
    texts, in the order of ``citeseer_minilm_ids.json``, with modalities ``text`` (float32
    ``[3186, 384]`` MiniLM embeddings) and ``bow`` (float32 0/1 ``[3186, 3703]``, the rows
    of ``citeseer.npz`` named by the paper ids); labels from ``citeseer_texts.txt``, class
    names sorted; the citations between two of the papers, undirected, no self loops. A
    missing or malformed file, or a paper id missing from one, is a DataError."""
    base = data_root(root)
    tape = require_dir(
        base / "citeseer_tape",
        "citeseer_minilm_ids.json, citeseer_minilm.npy, citeseer_texts.txt and citeseer.cites",
    )
    ids = _read_ids(tape / "citeseer_minilm_ids.json")
    n = len(ids)
    index = {pid: i for i, pid in enumerate(ids)}
    text = _read_embeddings(tape / "citeseer_minilm.npy", n)

    npz_path = require_dir(base / "gnn_benchmark", "citeseer.npz") / "citeseer.npz"
    z = read_gnn_benchmark_npz(npz_path)
    if z.node_names is None:
        raise DataError(npz_path, "missing field `node_names`: needed to match the paper ids")
    row_of = {name: i for i, name in enumerate(z.node_names)}
    missing = [pid for pid in ids if pid not in row_of]
    if missing:
        raise DataError(
            npz_path,
            f"field `node_names`: paper id {missing[0]!r} (of "
            f"citeseer_minilm_ids.json) not found; {len(missing)} missing",
        )
    bow = z.attr[np.array([row_of[pid] for pid in ids], dtype=np.int64)].toarray()

    texts_path = tape / "citeseer_texts.txt"
    classes = {pid: label for pid, (_, label) in read_tape_records(texts_path).items()}
    unlabelled = [pid for pid in ids if pid not in classes]
    if unlabelled:
        raise DataError(
            texts_path,
            f"paper id {unlabelled[0]!r} (of citeseer_minilm_ids.json) "
            f"has no record; {len(unlabelled)} missing",
        )
    class_names = sorted({classes[pid] for pid in ids})
    label_of = {c: i for i, c in enumerate(class_names)}
    y = torch.tensor([label_of[classes[pid]] for pid in ids], dtype=torch.long)

    edge_index = clean_edges(_read_cites(tape / "citeseer.cites", index), n)
    return MultimodalGraph(
        name="citeseer_mm",
        features={
            "text": torch.from_numpy(np.ascontiguousarray(text)),
            "bow": torch.from_numpy(bow.astype(np.float32)),
        },
        mask=full_mask(n, 2),
        edge_index=edge_index,
        y=y,
        class_names=class_names,
        node_ids=list(ids),
    )
