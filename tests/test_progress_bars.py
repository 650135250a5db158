"""Every long piece of work shows progress: a tqdm bar on an interactive terminal (forced
here by a stderr that says it is one) and a summary line in the log when it ends: bank
pre-training (events per epoch, with the rate), FedTIP's tasks (also when the per-round
client bars are off), the stage-end exchange, feature extraction. Off a terminal, no bar."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from fedlightning.train import train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@contextmanager
def terminal(stream: io.StringIO | None = None) -> Iterator[io.StringIO]:
    """What the bars write, as if stderr were an interactive terminal (set inside the test:
    pytest puts its own capture back on sys.stderr between a fixture and the test)."""
    out = Terminal() if stream is None else stream
    before, sys.stderr = sys.stderr, out
    try:
        yield out
    finally:
        sys.stderr = before


def test_bank_pretraining_shows_events_per_epoch_with_the_rate(caplog):
    from fedlightning.data.temporal import make_synthetic_stream
    from fedlightning.temporal.bank import BankConfig, pretrain

    s = make_synthetic_stream(num_users=30, num_items=8, num_events=1200, seed=1)
    cfg = BankConfig(epochs=2, patience=2, memory_dim=8, time_dim=4, embedding_dim=8)
    with caplog.at_level(logging.DEBUG, logger="fedlightning.temporal"), terminal() as out:
        pretrain(s, np.arange(800), np.arange(800, 1000), cfg, seed=0)
    bars = out.getvalue()
    for epoch in ("bank epoch 1/2", "bank epoch 2/2"):
        assert f"{epoch}:" in bars
    assert "/1000 [" in bars  # events: pre-training and validation
    assert "event/s" in bars  # tqdm's rate
    lines = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("bank epoch 2/2 done: 1000 events in ") for m in lines) == 1  # DEBUG
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    for epoch in ("bank epoch 1/2  loss ", "bank epoch 2/2  loss "):  # one line an epoch
        assert sum(m.startswith(epoch) and "events/s" in m for m in info) == 1
    assert not any(m.startswith("bank epoch") and " done: " in m for m in info)


def test_fedtip_tasks_show_their_bar_when_the_client_bars_are_off(tmp_env, compose):
    cfg = compose(
        [
            "experiment=temporal_synthetic",
            "algorithm=fedtip",  # sets runner.progress=false (no per-round bars)
            "protocol.tasks.num_tasks=2",
            "federation.rounds=1",
            "federation.local_epochs=1",
            "bank.epochs=1",
            "bank.max_events=500",
            "logger=none",
        ]
    )
    assert cfg.runner.progress is False
    with terminal() as out:
        train(cfg, tmp_env / "run", verbose=False)
    bars = out.getvalue()
    assert "tasks:" in bars and "2/2" in bars
    assert "round 1:" not in bars  # the client bars stay off


def test_the_stage_end_exchange_shows_its_bar_and_a_summary_line(tmp_env, compose, caplog):
    cfg = compose(
        [
            "experiment=demo",  # FedOGL: a stage-end exchange of residual bases
            "dataset.num_nodes=200",
            "federation.clients=2",
            "federation.rounds=1",
            "federation.local_epochs=1",
            "runner.progress=true",
            "logger=none",
        ]
    )
    with caplog.at_level(logging.INFO, logger="fedlightning.federation"), terminal() as out:
        train(cfg, tmp_env / "run", verbose=False)
    bars = out.getvalue()
    assert "stage 1 end:" in bars and "/2 [" in bars  # over the 2 clients
    lines = [r.getMessage() for r in caplog.records]
    for t in (1, 2, 3):
        assert any(m.startswith(f"stage {t} end exchange: 2 clients, 2 answers, ") for m in lines)


def raw_images(root, n=3):
    from PIL import Image

    (root / "images").mkdir(parents=True)
    (root / "nodes.csv").write_text("id,label\n" + "".join(f"n{i},{i % 2}\n" for i in range(n)))
    (root / "edges.csv").write_text(
        "src,dst\n" + "".join(f"n{i},n{(i + 1) % n}\n" for i in range(n))
    )
    rng = np.random.default_rng(0)
    for i in range(n):
        pixels = rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "images" / f"n{i}.png")
    return root


def test_feature_extraction_shows_a_bar_and_a_summary_line(tmp_path, caplog):
    pytest.importorskip("PIL")
    from fedlightning.data.features import extract

    raw = raw_images(tmp_path / "raw")
    with caplog.at_level(logging.INFO, logger="fedlightning.data"), terminal() as out:
        extract(raw, tmp_path / "out", image_model="torch.nn:Identity")
    assert "images:" in out.getvalue()
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("images: 3 nodes encoded in ") and "3-d" in m for m in lines)


def test_no_bar_off_a_terminal(tmp_path):
    pytest.importorskip("PIL")
    from fedlightning.data.features import extract

    with terminal(io.StringIO()) as piped:  # isatty() is False
        extract(raw_images(tmp_path / "raw"), tmp_path / "out", image_model="torch.nn:Identity")
    assert piped.getvalue() == ""
