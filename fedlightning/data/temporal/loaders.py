"""Readers of temporal interaction files (JODIE CSV, Wikipedia txt, Bitcoin CSV, any
``src dst time [label] [features...]`` list) and a synthetic stream with planted dynamic
labels (see ``docs/datasets.md``).

Every reader returns an :class:`~fedlightning.data.temporal.events.EventStream` and raises
:class:`~fedlightning.errors.DataError` naming the file, the line (1-based, as an editor
shows it), the field and what was expected. Files are parsed in one vectorised pass; only
when that fails is the file scanned line by line to find the offending line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fedlightning.data.temporal.events import EventStream
from fedlightning.errors import ConfigError, DataError

__all__ = [
    "load_jodie_csv",
    "load_wikipedia_txt",
    "load_bitcoin_csv",
    "load_interactions",
    "make_synthetic_stream",
]

log = logging.getLogger(__name__)

# The header of the published JODIE files names all feature columns with this one name.
_JODIE_FEATURES = "comma_separated_list_of_features"
_JODIE_COLUMNS = ("user_id", "item_id", "timestamp", "state_label")
_WIKI_COLUMNS = ("user", "item", "timestamp")
_BITCOIN_COLUMNS = ("source", "target", "rating", "time")


# ------------------------------------------------------------------------------------------
# parsing helpers


def _read_text(path: Path, what: str) -> str:
    """The file's text; a missing or undecodable file is a DataError naming ``what``."""
    if not path.is_file():
        raise DataError(path, f"file missing or not a regular file: expected {what}")
    try:
        # utf-8-sig: spreadsheet programs often prepend a byte-order mark.
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(path, f"not readable UTF-8 text ({type(e).__name__}: {e})") from e


def _read_events(path: Path, what: str, comments: bool = False) -> list[tuple[int, str]]:
    """The non-blank lines of ``path`` as ``(line number, text)``, without the ``#`` lines
    when ``comments``; a file without any is a DataError ``no events: expected {what}``."""
    text = _read_text(path, what)
    rows = [
        (i, ln)
        for i, ln in enumerate(text.splitlines(), start=1)
        if ln.strip() and not (comments and ln.lstrip().startswith("#"))
    ]
    if not rows:
        raise DataError(path, f"no events: expected {what}")
    return rows


def _field_error(
    path: Path, line: object, field: str, col: int, expected: str, got: object
) -> DataError:
    """The error of every bad value: ``line L: field `F` (column C): expected E, got G``."""
    return DataError(
        path, f"line {line}: field `{field}` (column {col}): expected {expected}, got {got}"
    )


def _split(line: str, sep: str | None) -> list[str]:
    return [p.strip() for p in line.split(sep)]


def _loadtxt(
    rows: Sequence[tuple[int, str]], sep: str | None, ncols: int, dtype: type = np.float64
) -> np.ndarray | None:
    """``rows`` parsed in one vectorised pass as ``[len(rows), ncols]``, else ``None``."""
    try:
        m = np.loadtxt([ln for _, ln in rows], delimiter=sep, dtype=dtype, ndmin=2, comments=None)
    except ValueError:
        return None
    return m if m.shape == (len(rows), ncols) else None


def _parse_table(
    path: Path,
    rows: Sequence[tuple[int, str]],
    names: Sequence[str],
    sep: str | None,
    integer: bool,
    layout: str,
) -> np.ndarray:
    """``rows`` as an int64 (``integer``) or float64 matrix ``[len(rows), len(names)]``.

    ``layout`` describes a row in messages, e.g. ``"3 integers `user item timestamp`"``.
    """
    dtype = np.int64 if integer else np.float64
    ncols = len(names)
    # The fast path; on failure the scan below finds and names the offending line.
    out = _loadtxt(rows, sep, ncols, dtype)
    if out is not None:
        return out
    kind = "an integer" if integer else "a number"
    out = np.empty((len(rows), ncols), dtype=dtype)
    for r, (lineno, ln) in enumerate(rows):
        parts = _split(ln, sep)
        if len(parts) != ncols:
            raise DataError(
                path,
                f"line {lineno}: expected {ncols} columns ({layout}), got {len(parts)}: "
                f"{ln[:80]!r}",
            )
        for j, p in enumerate(parts):
            try:
                out[r, j] = int(p) if integer else float(p)
            except (ValueError, OverflowError):
                raise _field_error(path, lineno, names[j], j + 1, kind, repr(p[:40])) from None
    return out


def _check_sorted(path: Path, t: np.ndarray, linenos: np.ndarray, field: str, why: str) -> None:
    down = np.flatnonzero(np.diff(t) < 0)
    if down.size:
        i = int(down[0]) + 1
        raise DataError(
            path,
            f"line {linenos[i]}: field `{field}`: expected non-decreasing times ({why}), "
            f"got {t[i]} after {t[i - 1]} on line {linenos[i - 1]}",
        )


def _time_array(t: np.ndarray) -> np.ndarray:
    """Integer times as int64; float times as int64 when all are integral (and fit), else
    float64."""
    if t.dtype.kind in "iu":
        return t.astype(np.int64)
    t = t.astype(np.float64, copy=False)
    if t.size and np.all(np.floor(t) == t) and np.all(np.abs(t) < 2.0**62):
        return t.astype(np.int64)
    return t


def _labels(
    path: Path, values: np.ndarray, linenos: np.ndarray, field: str, got: Callable[[int], str]
) -> np.ndarray:
    """Column 4 as int64 state labels; a value other than 0 and 1 is a DataError naming
    ``field`` and showing the row's value as ``got(row)``."""
    bad = np.flatnonzero((values != 0) & (values != 1))
    if bad.size:
        r = int(bad[0])
        raise _field_error(path, linenos[r], field, 4, "a state label 0 or 1", got(r))
    return values.astype(np.int64)


def _map_ids(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct raw ids, sorted (as numbers for int64, as text for strings), and indices."""
    ids, inv = np.unique(values, return_inverse=True)
    return ids, inv.reshape(-1).astype(np.int64)


def _stream(
    path: Path,
    name: str,
    src_raw: np.ndarray,
    dst_raw: np.ndarray,
    t: np.ndarray,
    bipartite: bool,
    label: np.ndarray | None = None,
    msg: np.ndarray | None = None,
) -> EventStream:
    """The events sorted stably by time (equal times keep their file order), raw ids mapped
    to nodes, as an :class:`EventStream` read from ``path``.

    ``bipartite``: sources sorted by raw id become nodes ``0..U-1`` (``"u<raw>"``, type 0),
    destinations sorted ``U..U+I-1`` (``"i<raw>"``, type 1). Else the distinct raw ids of
    both sides, sorted, become ``0..N-1`` (names ``"<raw>"``, one node type).
    """
    order = np.argsort(t, kind="stable")
    src_raw, dst_raw = src_raw[order], dst_raw[order]
    if bipartite:
        u_ids, src = _map_ids(src_raw)
        i_ids, dst = _map_ids(dst_raw)
        n_u, n_i = len(u_ids), len(i_ids)
        num_nodes = n_u + n_i
        dst = dst + n_u
        node_type = np.concatenate([np.zeros(n_u, np.int64), np.ones(n_i, np.int64)])
        node_names = [f"u{r}" for r in u_ids.tolist()] + [f"i{r}" for r in i_ids.tolist()]
    else:
        ids, inv = _map_ids(np.concatenate([src_raw, dst_raw]))
        src, dst = inv[: len(order)], inv[len(order) :]
        num_nodes = len(ids)
        node_type = np.zeros(num_nodes, np.int64)
        node_names = [str(r) for r in ids.tolist()]
    return EventStream(
        name=name,
        src=np.ascontiguousarray(src),
        dst=np.ascontiguousarray(dst),
        t=_time_array(t[order]),
        num_nodes=num_nodes,
        bipartite=bipartite,
        node_type=node_type,
        label=None if label is None else label[order],
        msg=None if msg is None else np.ascontiguousarray(msg[order]),
        source=str(path),
        node_names=node_names,
    )


# ------------------------------------------------------------------------------------------
# JODIE CSV


def load_jodie_csv(path: str | Path, name: str | None = None) -> EventStream:
    r"""Loads a stream in the JODIE CSV format (Wikipedia, Reddit, MOOC with state labels).

    One header line, then one event per line: ``user_id,item_id,timestamp,state_label,f1,...,fd``
    (``d >= 0``), sorted by time. The header's names are not checked, only that it has at
    least 4 columns; every row must have as many columns as the header. The published
    files name all features with one header column ``comma_separated_list_of_features``;
    with that header, the number of columns is taken from the first event line.

    Users and items are two id spaces: users sorted by raw id become nodes ``0..U-1``
    (``node_type`` 0, names ``"u<raw>"``), items sorted by raw id nodes ``U..U+I-1``
    (``node_type`` 1, names ``"i<raw>"``).

    Args:
        path (str or Path): the CSV file.
        name (str, optional): the dataset name. (default: the file name without suffix)

    Returns:
        EventStream: bipartite; ``t`` int64 when all timestamps are integral, else float64;
        ``label`` int64 0/1; ``msg`` float32 ``[E, d]`` (``None`` when ``d == 0``).

    Raises:
        DataError: naming the file, the line (the header is line 1), the field and what
            was expected: an empty or header-only file, a row with another number of
            columns, a non-numeric or non-finite value, a non-integer id, a state label
            other than 0/1, a time smaller than the one before.
    """
    path = Path(path)
    what = "JODIE CSV `user_id,item_id,timestamp,state_label,f1..fd` with one header line"
    lines = _read_text(path, what).splitlines()
    if not any(ln.strip() for ln in lines):
        raise DataError(path, f"empty file: expected {what}")
    if not lines[0].strip():
        raise DataError(path, f"line 1: expected the header line, got an empty line ({what})")
    header = _split(lines[0], ",")
    if len(header) < 4:
        raise DataError(
            path,
            f"line 1: expected a header of at least 4 columns "
            f"`user_id,item_id,timestamp,state_label[,f1..fd]`, got {lines[0][:80]!r}",
        )
    rows = [(i, ln) for i, ln in enumerate(lines[1:], start=2) if ln.strip()]
    if not rows:
        raise DataError(path, f"no events after the header line: expected {what}")

    names = list(header)
    if len(header) >= 5 and header[-1].lower() == _JODIE_FEATURES:
        ncols = len(_split(rows[0][1], ","))
        if ncols < len(header) - 1:
            raise DataError(
                path,
                f"line {rows[0][0]}: expected at least {len(header) - 1} columns "
                f"`{','.join(header[:-1])},...`, got {ncols}",
            )
        names = header[:-1] + [f"feature {k}" for k in range(1, ncols - len(header) + 2)]
    layout = f"as many as the header: `{','.join(header)[:80]}`"
    m = _parse_table(path, rows, names, ",", integer=False, layout=layout)
    linenos = np.array([i for i, _ in rows])

    finite = np.isfinite(m)
    if not finite.all():
        r, j = np.argwhere(~finite)[0]
        raise _field_error(path, linenos[r], names[j], j + 1, "a finite number", m[r, j])
    for j in (0, 1):
        bad = np.flatnonzero(m[:, j] != np.floor(m[:, j]))
        if bad.size:
            r = bad[0]
            raise _field_error(path, linenos[r], names[j], j + 1, "an integer id", m[r, j])
    label = _labels(path, m[:, 3], linenos, names[3], lambda r: f"{m[r, 3]:g}")
    _check_sorted(path, m[:, 2], linenos, names[2], "JODIE files are sorted by time")
    return _stream(
        path,
        name if name is not None else path.stem,
        m[:, 0].astype(np.int64),
        m[:, 1].astype(np.int64),
        m[:, 2],
        bipartite=True,
        label=label,
        msg=m[:, 4:].astype(np.float32) if m.shape[1] > 4 else None,
    )


# ------------------------------------------------------------------------------------------
# Wikipedia txt


def load_wikipedia_txt(path: str | Path, name: str = "wikipedia") -> EventStream:
    r"""Loads the JODIE Wikipedia edit stream as ``user item timestamp`` lines.

    Space-separated integers, one event per line, no header, sorted by time. Users sorted
    by raw id become nodes ``0..U-1`` (names ``"u<raw>"``), pages sorted by raw id nodes
    ``U..U+I-1`` (names ``"i<raw>"``), as in :func:`load_jodie_csv`.

    Args:
        path (str or Path): the text file (``temporal/ml_wikipedia.txt``).
        name (str, optional): the dataset name. (default: ``"wikipedia"``)

    Returns:
        EventStream: bipartite, ``t`` int64, no labels, no features.

    Raises:
        DataError: naming the file and the line: an empty file, a line that is not 3
            integers, a time smaller than the one before.
    """
    path = Path(path)
    rows = _read_events(path, "`user item timestamp` integer lines")
    m = _parse_table(
        path, rows, _WIKI_COLUMNS, None, integer=True, layout="3 integers `user item timestamp`"
    )
    linenos = np.array([i for i, _ in rows])
    _check_sorted(path, m[:, 2], linenos, "timestamp", "the file is sorted by time")
    return _stream(path, name, m[:, 0], m[:, 1], m[:, 2], bipartite=True)


# ------------------------------------------------------------------------------------------
# Bitcoin CSV


def load_bitcoin_csv(
    path: str | Path, name: str = "bitcoin_alpha", rating_feature: bool = False
) -> EventStream:
    r"""Loads a SNAP signed trust network (Bitcoin Alpha / OTC) as a labelled event stream.

    Lines ``source,target,rating,time`` (integers, no header, ratings in ``-10..10``), in
    any order: the events are sorted stably by time, so events of equal time keep their
    file order. Sources and targets share one id space: the distinct raw ids sorted become
    nodes ``0..N-1`` (names ``"<raw>"``). An event's state label is ``rating < 0``
    (distrust). Its one edge feature ``rating / 10`` gives the label away, so it is left
    out unless asked for.

    Args:
        path (str or Path): the CSV file (``temporal/soc-sign-bitcoinalpha.csv``).
        name (str, optional): the dataset name. (default: ``"bitcoin_alpha"``)
        rating_feature (bool, optional): if set, ``msg`` is ``rating / 10`` as a float32
            ``[E, 1]`` feature; never use it as an input when predicting the label.
            (default: :obj:`False`)

    Returns:
        EventStream: one node type (``bipartite=False``, ``node_type`` zeros), ``t`` int64,
        ``label`` int64 0/1, ``msg`` ``None`` or ``[E, 1]``.

    Raises:
        DataError: naming the file and the line: an empty file, a line that is not 4
            integers, a rating outside ``-10..10``.
    """
    path = Path(path)
    rows = _read_events(path, "`source,target,rating,time` integer lines")
    m = _parse_table(
        path,
        rows,
        _BITCOIN_COLUMNS,
        ",",
        integer=True,
        layout="4 integers `source,target,rating,time`, no header",
    )
    bad = np.flatnonzero((m[:, 2] < -10) | (m[:, 2] > 10))
    if bad.size:
        r = bad[0]
        raise _field_error(path, rows[r][0], "rating", 3, "an integer in -10..10", m[r, 2])
    rating = m[:, 2]
    return _stream(
        path,
        name,
        m[:, 0],
        m[:, 1],
        m[:, 3],
        bipartite=False,
        label=(rating < 0).astype(np.int64),
        msg=(rating / 10.0).astype(np.float32)[:, None] if rating_feature else None,
    )


# ------------------------------------------------------------------------------------------
# generic interaction list: src dst time [label] [features...]

# Separator names accepted besides the characters themselves (`dataset.sep=tab`).
_SEPARATORS = {
    "tab": "\t",
    "\t": "\t",
    "comma": ",",
    ",": ",",
    "semicolon": ";",
    ";": ";",
    "space": None,
    "whitespace": None,
    " ": None,
}
_SEP_NAMES = {"\t": "tab", ",": "comma", ";": "semicolon", None: "whitespace"}
_GENERIC = "`src dst time [label] [features...]`"


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _column_floats(
    path: Path, values: Sequence[str], linenos: np.ndarray, field: str, col: int
) -> np.ndarray:
    """One column as float64; the first value that is not a finite number is a DataError."""
    try:
        out = np.asarray(values, dtype=np.str_).astype(np.float64)
        ok = np.isfinite(out)
        if ok.all():
            return out
        bad = int(np.argmin(ok))
    except ValueError:
        bad = next(i for i, v in enumerate(values) if not _is_number(v))
    raise _field_error(path, linenos[bad], field, col, "a finite number", repr(values[bad][:40]))


def load_interactions(
    path: str | Path,
    bipartite: bool | None,
    labels: bool | None = None,
    sep: str | None = None,
    header: bool | None = None,
    name: str | None = None,
) -> EventStream:
    r"""Loads a plain interaction list ``src dst time [label] [features...]``, one a line.

    Columns are separated by tabs, commas, semicolons or runs of spaces: ``sep`` (``None``:
    a tab if the first line has one, else a comma, else whitespace). Lines starting with
    ``#`` are comments; blank lines are skipped. The first line is a header when its third
    field (the time) is not a number, unless ``header`` says otherwise. Every line has the
    same number of columns (at least 3).

    * ``src``, ``dst``: any tokens; integers are sorted as numbers, other ids as strings.
    * ``time``: any finite numbers, in any order: the events are sorted stably by time, so
      events of equal time keep their file order. ``t`` is int64 when every time is
      integral, else float64.
    * ``label`` (column 4): the event's state label, 0 or 1. With ``labels=None`` (default)
      a file of 4 or more columns has one, as the layout says; ``labels=False`` reads every
      column after the time as a feature, ``labels=True`` requires the label column.
    * ``features``: the remaining columns, finite numbers, as ``msg`` float32 ``[E, d]``.

    Id spaces: with ``bipartite=False`` sources and destinations share one id space: the
    distinct raw ids of both, sorted, become nodes ``0..N-1`` (names ``"<raw>"``, one node
    type). With ``bipartite=True`` they are two: sources sorted become ``0..U-1`` (names
    ``"u<raw>"``, ``node_type`` 0), destinations sorted ``U..U+I-1`` (``"i<raw>"``, type 1),
    so an id seen on both sides is two nodes; when any is, one warning gives their number
    and the node count of the shared reading.

    Args:
        path (str or Path): the text file.
        bipartite (bool): two id spaces (users and items) or one (``dataset.bipartite``);
            no default, as either reading of the other's file is silently wrong.
        labels (bool, optional): whether column 4 is a label (default: when present).
        sep (str, optional): ``"\t"``/``"tab"``, ``","``/``"comma"``, ``";"``,
            ``" "``/``"whitespace"``, or ``None`` to detect (default).
        header (bool, optional): whether the first line is a header (default: detect).
        name (str, optional): the dataset name. (default: the file name without suffix)

    Returns:
        EventStream: in time order; ``label`` int64 or ``None``; ``msg`` float32 or ``None``.

    Raises:
        DataError: naming the file, the line, the field and what was expected.
        ConfigError: for a ``bipartite``, ``labels``, ``sep`` or ``header`` of the wrong kind.
    """
    if not isinstance(bipartite, bool):
        raise ConfigError(
            "dataset.bipartite",
            f"must be set to true (sources and destinations are two id spaces, e.g. users and "
            f"items) or false (one shared id space), got {bipartite!r}",
        )
    for key, value in (("labels", labels), ("header", header)):
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"dataset.{key}", f"expected true, false or null, got {value!r}")
    if sep is not None and sep not in _SEPARATORS:
        raise ConfigError(
            "dataset.sep",
            f"expected one of {sorted(k for k in _SEPARATORS if k.strip())} or null "
            f"(detect), got {sep!r}",
        )
    path = Path(path)
    rows = _read_events(path, f"{_GENERIC} lines", comments=True)
    if sep is not None:
        delim = _SEPARATORS[sep]
    else:
        first = rows[0][1]
        delim = "\t" if "\t" in first else "," if "," in first else None
    sep_name = _SEP_NAMES[delim]
    first_line, first_fields = rows[0][0], _split(rows[0][1], delim)
    ncols = len(first_fields)
    if ncols < 3:
        raise DataError(
            path,
            f"line {first_line}: expected at least 3 {sep_name}-separated columns {_GENERIC}, "
            f"got {ncols}: {rows[0][1][:80]!r}",
        )
    has_header = not _is_number(first_fields[2]) if header is None else header
    if has_header:
        rows = rows[1:]
        if not rows:
            raise DataError(path, f"no events after the header line: expected {_GENERIC}")
    has_label = ncols >= 4 if labels is None else labels
    if has_label and ncols < 4:
        raise DataError(
            path,
            f"field `label`: dataset.labels=true, but the lines have {ncols} columns; expected "
            f"{_GENERIC} with the label in column 4",
        )
    first_feature = 4 if has_label else 3
    names = ["src", "dst", "time", "label"][:first_feature] + [
        first_fields[j] if has_header else f"feature {j - first_feature + 1}"
        for j in range(first_feature, ncols)
    ]
    linenos = np.array([i for i, _ in rows])

    table = _numeric_table(rows, delim, ncols)
    if table is not None:  # the fast path: every field a finite number, integral ids
        src_raw, dst_raw = table[:, 0].astype(np.int64), table[:, 1].astype(np.int64)
        t = table[:, 2]
        label_raw = table[:, 3] if has_label else None
        msg = table[:, first_feature:].astype(np.float32) if ncols > first_feature else None
        shown = table
    else:  # field by field, naming the first bad line and column
        parts = [_split(ln, delim) for _, ln in rows]
        for (lineno, ln), p in zip(rows, parts, strict=True):
            if len(p) != ncols:
                raise DataError(
                    path,
                    f"line {lineno}: expected {ncols} {sep_name}-separated columns (as line "
                    f"{first_line}), got {len(p)}: {ln[:80]!r}",
                )
        cols = list(zip(*parts, strict=True))
        for j in (0, 1):
            empty = [i for i, v in enumerate(cols[j]) if not v]
            if empty:
                raise _field_error(
                    path, linenos[empty[0]], names[j], j + 1, "an id", "an empty field"
                )
        t = _column_floats(path, cols[2], linenos, "time", 3)
        label_raw = _column_floats(path, cols[3], linenos, "label", 4) if has_label else None
        msg = None
        if ncols > first_feature:
            msg = np.stack(
                [
                    _column_floats(path, cols[j], linenos, names[j], j + 1)
                    for j in range(first_feature, ncols)
                ],
                axis=1,
            ).astype(np.float32)
        src_raw = np.asarray(cols[0], dtype=np.str_)
        dst_raw = np.asarray(cols[1], dtype=np.str_)
        if _is_int_array(src_raw) and _is_int_array(dst_raw):  # sorted as numbers
            src_raw, dst_raw = src_raw.astype(np.int64), dst_raw.astype(np.int64)
        shown = None
    label = None
    if label_raw is not None:
        label = _labels(
            path,
            label_raw,
            linenos,
            "label",
            lambda r: f"{shown[r, 3]:g}" if shown is not None else repr(cols[3][r][:40]),
        )
    if bipartite:  # the reading is the user's choice: say what it does to shared ids
        u_ids, i_ids = np.unique(src_raw), np.unique(dst_raw)
        n_u, n_i = len(u_ids), len(i_ids)
        both = np.intersect1d(u_ids, i_ids, assume_unique=True)
        if both.size:
            log.warning(
                "%s: %d ids appear as both source and destination; read as bipartite "
                "(dataset.bipartite=true) each is two nodes: %d sources + %d destinations = "
                "%d nodes. If sources and destinations share one id space, set "
                "dataset.bipartite=false (%d nodes).",
                path,
                both.size,
                n_u,
                n_i,
                n_u + n_i,
                n_u + n_i - both.size,
            )
    name = name if name is not None else path.stem
    return _stream(path, name, src_raw, dst_raw, t, bipartite, label=label, msg=msg)


def _numeric_table(
    rows: Sequence[tuple[int, str]], delim: str | None, ncols: int
) -> np.ndarray | None:
    """All rows as float64 when every field is a finite number and the ids are integers
    that float64 holds exactly; else ``None`` (the caller then reads field by field)."""
    m = _loadtxt(rows, delim, ncols)
    if m is None or not np.isfinite(m).all():
        return None
    ids = m[:, :2]
    if np.any(ids != np.floor(ids)) or np.any(np.abs(ids) >= 2.0**53):
        return None
    return m


def _is_int_array(values: np.ndarray) -> bool:
    """Whether every string of ``values`` is an integer (as ``int()`` reads it)."""
    try:
        values.astype(np.int64)
    except (ValueError, OverflowError):
        return False
    return True


# ------------------------------------------------------------------------------------------
# synthetic stream


def make_synthetic_stream(
    num_users: int = 200,
    num_items: int = 50,
    num_events: int = 5000,
    positive_rate: float = 0.05,
    feature_dim: int = 8,
    seed: int = 0,
    name: str = "synthetic",
) -> EventStream:
    r"""A small bipartite stream with learnable links and planted dynamic state labels.

    The generative process (all draws from ``numpy.random.default_rng(seed)``):

    1. Popularity: items get Zipf weights ``1 / rank`` over a random ranking; users get
       activity weights ``1 / rank**0.8`` over a random ranking.
    2. Favourites: each user draws ``min(3, num_items)`` favourite items (without
       replacement) from the item popularity.
    3. Events: each event's user is drawn by activity; its item is one of the user's
       favourites (uniformly) with probability 0.8, else an item drawn by popularity.
       Times are the cumulative sum of Poisson(3) gaps starting at 0 (integers; a gap is 0
       about 5% of the time, so ties occur).
    4. Triggers: a random subset of ``ceil(min(1, 4 * positive_rate) * num_users)``
       "risky" users each picks one of its own events uniformly as its trigger: that
       event's item is replaced by a trigger item (one of the ``max(1, num_items // 20)``
       least popular items) and its time ``tau_u`` is the user's switch time.
    5. Labels: an event of risky user ``u`` at time ``t`` is labelled 1 iff
       ``tau_u <= t < tau_u + w``; the window ``w`` (one for all users) is the smallest
       that makes ``round(positive_rate * num_events)`` events positive (more with ties,
       fewer when the risky users have too few events after their triggers). A label thus
       depends on the user's history (the trigger item) and on time (the window).
    6. Features: ``msg = N(0, I_d) + 0.75 * label * v`` with ``v`` a random unit vector, a
       weak signal of the label (``None`` when ``feature_dim == 0``).

    Args:
        num_users (int, optional): users, nodes ``0..num_users-1``. (default: :obj:`200`)
        num_items (int, optional): items, nodes after the users. (default: :obj:`50`)
        num_events (int, optional): events. (default: :obj:`5000`)
        positive_rate (float, optional): target fraction of label-1 events in ``[0, 1]``.
            (default: :obj:`0.05`)
        feature_dim (int, optional): edge feature size ``d >= 0``. (default: :obj:`8`)
        seed (int, optional): the random seed; equal seeds give equal streams.
            (default: :obj:`0`)
        name (str, optional): the dataset name. (default: ``"synthetic"``)

    Returns:
        EventStream: bipartite, ``t`` int64, ``label`` int64, ``msg`` float32 ``[E, d]``,
        node names ``"u<k>"`` and ``"i<k>"``.
    """
    if num_users < 1 or num_items < 1 or num_events < 1:
        raise ValueError(
            f"make_synthetic_stream: need num_users, num_items, num_events >= 1, got "
            f"{num_users}, {num_items}, {num_events}"
        )
    if not 0.0 <= positive_rate <= 1.0:
        raise ValueError(
            f"make_synthetic_stream: positive_rate must be in [0, 1], got {positive_rate}"
        )
    if feature_dim < 0:
        raise ValueError(f"make_synthetic_stream: feature_dim must be >= 0, got {feature_dim}")
    rng = np.random.default_rng(seed)

    # 1-2. popularity, activity, favourites
    item_rank = rng.permutation(num_items)
    pop = 1.0 / (item_rank + 1.0)
    pop /= pop.sum()
    act = 1.0 / (rng.permutation(num_users) + 1.0) ** 0.8
    act /= act.sum()
    k = min(3, num_items)
    fav = np.stack([rng.choice(num_items, size=k, replace=False, p=pop) for _ in range(num_users)])

    # 3. events
    user = rng.choice(num_users, size=num_events, p=act)
    from_fav = rng.random(num_events) < 0.8
    item = np.where(
        from_fav,
        fav[user, rng.integers(k, size=num_events)],
        rng.choice(num_items, size=num_events, p=pop),
    )
    gaps = rng.poisson(3.0, size=num_events)
    gaps[0] = 0
    t = np.cumsum(gaps).astype(np.int64)

    # 4. triggers
    n_risky = int(np.ceil(min(1.0, 4.0 * positive_rate) * num_users))
    risky = rng.choice(num_users, size=n_risky, replace=False)
    trigger_items = np.argsort(-item_rank)[: max(1, num_items // 20)]  # least popular
    tau = np.full(num_users, np.inf)
    for u in np.sort(risky):
        own = np.flatnonzero(user == u)
        if own.size == 0:
            continue
        e = own[rng.integers(own.size)]
        item[e] = trigger_items[rng.integers(trigger_items.size)]
        tau[u] = t[e]

    # 5. labels: the window w that gives round(positive_rate * E) positives
    delta = t - tau[user]  # -inf for users without a trigger
    after = np.sort(delta[delta >= 0])
    target = int(round(positive_rate * num_events))
    if target == 0:
        w = 0.0
    elif target >= after.size:
        w = np.inf
    else:
        w = after[target - 1] + 1.0
    label = ((delta >= 0) & (delta < w)).astype(np.int64)

    # 6. features
    msg = None
    if feature_dim > 0:
        v = rng.normal(size=feature_dim)
        v /= np.linalg.norm(v)
        noise = rng.normal(size=(num_events, feature_dim))
        msg = (noise + 0.75 * label[:, None] * v).astype(np.float32)

    return EventStream(
        name=name,
        src=user.astype(np.int64),
        dst=(item + num_users).astype(np.int64),
        t=t,
        num_nodes=num_users + num_items,
        bipartite=True,
        node_type=np.concatenate([np.zeros(num_users, np.int64), np.ones(num_items, np.int64)]),
        label=label,
        msg=msg,
        source="synthetic",
        node_names=[f"u{i}" for i in range(num_users)] + [f"i{i}" for i in range(num_items)],
    )
