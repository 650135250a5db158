"""The temporal loaders on fixture files, on the real Wikipedia and Bitcoin files, and the
synthetic stream."""

from __future__ import annotations

import csv
from contextlib import contextmanager

import numpy as np
import pytest

from fedlightning.data.temporal import (
    EventStream,
    load_bitcoin_csv,
    load_interactions,
    load_jodie_csv,
    load_wikipedia_txt,
    make_synthetic_stream,
)
from fedlightning.errors import DataError

HEADER = "user_id,item_id,timestamp,state_label,f1,f2,f3\n"
# Users 7, 3, 5 and items 10, 2 in order of appearance; sorted: users 3,5,7 -> 0,1,2 and
# items 2,10 -> 3,4.
JODIE_ROWS = [
    "7,10,0.0,0,0.1,0.2,0.3\n",
    "3,2,1.5,0,1.0,-1.0,0.5\n",
    "5,10,1.5,1,0.0,0.0,0.0\n",
    "7,2,4.25,1,2.5,3.5,-4.5\n",
]


def _write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text)
    return p


@contextmanager
def _raises(path, *parts: str):
    """A DataError whose message names ``path``'s file and every one of ``parts``."""
    with pytest.raises(DataError) as info:
        yield info
    msg = str(info.value)
    assert path.name in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


# ------------------------------------------------------------------------------------------
# JODIE CSV


def test_jodie_mapping_labels_features(tmp_path):
    p = _write(tmp_path, "wiki.csv", HEADER + "".join(JODIE_ROWS))
    s = load_jodie_csv(p)
    assert isinstance(s, EventStream)
    assert s.name == "wiki" and s.source == str(p)
    assert s.bipartite and s.num_nodes == 5
    assert s.node_names == ["u3", "u5", "u7", "i2", "i10"]
    assert s.node_type.tolist() == [0, 0, 0, 1, 1]
    assert s.src.tolist() == [2, 0, 1, 2]
    assert s.dst.tolist() == [4, 3, 4, 3]
    assert [s.node_names[i] for i in s.src] == ["u7", "u3", "u5", "u7"]
    assert [s.node_names[i] for i in s.dst] == ["i10", "i2", "i10", "i2"]
    assert s.t.dtype == np.float64 and s.t.tolist() == [0.0, 1.5, 1.5, 4.25]
    assert s.label.dtype == np.int64 and s.label.tolist() == [0, 0, 1, 1]
    assert s.msg.dtype == np.float32 and s.msg.shape == (4, 3)
    expected = np.array([[float(v) for v in r.strip().split(",")[4:]] for r in JODIE_ROWS])
    np.testing.assert_array_equal(s.msg, expected.astype(np.float32))
    assert load_jodie_csv(p, name="wikipedia").name == "wikipedia"


def test_jodie_integral_times_are_int_and_no_features(tmp_path):
    p = _write(
        tmp_path, "mooc.csv", "user_id,item_id,timestamp,state_label\n0,0,0.0,0\n1,0,36.0,1\n"
    )
    s = load_jodie_csv(p)
    assert s.t.dtype == np.int64 and s.t.tolist() == [0, 36]
    assert s.msg is None
    assert s.label.tolist() == [0, 1]
    assert s.node_names == ["u0", "u1", "i0"]


def test_jodie_published_header_with_one_feature_name(tmp_path):
    # The published files name all d features with one header column.
    head = "user_id,item_id,timestamp,state_label,comma_separated_list_of_features\n"
    p = _write(tmp_path, "reddit.csv", head + "".join(JODIE_ROWS))
    s = load_jodie_csv(p)
    assert s.msg.shape == (4, 3)
    bad = _write(tmp_path, "reddit_bad.csv", head + JODIE_ROWS[0] + "1,2,5.0,0,1.0,2.0\n")
    with _raises(bad, "line 3", "7 columns"):
        load_jodie_csv(bad)


@pytest.mark.parametrize(
    ("rows", "parts"),
    [
        ("", ("empty file",)),
        ("\n\n", ("empty file",)),
        (None, ("no events after the header",)),
        ([JODIE_ROWS[0], "3,2,1.5,0,1.0\n"], ("line 3", "7 columns", "got 5")),
        ([JODIE_ROWS[0], JODIE_ROWS[1], "5,10,x,1,0,0,0\n"], ("line 4", "`timestamp`")),
        ([JODIE_ROWS[0], "3,2,1.5,0,1.0,abc,0.5\n"], ("line 3", "`f2`", "'abc'")),
        ([JODIE_ROWS[0], "3,2,1.5,2,1.0,1.0,0.5\n"], ("line 3", "`state_label`", "0 or 1")),
        ([JODIE_ROWS[0], "3.5,2,1.5,0,1.0,1.0,0.5\n"], ("line 3", "`user_id`", "integer")),
        ([JODIE_ROWS[0], "3,2,nan,0,1.0,1.0,0.5\n"], ("line 3", "`timestamp`", "finite")),
        (
            [JODIE_ROWS[0], JODIE_ROWS[1], "5,10,1.0,1,0,0,0\n"],
            ("line 4", "`timestamp`", "non-decreasing", "line 3"),
        ),
    ],
)
def test_jodie_errors_name_file_line_field(tmp_path, rows, parts):
    if rows == "" or rows == "\n\n":
        text = rows
    else:
        text = HEADER + ("" if rows is None else "".join(rows))
    p = _write(tmp_path, "bad.csv", text)
    with _raises(p, *parts):
        load_jodie_csv(p)


def test_jodie_short_header_and_missing_file(tmp_path):
    p = _write(tmp_path, "short.csv", "user_id,item_id,timestamp\n1,2,3\n")
    with _raises(p, "line 1", "at least 4 columns"):
        load_jodie_csv(p)
    with _raises(tmp_path / "nope.csv", "missing"):
        load_jodie_csv(tmp_path / "nope.csv")


# ------------------------------------------------------------------------------------------
# Wikipedia txt


def test_wikipedia_fixture_mapping(tmp_path):
    p = _write(tmp_path, "w.txt", "4 20 0\n2 21 0\n4 21 5\n\n9 20 7\n")
    s = load_wikipedia_txt(p)
    assert s.name == "wikipedia" and s.bipartite and s.label is None and s.msg is None
    assert s.node_names == ["u2", "u4", "u9", "i20", "i21"]
    assert s.src.tolist() == [1, 0, 1, 2] and s.dst.tolist() == [3, 4, 4, 3]
    assert s.t.dtype == np.int64 and s.t.tolist() == [0, 0, 5, 7]


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("1 2 0\n1 2 5\n1 2 3\n", ("line 3", "non-decreasing", "line 2")),
        ("1 2 0\n1 2\n", ("line 2", "3 columns", "got 2")),
        ("1 2 0\n1 2 5\n\n1 x 6\n", ("line 4", "`item`", "integer")),
        ("1 2 0\n1 2 5.5\n", ("line 2", "`timestamp`", "integer")),
        ("", ("no events",)),
    ],
)
def test_wikipedia_errors_name_the_line(tmp_path, text, parts):
    p = _write(tmp_path, "w.txt", text)
    with _raises(p, *parts):
        load_wikipedia_txt(p)


@pytest.mark.realdata
def test_wikipedia_real_file(shared_data):
    path = shared_data / "temporal" / "ml_wikipedia.txt"
    s = load_wikipedia_txt(path)
    assert s.num_events == 157_474
    assert np.bincount(s.node_type).tolist() == [8_227, 1_000]
    assert s.num_nodes == 9_227
    assert s.node_names[s.src[0]] == "u1" and s.node_names[s.dst[0]] == "i8228"
    assert s.src[0] == 0 and s.dst[0] == 8_227
    assert s.t[0] == 0 and s.t[-1] == 2_678_373
    assert np.all(np.diff(s.t) >= 0)
    assert s.node_type[s.src].max() == 0 and s.node_type[s.dst].min() == 1
    # Independently: the last line of the file maps back to its raw ids.
    user, item, t = path.read_text().split("\n")[-2].split()
    assert (s.node_names[s.src[-1]], s.node_names[s.dst[-1]]) == (f"u{user}", f"i{item}")
    assert s.t[-1] == int(t)


# ------------------------------------------------------------------------------------------
# Bitcoin CSV

# Raw ids 30, 7, 12, 99 -> sorted 7, 12, 30, 99 -> 0, 1, 2, 3.
BITCOIN = "30,7,10,200\n7,12,-3,100\n12,30,5,200\n99,7,-10,100\n7,30,1,150\n"


def test_bitcoin_stable_sort_ids_labels(tmp_path):
    p = _write(tmp_path, "b.csv", BITCOIN)
    s = load_bitcoin_csv(p)
    assert s.name == "bitcoin_alpha" and not s.bipartite and s.msg is None
    assert s.node_names == ["7", "12", "30", "99"]
    assert s.node_type.tolist() == [0, 0, 0, 0]
    # Time order 100 (file lines 2, 4), 150 (line 5), 200 (lines 1, 3): ties in file order.
    assert s.t.tolist() == [100, 100, 150, 200, 200]
    raw = [(7, 12), (99, 7), (7, 30), (30, 7), (12, 30)]
    assert [
        (int(s.node_names[a]), int(s.node_names[b])) for a, b in zip(s.src, s.dst, strict=True)
    ] == raw
    assert s.label.dtype == np.int64 and s.label.tolist() == [1, 1, 0, 0, 0]
    f = load_bitcoin_csv(p, name="otc", rating_feature=True)
    assert f.name == "otc" and f.msg.dtype == np.float32 and f.msg.shape == (5, 1)
    np.testing.assert_allclose(f.msg[:, 0], np.array([-3, -10, 1, 10, 5]) / 10, rtol=1e-6)
    np.testing.assert_array_equal(f.label, s.label)


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("1,2,3,4\n1,2,3\n", ("line 2", "4 columns", "got 3")),
        ("1,2,3,4\n\n1,2,x,5\n", ("line 3", "`rating`", "integer")),
        ("1,2,3,4\n1,2,11,5\n", ("line 2", "`rating`", "-10..10")),
        ("source,target,rating,time\n1,2,3,4\n", ("line 1", "`source`", "integer")),
        ("\n", ("no events",)),
    ],
)
def test_bitcoin_errors_name_the_line(tmp_path, text, parts):
    p = _write(tmp_path, "b.csv", text)
    with _raises(p, *parts):
        load_bitcoin_csv(p)


@pytest.mark.realdata
def test_bitcoin_real_file(shared_data):
    path = shared_data / "temporal" / "soc-sign-bitcoinalpha.csv"
    with path.open(newline="") as fh:
        raw = np.array([[int(v) for v in row] for row in csv.reader(fh)], dtype=np.int64)
    assert np.any(np.diff(raw[:, 3]) < 0)  # the file is not in time order: sorting matters
    s = load_bitcoin_csv(path)
    assert s.num_events == 24_186 and s.num_nodes == 3_783
    assert int(s.label.sum()) == 1_536 and s.msg is None
    assert np.all(np.diff(s.t) >= 0)
    order = np.argsort(raw[:, 3], kind="stable")
    np.testing.assert_array_equal(s.t, raw[order, 3])
    names = np.array(s.node_names, dtype=np.int64)
    np.testing.assert_array_equal(names[s.src], raw[order, 0])
    np.testing.assert_array_equal(names[s.dst], raw[order, 1])
    np.testing.assert_array_equal(s.label, (raw[order, 2] < 0).astype(np.int64))


# ------------------------------------------------------------------------------------------
# every array of the real files, against a reading of the formats' definitions in plain Python


def _expected(events: list[tuple], bipartite: bool) -> tuple[list[int], dict]:
    """``(order, fields)`` of events ``(src, dst, time, ...)`` as the formats define them:
    a stable sort by time; ids sorted as numbers, all sources before all destinations when
    ``bipartite``, else one shared id space."""
    order = sorted(range(len(events)), key=lambda e: events[e][2])  # sorted() is stable
    srcs, dsts = {ev[0] for ev in events}, {ev[1] for ev in events}
    if bipartite:
        users, items = sorted(srcs), sorted(dsts)
        src_of = {u: k for k, u in enumerate(users)}
        dst_of = {i: len(users) + k for k, i in enumerate(items)}
        names = [f"u{u}" for u in users] + [f"i{i}" for i in items]
        types = [0] * len(users) + [1] * len(items)
    else:
        ids = sorted(srcs | dsts)
        src_of = dst_of = {r: k for k, r in enumerate(ids)}
        names, types = [str(r) for r in ids], [0] * len(ids)
    fields = {
        "src": np.array([src_of[events[e][0]] for e in order], dtype=np.int64),
        "dst": np.array([dst_of[events[e][1]] for e in order], dtype=np.int64),
        "t": np.array([events[e][2] for e in order]),  # int64 for ints, float64 for floats
        "node_type": np.array(types, dtype=np.int64),
        "node_names": names,
        "num_nodes": len(names),
        "bipartite": bipartite,
    }
    return order, fields


def _assert_stream(s: EventStream, fields: dict, label, msg) -> None:
    """Every array of ``s`` bitwise equal to the expected one (dtype, shape and bytes)."""
    for key, want in [*fields.items(), ("label", label), ("msg", msg)]:
        got = getattr(s, key)
        if isinstance(want, np.ndarray):
            assert (got.dtype, got.shape) == (want.dtype, want.shape), key
            assert np.ascontiguousarray(got).tobytes() == want.tobytes(), key
        else:
            assert got == want, key


@pytest.fixture(scope="module")
def real_events(shared_data):
    """The events of both real files, read with str.split and the csv module: Wikipedia
    ``(user, page, time)``, Bitcoin ``(source, target, time, rating)``."""
    wiki = shared_data / "temporal" / "ml_wikipedia.txt"
    btc = shared_data / "temporal" / "soc-sign-bitcoinalpha.csv"
    w = [tuple(int(v) for v in ln.split()) for ln in wiki.read_text().splitlines()]
    with btc.open(newline="") as fh:
        b = [(int(s), int(d), int(t), int(r)) for s, d, r, t in csv.reader(fh)]
    return {"wiki": (wiki, w), "btc": (btc, b)}


@pytest.mark.realdata
@pytest.mark.parametrize(
    ("file", "call", "bipartite"),
    [
        ("wiki", lambda p: load_wikipedia_txt(p), True),
        ("wiki", lambda p: load_interactions(p, bipartite=True), True),
        ("wiki", lambda p: load_interactions(p, bipartite=False), False),
        ("btc", lambda p: load_bitcoin_csv(p), False),
        ("btc", lambda p: load_bitcoin_csv(p, rating_feature=True), False),
    ],
    ids=[
        "wikipedia_txt",
        "wiki_interactions_bip",
        "wiki_interactions_one",
        "bitcoin",
        "btc_rating",
    ],
)
def test_real_files_every_array(real_events, file, call, bipartite):
    path, events = real_events[file]
    s = call(path)
    order, fields = _expected(events, bipartite)
    label = msg = None
    if file == "btc":
        label = np.array([int(events[e][3] < 0) for e in order], dtype=np.int64)
        if s.msg is not None:  # rating_feature=True: rating / 10 as one float32 feature
            msg = np.array([[events[e][3] / 10] for e in order], dtype=np.float32)
    _assert_stream(s, fields, label, msg)
    assert s.num_events == len(events) and s.source == str(path)


@pytest.mark.realdata
@pytest.mark.parametrize("file", ["wiki", "btc"])
def test_real_events_in_jodie_csv_every_array(real_events, tmp_path, file):
    # No labelled JODIE file is on these machines: the real events, in time order, written
    # in its layout with a label and two features, float times for Bitcoin (time / 1000).
    _, events = real_events[file]
    events = sorted(events, key=lambda ev: ev[2])
    rows = []
    for k, ev in enumerate(events):
        t = f"{ev[2]}.0" if file == "wiki" else repr(ev[2] / 1000)
        label = int(ev[3] < 0) if file == "btc" else int((ev[0] * 31 + k) % 11 == 0)
        rows.append((ev[0], ev[1], t, label, repr(ev[2] / 7), repr(-ev[1] / 3)))
    p = tmp_path / f"{file}.csv"
    p.write_text(
        "user_id,item_id,timestamp,state_label,f1,f2\n"
        + "".join(",".join(map(str, r)) + "\n" for r in rows)
    )
    parsed = [(r[0], r[1], int(float(r[2])) if file == "wiki" else float(r[2])) for r in rows]
    order, fields = _expected(parsed, bipartite=True)
    label = np.array([rows[e][3] for e in order], dtype=np.int64)
    msg = np.array([[float(rows[e][4]), float(rows[e][5])] for e in order], dtype=np.float32)
    _assert_stream(load_jodie_csv(p), fields, label, msg)
    _assert_stream(load_interactions(p, bipartite=True), fields, label, msg)


# ------------------------------------------------------------------------------------------
# synthetic stream


def _arrays(s: EventStream):
    return (s.src, s.dst, s.t, s.label, s.msg)


def test_synthetic_deterministic_per_seed():
    a, b, c = (
        make_synthetic_stream(seed=1),
        make_synthetic_stream(seed=1),
        make_synthetic_stream(seed=2),
    )
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != c.fingerprint
    assert not np.array_equal(a.dst, c.dst)


@pytest.mark.parametrize("rate", [0.05, 0.1])
def test_synthetic_shape_labels_times(rate):
    s = make_synthetic_stream(num_users=200, num_items=50, num_events=5000, positive_rate=rate)
    assert s.num_events == 5000 and s.num_nodes == 250 and s.bipartite
    assert np.bincount(s.node_type).tolist() == [200, 50]
    assert s.src.max() < 200 and s.dst.min() >= 200 and s.dst.max() < 250
    assert abs(s.label.mean() - rate) < 0.01
    assert s.t.dtype == np.int64 and np.all(np.diff(s.t) >= 0) and np.any(np.diff(s.t) == 0)
    assert s.msg.dtype == np.float32 and s.msg.shape == (5000, 8)
    # Labels are planted on a subset of users; features carry a weak signal of the label.
    assert 0 < len(np.unique(s.src[s.label == 1])) < 200
    assert s.msg[s.label == 1].mean(0) @ s.msg[s.label == 1].mean(0) > 0.2
    # Links are learnable: a user's most frequent item takes far more than 1/50 of its events.
    top = [np.bincount(s.dst[s.src == u]).max() / (s.src == u).sum() for u in np.unique(s.src)]
    assert np.mean(top) > 0.2


@pytest.mark.parametrize("shift", [0.0, 0.75, 2.0])
def test_synthetic_label_shift_moves_only_the_features(shift):
    """``label_shift`` is the distance between the two classes' feature means (the shift
    along one random unit direction); the events, times, labels and noise stay the same,
    and the default 0.75 is the stream without the argument, bitwise."""
    base = make_synthetic_stream(num_events=8000, positive_rate=0.25, seed=4)
    s = make_synthetic_stream(num_events=8000, positive_rate=0.25, seed=4, label_shift=shift)
    for x, y in zip(_arrays(base)[:4], _arrays(s)[:4], strict=True):
        np.testing.assert_array_equal(x, y)
    gap = s.msg[s.label == 1].mean(0) - s.msg[s.label == 0].mean(0)
    assert abs(np.linalg.norm(gap) - shift) < 0.15  # 8 dims of noise, ~2000 vs ~6000 events
    noise = s.msg - base.msg  # the noise cancels: what is left is the label's shift
    np.testing.assert_allclose(noise[s.label == 0], 0, atol=1e-6)
    np.testing.assert_allclose(
        np.linalg.norm(noise[s.label == 1], axis=1), abs(shift - 0.75), atol=1e-5
    )
    if shift == 0.75:
        np.testing.assert_array_equal(s.msg, base.msg)
    with pytest.raises(ValueError, match="label_shift"):
        make_synthetic_stream(num_events=100, label_shift=float("nan"))


def test_synthetic_to_temporal_data():
    s = make_synthetic_stream(num_events=300, feature_dim=4, seed=3)
    d = s.to_temporal_data()
    assert d.src.shape == d.dst.shape == d.t.shape == d.y.shape == (300,)
    assert tuple(d.msg.shape) == (300, 4)
    assert d.src.tolist() == s.src.tolist() and d.y.tolist() == s.label.tolist()
    assert make_synthetic_stream(num_events=50, feature_dim=0).msg is None
