"""The README is a front door: short, no history, and every command in it composes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_short_and_without_history():
    assert len(README.splitlines()) <= 120
    words = re.findall(r"\b[0-9a-f]{7,40}\b", README)
    assert [w for w in words if re.search(r"[a-f]", w) and re.search(r"\d", w)] == []
    assert "CI time" not in README and "| commit |" not in README


def test_the_two_commands_are_the_ones_ci_runs():
    assert "bash tools/setup.sh && .venv/bin/fedlightning train" in README
    assert "bash tools/test.sh" in README
    assert "tools/test.sh" in (REPO / ".ci" / "run").read_text()
    assert "tools/setup.sh" in (REPO / "tools" / "test.sh").read_text()


def test_every_linked_doc_exists():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links and [p for p in links if not (REPO / p).is_file()] == []


def train_lines() -> list[list[str]]:
    """The overrides of every ``fedlightning train`` line of the README's code blocks."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            if not line.startswith("fedlightning train"):
                continue
            words = shlex.split(line.split("#")[0])
            if "--cfg" not in words:
                lines.append([w for w in words[2:] if w != "-m"])
    return lines


@pytest.mark.parametrize("overrides", train_lines(), ids=" ".join)
def test_every_train_command_composes(compose, overrides):
    first = [o if "[" in o else o.split(",")[0] for o in overrides]  # a multirun's first job
    cfg = compose(first)
    assert cfg.name
