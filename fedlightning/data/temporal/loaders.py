"""Readers of temporal interaction files (JODIE CSV, Wikipedia txt, Bitcoin CSV) and a
synthetic stream with planted dynamic labels (see ``docs/datasets.md``).

Every reader returns an :class:`~fedlightning.data.temporal.events.EventStream` and raises
:class:`~fedlightning.errors.DataError` naming the file, the line (1-based, as an editor
shows it), the field and what was expected. Files are parsed in one vectorised pass; only
when that fails is the file scanned line by line to find the offending line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedlightning.data.temporal.events import EventStream
from fedlightning.errors import DataError

__all__ = ["load_jodie_csv", "load_wikipedia_txt", "load_bitcoin_csv", "make_synthetic_stream"]

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


def _read_rows(path: Path, what: str) -> list[tuple[int, str]]:
    """The non-blank lines of ``path`` as ``(line number, text)``."""
    text = _read_text(path, what)
    return [(i, ln) for i, ln in enumerate(text.splitlines(), start=1) if ln.strip()]


def _split(line: str, sep: str | None) -> list[str]:
    return [p.strip() for p in line.split(sep)]


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
    try:
        # The fast path; on failure the scan below finds and names the offending line.
        out = np.loadtxt([ln for _, ln in rows], delimiter=sep, dtype=dtype, ndmin=2, comments=None)
        if out.shape == (len(rows), ncols):
            return out
    except ValueError:
        pass
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
                raise DataError(
                    path,
                    f"line {lineno}: field `{names[j]}` (column {j + 1}): expected {kind}, "
                    f"got {p[:40]!r}",
                ) from None
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
    """Float times as int64 when all are integral (and fit), else float64."""
    t = t.astype(np.float64, copy=False)
    if t.size and np.all(np.floor(t) == t) and np.all(np.abs(t) < 2.0**62):
        return t.astype(np.int64)
    return t


def _bipartite(
    users: np.ndarray, items: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, list[str]]:
    """Raw user and item ids -> ``(src, dst, num_nodes, node_type, node_names)``.

    Users sorted by raw id become nodes ``0..U-1``, items sorted by raw id ``U..U+I-1``.
    """
    u_ids, src = np.unique(users, return_inverse=True)
    i_ids, dst = np.unique(items, return_inverse=True)
    n_u, n_i = len(u_ids), len(i_ids)
    node_type = np.concatenate([np.zeros(n_u, np.int64), np.ones(n_i, np.int64)])
    names = [f"u{int(r)}" for r in u_ids] + [f"i{int(r)}" for r in i_ids]
    return src.astype(np.int64), (dst + n_u).astype(np.int64), n_u + n_i, node_type, names


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
        raise DataError(
            path,
            f"line {linenos[r]}: field `{names[j]}` (column {j + 1}): expected a finite "
            f"number, got {m[r, j]}",
        )
    for j in (0, 1):
        bad = np.flatnonzero(m[:, j] != np.floor(m[:, j]))
        if bad.size:
            r = bad[0]
            raise DataError(
                path,
                f"line {linenos[r]}: field `{names[j]}` (column {j + 1}): expected an "
                f"integer id, got {m[r, j]}",
            )
    bad = np.flatnonzero((m[:, 3] != 0) & (m[:, 3] != 1))
    if bad.size:
        r = bad[0]
        raise DataError(
            path,
            f"line {linenos[r]}: field `{names[3]}` (column 4): expected a state label 0 or "
            f"1, got {m[r, 3]:g}",
        )
    _check_sorted(path, m[:, 2], linenos, names[2], "JODIE files are sorted by time")

    src, dst, num_nodes, node_type, node_names = _bipartite(
        m[:, 0].astype(np.int64), m[:, 1].astype(np.int64)
    )
    msg = m[:, 4:].astype(np.float32) if m.shape[1] > 4 else None
    return EventStream(
        name=name if name is not None else path.stem,
        src=src,
        dst=dst,
        t=_time_array(m[:, 2]),
        num_nodes=num_nodes,
        bipartite=True,
        node_type=node_type,
        label=m[:, 3].astype(np.int64),
        msg=msg,
        source=str(path),
        node_names=node_names,
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
    rows = _read_rows(path, "`user item timestamp` integer lines")
    if not rows:
        raise DataError(path, "no events: expected `user item timestamp` integer lines")
    m = _parse_table(
        path, rows, _WIKI_COLUMNS, None, integer=True, layout="3 integers `user item timestamp`"
    )
    linenos = np.array([i for i, _ in rows])
    _check_sorted(path, m[:, 2], linenos, "timestamp", "the file is sorted by time")
    src, dst, num_nodes, node_type, node_names = _bipartite(m[:, 0], m[:, 1])
    return EventStream(
        name=name,
        src=src,
        dst=dst,
        t=m[:, 2].astype(np.int64),
        num_nodes=num_nodes,
        bipartite=True,
        node_type=node_type,
        source=str(path),
        node_names=node_names,
    )


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
    rows = _read_rows(path, "`source,target,rating,time` integer lines")
    if not rows:
        raise DataError(path, "no events: expected `source,target,rating,time` integer lines")
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
        raise DataError(
            path,
            f"line {rows[r][0]}: field `rating` (column 3): expected an integer in "
            f"-10..10, got {m[r, 2]}",
        )
    m = m[np.argsort(m[:, 3], kind="stable")]
    ids, inv = np.unique(m[:, :2], return_inverse=True)
    inv = inv.reshape(-1, 2).astype(np.int64)
    rating = m[:, 2]
    return EventStream(
        name=name,
        src=inv[:, 0].copy(),
        dst=inv[:, 1].copy(),
        t=m[:, 3].astype(np.int64),
        num_nodes=len(ids),
        bipartite=False,
        node_type=np.zeros(len(ids), np.int64),
        label=(rating < 0).astype(np.int64),
        msg=(rating / 10.0).astype(np.float32)[:, None] if rating_feature else None,
        source=str(path),
        node_names=[str(int(r)) for r in ids],
    )


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
