"""The generic interaction-stream loader (`src dst time [label] [features...]`) on small files
written by hand, its config, and what the manifest reports for a stream without labels."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fedlightning.data.temporal import EventStream, load_interactions
from fedlightning.data.temporal.manifest import build_manifest, manifest_table
from fedlightning.errors import ConfigError, DataError

# A who-messages-whom stream, out of time order, with ids 7, 3 and 5 on both sides:
# sources {7, 3, 5, 9}, destinations {3, 7, 5, 2}; shared one space: {2, 3, 5, 7, 9}.
MESSAGES = "7 3 30\n3 7 10\n5 2 20\n9 5 20\n7 5 40\n"
# In time order (stable: the two events at 20 keep their file order):
# (3, 7, 10), (5, 2, 20), (9, 5, 20), (7, 3, 30), (7, 5, 40).
SORTED_RAW = [(3, 7, 10), (5, 2, 20), (9, 5, 20), (7, 3, 30), (7, 5, 40)]


def _write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_unipartite_shares_one_id_space(tmp_path):
    s = load_interactions(_write(tmp_path, "msgs.txt", MESSAGES), bipartite=False)
    assert isinstance(s, EventStream)
    assert s.name == "msgs" and not s.bipartite
    assert s.num_nodes == 5  # the distinct ids of both sides
    assert s.node_names == ["2", "3", "5", "7", "9"]
    assert s.node_type.tolist() == [0] * 5
    assert s.t.dtype == np.int64 and s.t.tolist() == [10, 20, 20, 30, 40]
    raw = [(int(s.node_names[a]), int(s.node_names[b])) for a, b in zip(s.src, s.dst, strict=True)]
    assert [(a, b, int(t)) for (a, b), t in zip(raw, s.t, strict=True)] == SORTED_RAW
    assert s.src.tolist() == [1, 2, 4, 3, 3]  # 3 -> 1, 5 -> 2, 9 -> 4, 7 -> 3
    assert s.dst.tolist() == [3, 0, 2, 1, 2]
    assert s.label is None and s.msg is None and not s.has_labels


def test_bipartite_reading_splits_overlapping_ids_and_warns_once(tmp_path, caplog):
    p = _write(tmp_path, "msgs.txt", MESSAGES)
    with caplog.at_level(logging.WARNING, logger="fedlightning.data.temporal.loaders"):
        s = load_interactions(p, bipartite=True)
    # sources 3, 5, 7, 9 -> 0..3; destinations 2, 3, 5, 7 -> 4..7: 8 nodes instead of 5,
    # the 3 ids seen on both sides (3, 5, 7) counted twice (the 3,212-vs-1,899 case).
    assert s.bipartite and s.num_nodes == 8
    assert s.node_names == ["u3", "u5", "u7", "u9", "i2", "i3", "i5", "i7"]
    assert s.node_type.tolist() == [0] * 4 + [1] * 4
    assert s.src.tolist() == [0, 1, 3, 2, 2]
    assert s.dst.tolist() == [7, 4, 6, 5, 6]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "3 ids appear as both source and destination" in msg
    assert "4 sources + 4 destinations = 8 nodes" in msg
    assert "dataset.bipartite=false (5 nodes)" in msg and "msgs.txt" in msg


def test_bipartite_without_overlap_is_silent(tmp_path, caplog):
    p = _write(tmp_path, "clicks.txt", "1 100 0\n2 100 1\n1 101 2\n")
    with caplog.at_level(logging.WARNING):
        s = load_interactions(p, bipartite=True)
    assert not caplog.records
    assert s.num_nodes == 4 and s.node_names == ["u1", "u2", "i100", "i101"]


def test_labels_features_header_and_separators(tmp_path):
    text = "src,dst,time,label,f1,f2\n1,2,0.5,0,0.1,1.0\n2,1,0.25,1,-2,3\n1,3,1.5,1,0,0\n"
    s = load_interactions(_write(tmp_path, "rated.csv", text), bipartite=False)
    assert s.t.dtype == np.float64 and s.t.tolist() == [0.25, 0.5, 1.5]
    assert s.label.dtype == np.int64 and s.label.tolist() == [1, 0, 1] and s.has_labels
    np.testing.assert_array_equal(s.msg, np.array([[-2, 3], [0.1, 1.0], [0, 0]], dtype=np.float32))
    assert s.msg.dtype == np.float32
    # The same events tab-separated, without header: the same stream (but the name).
    tsv = "".join("\t".join(ln.split(",")) + "\n" for ln in text.splitlines()[1:])
    t = load_interactions(_write(tmp_path, "rated.tsv", tsv), bipartite=False, name="rated")
    assert (
        t.fingerprint
        == load_interactions(tmp_path / "rated.csv", bipartite=False, name="rated").fingerprint
    )
    # labels=false: every column after the time is a feature.
    u = load_interactions(tmp_path / "rated.tsv", bipartite=False, labels=False)
    assert u.label is None and u.msg.shape == (3, 3) and u.msg[:, 0].tolist() == [1, 0, 1]


def test_string_ids_comments_and_a_forced_header(tmp_path):
    text = "# exported chat log\nbob\talice\t5\n\nalice\tcarol\t7\n"
    s = load_interactions(_write(tmp_path, "chat.tsv", text), bipartite=False)
    assert s.node_names == ["alice", "bob", "carol"] and s.num_events == 2
    assert s.src.tolist() == [1, 0] and s.dst.tolist() == [0, 2]
    # header=true drops the first line even though it is numeric.
    h = load_interactions(_write(tmp_path, "h.txt", "1 2 3\n4 5 6\n"), False, header=True)
    assert h.num_events == 1 and h.node_names == ["4", "5"]


def test_label_free_stream_manifest_says_no_labels(tmp_path):
    rng = np.random.default_rng(0)
    rows = [f"{rng.integers(1, 30)} {rng.integers(1, 30)} {i}" for i in range(400)]
    plain = load_interactions(_write(tmp_path, "plain.txt", "\n".join(rows)), bipartite=False)
    row = manifest_table(plain, build_manifest(plain))
    assert row["labels"] == "none" and row["classes"] == 0
    assert row["pos_labels"] is None and row["pos_rate"] is None
    # A constant label column is no label either: one class, no positives.
    zeros = [r + " 0" for r in rows]
    const = load_interactions(_write(tmp_path, "zeros.txt", "\n".join(zeros)), bipartite=False)
    assert const.label is not None and not const.has_labels
    row = manifest_table(const, build_manifest(const))
    assert row["labels"] == "none (all 0)" and row["classes"] == 1 and row["pos_labels"] == 0
    mixed = [r + f" {i % 2}" for i, r in enumerate(rows)]
    both = load_interactions(_write(tmp_path, "both.txt", "\n".join(mixed)), bipartite=False)
    row = manifest_table(both, build_manifest(both))
    assert row["labels"] == "0/1" and row["classes"] == 2 and row["pos_labels"] == 200


def test_equals_the_dedicated_loaders_on_the_real_files(tmp_path, shared_data):
    from fedlightning.data.temporal import load_bitcoin_csv, load_wikipedia_txt

    wiki = shared_data / "temporal" / "ml_wikipedia.txt"
    a = load_interactions(wiki, bipartite=True, name="wikipedia")
    assert a.fingerprint == load_wikipedia_txt(wiki).fingerprint
    assert a.node_names == load_wikipedia_txt(wiki).node_names
    # Bitcoin-Alpha as `src,dst,time,label` (label = rating < 0), one id space.
    raw = np.loadtxt(shared_data / "temporal" / "soc-sign-bitcoinalpha.csv", delimiter=",")
    raw = raw.astype(np.int64)
    table = np.c_[raw[:, 0], raw[:, 1], raw[:, 3], (raw[:, 2] < 0).astype(np.int64)]
    np.savetxt(tmp_path / "btc.csv", table, fmt="%d", delimiter=",")
    b = load_interactions(tmp_path / "btc.csv", bipartite=False, name="bitcoin_alpha")
    ref = load_bitcoin_csv(shared_data / "temporal" / "soc-sign-bitcoinalpha.csv")
    assert b.num_nodes == 3_783 and b.fingerprint == ref.fingerprint


def test_config_entry_requires_bipartite(tmp_path, compose):
    from fedlightning.config import build_stream

    p = _write(tmp_path, "msgs.txt", MESSAGES)
    over = ["experiment=temporal_wikipedia", "dataset=interactions", f"dataset.path={p}"]
    assert build_stream(compose([*over, "dataset.bipartite=false"])).num_nodes == 5
    with pytest.raises(ConfigError, match="dataset.bipartite"):  # one line, from the loader
        build_stream(compose(over))


# (file text, keyword arguments, text expected in the message)
BAD = {
    "empty": ("\n# only a comment\n", {}, "no events"),
    "two columns": ("1 2\n3 4\n", {}, "line 1: expected at least 3 whitespace-separated"),
    "ragged": ("1,2,3\n1,2,3,4\n", {}, "line 2: expected 3 comma-separated columns (as line 1)"),
    "time not a number": ("1 2 3\n1 2 x\n", {}, "line 2: field `time` (column 3)"),
    "time not finite": ("1 2 3\n1 2 inf\n", {}, "line 2: field `time` (column 3)"),
    "label not 0/1": ("1 2 3 0\n1 2 4 2\n", {}, "line 2: field `label` (column 4)"),
    "label missing": ("1 2 3\n", {"labels": True}, "field `label`"),
    "feature not a number": (
        "s d t label w\n1 2 3 0 0.5\n1 2 4 1 abc\n",
        {},
        "line 3: field `w` (column 5)",
    ),
    "header only": ("src dst time\n", {}, "no events after the header"),
    "empty id": ("1,2,3\n,2,4\n", {}, "line 2: field `src` (column 1)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_name_file_line_and_field(tmp_path, case):
    text, kw, expected = BAD[case]
    p = _write(tmp_path, "bad.txt", text)
    with pytest.raises(DataError) as e:
        load_interactions(p, bipartite=False, **kw)
    msg = str(e.value)
    assert "bad.txt" in msg and expected in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"bipartite": None}, "dataset.bipartite"),
        ({"bipartite": "yes"}, "dataset.bipartite"),
        ({"bipartite": False, "sep": "|"}, "dataset.sep"),
        ({"bipartite": False, "labels": "auto"}, "dataset.labels"),
        ({"bipartite": False, "header": 1}, "dataset.header"),
    ],
)
def test_bad_keys_name_the_config_key(tmp_path, kw, key):
    p = _write(tmp_path, "ok.txt", MESSAGES)
    with pytest.raises(ConfigError, match=key):
        load_interactions(p, **kw)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="absent.txt"):
        load_interactions(tmp_path / "absent.txt", bipartite=False)


# --- which task families a stream runs -----------------------------------------------------
def _tiny(label):
    """Four events of a who-messages-whom stream, with the state labels ``label``."""
    return EventStream("tiny", np.array([0, 1, 2, 0]), np.array([1, 2, 0, 2]), np.arange(4),
                       3, False, np.zeros(3, dtype=np.int64), label=label)  # fmt: skip


def test_families_auto_is_every_family_the_stream_supports(caplog):
    from fedlightning.programs.temporal_program import check_families

    labelled = _tiny(np.array([0, 1, 0, 0]))
    with caplog.at_level(logging.INFO, logger="fedlightning.programs.temporal_program"):
        assert check_families("auto", labelled) == ["nc", "lp"]
        assert check_families("auto", _tiny(None)) == ["lp"]
        assert check_families("auto", _tiny(np.zeros(4, dtype=np.int64))) == ["lp"]  # all 0
    said = [r.getMessage() for r in caplog.records]
    assert "families=auto: nc,lp on tiny (state labels 0/1)" in said
    assert "families=auto: lp on tiny (no usable state labels)" in said
    assert check_families("auto", None) == ["nc", "lp"]  # before the stream is read
    assert check_families(["lp", "nc"], labelled) == ["lp", "nc"]  # a list is kept as given
    # node classification by name on a stream without usable labels: one line
    for label, has in ((None, "has none"), (np.ones(4, dtype=np.int64), "has one value only")):
        with pytest.raises(ConfigError, match="families") as err:
            check_families(["nc"], _tiny(label))
        assert has in str(err.value) and "families=auto" in str(err.value)
        assert "\n" not in str(err.value)
    for bad in ("all", [], ["nc", "xx"]):
        with pytest.raises(ConfigError, match="`auto` or a non-empty list"):
            check_families(bad, labelled)
