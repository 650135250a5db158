"""Readers of temporal interaction files (JODIE CSV, Wikipedia txt, Bitcoin CSV, any
``src dst time [label] [features...]`` list) and a synthetic stream with planted dynamic
labels. ``docs/datasets.md`` gives the formats, the id mapping and the time order.

Every reader returns an :class:`~fedlightning.data.temporal.events.EventStream` and raises
:class:`~fedlightning.errors.DataError` naming the file, the line (1-based), the field and
what was expected; a file is scanned line by line only when the vectorised pass fails."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedlightning.data.files import field_error, read_lines, split_rows
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

_SEP_NAMES = {"\t": "tab", ",": "comma", ";": "semicolon", None: "whitespace"}
# `dataset.sep`: a separator's name or the character itself (" " and "space": whitespace)
_SEPARATORS = {**{v: k for k, v in _SEP_NAMES.items()}, **{k: k for k in _SEP_NAMES if k}}
_SEPARATORS.update({"space": None, " ": None})
_GENERIC = "`src dst time [label] [features...]`"

Rows = list[tuple[int, str]]


def _read_events(path: Path, what: str, comments: bool = False) -> Rows:
    rows = read_lines(path, what, comments)
    if not rows:
        raise DataError(path, f"no events: expected {what}")
    return rows


def _split(line: str, sep: str | None) -> list[str]:
    return [p.strip() for p in line.split(sep)]


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _loadtxt(
    rows: Rows, sep: str | None, ncols: int, dtype: type = np.float64
) -> np.ndarray | None:
    """``rows`` parsed in one vectorised pass as ``[len(rows), ncols]``, else ``None``."""
    try:
        m = np.loadtxt([ln for _, ln in rows], delimiter=sep, dtype=dtype, ndmin=2, comments=None)
    except ValueError:
        return None
    return m if m.shape == (len(rows), ncols) else None


def _integer_lines(path: Path, names: Sequence[str], sep: str | None) -> tuple[np.ndarray, Rows]:
    """The lines of a headerless file of integer columns ``names`` as an int64 matrix
    ``[E, len(names)]``, and the rows (for line numbers)."""
    layout = f"`{(sep or ' ').join(names)}`"
    rows = _read_events(path, f"{layout} integer lines")
    ncols = len(names)
    out = _loadtxt(rows, sep, ncols, np.int64)
    if out is not None:
        return out, rows
    out = np.empty((len(rows), ncols), dtype=np.int64)
    expected = f"{ncols} columns ({ncols} integers {layout}, no header)"
    for r, parts in enumerate(split_rows(path, rows, sep, ncols, expected)):
        for j, p in enumerate(parts):
            try:
                out[r, j] = int(p)
            except (ValueError, OverflowError):
                raise field_error(
                    path, rows[r][0], names[j], j + 1, "an integer", repr(p[:40])
                ) from None
    return out, rows


def _column_floats(
    path: Path, values: Sequence[str], rows: Rows, field: str, col: int
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
    raise field_error(path, rows[bad][0], field, col, "a finite number", repr(values[bad][:40]))


def _events_table(
    path: Path, rows: Rows, sep: str | None, names: Sequence[str], expected: str, text_ids: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src_raw, dst_raw, values)`` of ``src dst time ...`` rows: the ids int64 (with
    ``text_ids``, strings unless every one is an integer), the other columns as finite
    float64 ``[E, len(names) - 2]``. A row without ``len(names)`` fields is a DataError
    ``expected {expected}``; so is a bad field, naming it by ``names``."""
    ncols = len(names)
    m = _loadtxt(rows, sep, ncols)
    # the fast path: every field a finite number, ids integers that float64 holds exactly
    if m is not None and np.isfinite(m).all():
        ids = m[:, :2]
        if np.all(ids == np.floor(ids)) and np.all(np.abs(ids) < 2.0**53):
            return m[:, 0].astype(np.int64), m[:, 1].astype(np.int64), m[:, 2:]
    cols = list(zip(*split_rows(path, rows, sep, ncols, expected), strict=True))
    if not text_ids:  # field by field, naming the first bad line and column
        m = np.stack(
            [_column_floats(path, cols[j], rows, names[j], j + 1) for j in range(ncols)], 1
        )
        for j in (0, 1):
            bad = np.flatnonzero(m[:, j] != np.floor(m[:, j]))
            if bad.size:
                r = bad[0]
                raise field_error(path, rows[r][0], names[j], j + 1, "an integer id", m[r, j])
        return m[:, 0].astype(np.int64), m[:, 1].astype(np.int64), m[:, 2:]
    for j in (0, 1):
        empty = [i for i, v in enumerate(cols[j]) if not v]
        if empty:
            raise field_error(path, rows[empty[0]][0], names[j], j + 1, "an id", "an empty field")
    values = np.stack(
        [_column_floats(path, cols[j], rows, names[j], j + 1) for j in range(2, ncols)], axis=1
    )
    src_raw = np.asarray(cols[0], dtype=np.str_)
    dst_raw = np.asarray(cols[1], dtype=np.str_)
    try:  # integer ids are sorted as numbers
        return src_raw.astype(np.int64), dst_raw.astype(np.int64), values
    except (ValueError, OverflowError):
        return src_raw, dst_raw, values


def _check_sorted(path: Path, t: np.ndarray, rows: Rows, field: str, why: str) -> None:
    down = np.flatnonzero(np.diff(t) < 0)
    if down.size:
        i = int(down[0]) + 1
        raise DataError(
            path,
            f"line {rows[i][0]}: field `{field}`: expected non-decreasing times ({why}), "
            f"got {t[i]} after {t[i - 1]} on line {rows[i - 1][0]}",
        )


def _time_array(t: np.ndarray) -> np.ndarray:
    """int64 when every time is integral (and fits), else float64."""
    if t.dtype.kind in "iu":
        return t.astype(np.int64)
    t = t.astype(np.float64, copy=False)
    if t.size and np.all(np.floor(t) == t) and np.all(np.abs(t) < 2.0**62):
        return t.astype(np.int64)
    return t


def _labels(path: Path, values: np.ndarray, rows: Rows, field: str) -> np.ndarray:
    """Column 4 as int64 state labels; another value than 0 and 1 is a DataError."""
    bad = np.flatnonzero((values != 0) & (values != 1))
    if bad.size:
        r = int(bad[0])
        raise field_error(path, rows[r][0], field, 4, "a state label 0 or 1", f"{values[r]:g}")
    return values.astype(np.int64)


def _features(values: np.ndarray) -> np.ndarray | None:
    return values.astype(np.float32) if values.shape[1] else None


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
    warn_shared: bool = False,
) -> EventStream:
    """The events sorted stably by time, raw ids mapped to nodes (sorted raw ids; when
    ``bipartite``, sources ``0..U-1`` named ``u<raw>`` then destinations ``i<raw>``).
    ``warn_shared``: warn what the bipartite reading does to ids seen on both sides."""
    order = np.argsort(t, kind="stable")
    src_raw, dst_raw = src_raw[order], dst_raw[order]
    if bipartite:
        u_ids, src = _map_ids(src_raw)
        i_ids, dst = _map_ids(dst_raw)
        n_u, n_i = len(u_ids), len(i_ids)
        num_nodes = n_u + n_i
        both = np.intersect1d(u_ids, i_ids, assume_unique=True) if warn_shared else u_ids[:0]
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
                num_nodes,
                num_nodes - both.size,
            )
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


def load_jodie_csv(path: str | Path, name: str | None = None) -> EventStream:
    """Loads a JODIE CSV (Wikipedia, Reddit, MOOC): one header line, then
    ``user_id,item_id,timestamp,state_label,f1,...,fd`` lines (``d >= 0``), sorted by time.

    Returns a bipartite stream named ``name`` (default: the file's stem); ``label`` int64
    0/1; ``msg`` float32 ``[E, d]`` or ``None``. Raises a DataError for an empty file, a row
    unlike the header, a bad value, id or label, or a time smaller than the one before."""
    path = Path(path)
    what = "JODIE CSV `user_id,item_id,timestamp,state_label,f1..fd` with one header line"
    rows = read_lines(path, what)
    if not rows:
        raise DataError(path, f"empty file: expected {what}")
    if rows[0][0] != 1:
        raise DataError(path, f"line 1: expected the header line, got an empty line ({what})")
    header = _split(rows[0][1], ",")
    if len(header) < 4:
        raise DataError(
            path,
            f"line 1: expected a header of at least 4 columns "
            f"`user_id,item_id,timestamp,state_label[,f1..fd]`, got {rows[0][1][:80]!r}",
        )
    rows = rows[1:]
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
    expected = f"{len(names)} columns (as many as the header: `{','.join(header)[:80]}`)"
    src, dst, values = _events_table(path, rows, ",", names, expected, text_ids=False)
    label = _labels(path, values[:, 1], rows, names[3])
    _check_sorted(path, values[:, 0], rows, names[2], "JODIE files are sorted by time")
    name = name if name is not None else path.stem
    return _stream(path, name, src, dst, values[:, 0], True, label, _features(values[:, 2:]))


def load_wikipedia_txt(path: str | Path, name: str = "wikipedia") -> EventStream:
    """Loads the JODIE Wikipedia edit stream (``temporal/ml_wikipedia.txt``): lines of
    space-separated integers ``user item timestamp``, no header, sorted by time.

    Returns a bipartite stream (``t`` int64, no labels, no features). Raises a DataError
    for an empty file, a line that is not 3 integers, a time smaller than the one before."""
    path = Path(path)
    m, rows = _integer_lines(path, ("user", "item", "timestamp"), None)
    _check_sorted(path, m[:, 2], rows, "timestamp", "the file is sorted by time")
    return _stream(path, name, m[:, 0], m[:, 1], m[:, 2], bipartite=True)


def load_bitcoin_csv(
    path: str | Path, name: str = "bitcoin_alpha", rating_feature: bool = False
) -> EventStream:
    """Loads a SNAP signed trust network (Bitcoin Alpha / OTC,
    ``temporal/soc-sign-bitcoinalpha.csv``): lines ``source,target,rating,time`` of
    integers, no header, in any order (sorted stably by time here).

    Returns a stream of one node type whose ``label`` is ``rating < 0`` (distrust); with
    ``rating_feature``, ``msg`` is ``rating / 10`` ``[E, 1]``, which gives the label away.
    Raises a DataError for an empty file, a line not of 4 integers, a rating outside -10..10."""
    path = Path(path)
    m, rows = _integer_lines(path, ("source", "target", "rating", "time"), ",")
    rating = m[:, 2]
    bad = np.flatnonzero((rating < -10) | (rating > 10))
    if bad.size:
        r = bad[0]
        raise field_error(path, rows[r][0], "rating", 3, "an integer in -10..10", rating[r])
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


def load_interactions(
    path: str | Path,
    bipartite: bool | None,
    labels: bool | None = None,
    sep: str | None = None,
    header: bool | None = None,
    name: str | None = None,
) -> EventStream:
    """Loads a plain interaction list ``src dst time [label] [features...]``, one a line
    (``dataset=interactions``; the rules of separators, header, ids, times, labels and id
    spaces are in ``docs/datasets.md``).

    Args:
        path: the text file.
        bipartite: two id spaces (sources ``u<raw>``, destinations ``i<raw>``) or one; no
            default, as either reading of the other's file is silently wrong.
        labels: whether column 4 is a 0/1 label (default: when the lines have 4 or more).
        sep: ``"\\t"``/``"tab"``, ``","``/``"comma"``, ``";"``/``"semicolon"``,
            ``" "``/``"space"``/``"whitespace"``, or ``None`` to detect (default).
        header: whether the first line is a header (default: when its time is no number).
        name: the dataset name (default: the file name without suffix).

    Returns an EventStream in time order (``t`` int64 when every time is integral, else
    float64). Raises a DataError naming the file, line, field and expectation, a ConfigError
    for an argument of the wrong kind."""
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
    expected = f"{ncols} {sep_name}-separated columns (as line {first_line})"
    src_raw, dst_raw, values = _events_table(path, rows, delim, names, expected, text_ids=True)
    label = _labels(path, values[:, 1], rows, "label") if has_label else None
    msg = _features(values[:, first_feature - 2 :])
    name = name if name is not None else path.stem
    return _stream(
        path, name, src_raw, dst_raw, values[:, 0], bipartite, label, msg, warn_shared=True
    )


def make_synthetic_stream(
    num_users: int = 200,
    num_items: int = 50,
    num_events: int = 5000,
    positive_rate: float = 0.05,
    feature_dim: int = 8,
    seed: int = 0,
    name: str = "synthetic",
    label_shift: float = 0.75,
) -> EventStream:
    """A small bipartite stream with learnable links and planted dynamic state labels.

    All draws come from ``numpy.random.default_rng(seed)``, in the order of the numbered
    steps of ``docs/datasets.md`` (popularity, favourites, events, triggers, labels,
    features), so equal seeds give equal streams. ``positive_rate`` in ``[0, 1]`` is the
    target fraction of label-1 events, ``feature_dim >= 0`` the size of ``msg``, and
    ``label_shift`` the distance a label-1 event's features move along one random unit
    direction (the default 0.75 is a weak signal).

    Returns:
        EventStream: users ``0..num_users-1`` (``"u<k>"``), then items (``"i<k>"``); ``t``
        int64, ``label`` int64, ``msg`` float32 ``[E, d]`` (``None`` when ``d == 0``)."""
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
    if not np.isfinite(label_shift):
        raise ValueError(f"make_synthetic_stream: label_shift must be finite, got {label_shift}")
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
        msg = (noise + label_shift * label[:, None] * v).astype(np.float32)

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
