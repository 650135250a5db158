"""Readers shared by the data loaders; each raises a DataError naming the file, the line or
field, and what was expected."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedlightning.errors import DataError


def require_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise DataError(path, f"directory missing: expected {what} here (see docs/datasets.md)")
    return path


def require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DataError(path, f"file missing: expected {what} (see docs/datasets.md)")
    return path


def load_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise DataError(path, "file missing or not a regular file")
    try:
        # allow_pickle=False: object arrays would run code on load; numeric arrays need none.
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(path, f"not a readable numeric .npy array ({type(e).__name__}: {e})") from e


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(path, f"not valid UTF-8 JSON ({type(e).__name__}: {e})") from e


def read_lines(path: Path, what: str, comments: bool = False) -> list[tuple[int, str]]:
    """The non-blank lines of ``path`` as ``(1-based line number, text)``, without the lines
    starting with ``#`` when ``comments``."""
    if not path.is_file():
        raise DataError(path, f"file missing or not a regular file: expected {what}")
    try:
        # utf-8-sig: spreadsheet programs often prepend a byte-order mark.
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(path, f"not readable UTF-8 text ({type(e).__name__}: {e})") from e
    return [
        (i, ln)
        for i, ln in enumerate(text.splitlines(), start=1)
        if ln.strip() and not (comments and ln.lstrip().startswith("#"))
    ]


def field_error(
    path: Path, line: object, field: str, col: int, expected: str, got: object
) -> DataError:
    """The error of every bad value: ``line L: field `F` (column C): expected E, got G``."""
    return DataError(
        path, f"line {line}: field `{field}` (column {col}): expected {expected}, got {got}"
    )


def split_rows(
    path: Path, rows: Iterable[tuple[int, str]], sep: str | None, ncols: int, expected: str
) -> Iterator[list[str]]:
    """The stripped fields of each row, row by row; a row without ``ncols`` of them is a
    DataError ``line L: expected {expected}, got N: 'the line'``."""
    for lineno, ln in rows:
        parts = [p.strip() for p in ln.split(sep)]
        if len(parts) != ncols:
            raise DataError(
                path, f"line {lineno}: expected {expected}, got {len(parts)}: {ln[:80]!r}"
            )
        yield parts
