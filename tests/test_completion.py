"""Shell completion: the bash script of ``fedlightning completion bash`` sourced in a real
bash, its function called the way bash's programmable completion calls it (``COMP_WORDS``,
``COMP_CWORD``, ``COMP_LINE``, ``COMP_POINT``), ``COMPREPLY`` read back; ``fedlightning``
there is this checkout's, with a ``torch`` that fails to import (completion must not load it)."""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlightning.completion import candidates
from fedlightning.resources import conf_dir

REPO = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 120  # far above the normal time (seconds)
CALL = """eval "$(fedlightning completion bash)" || exit 3
COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMP_POINT=${#COMP_LINE}
_fedlightning_complete || exit 4
printf '%s\\n' "${COMPREPLY[@]}"
"""


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory) -> dict[str, str]:
    """PATH with a ``fedlightning`` that runs this checkout's package; ``import torch`` fails."""
    root = tmp_path_factory.mktemp("completion")
    (root / "bin").mkdir()
    program = root / "bin" / "fedlightning"
    program.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fedlightning "$@"\n')
    program.chmod(0o755)
    (root / "no_torch" / "torch").mkdir(parents=True)
    (root / "no_torch" / "torch" / "__init__.py").write_text(
        "raise ImportError('shell completion imported torch')\n"
    )
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(root / "bin"), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(root / "no_torch")])
    return env


def complete(env: dict[str, str], line: str, words: list[str]) -> list[str]:
    """COMPREPLY for the command line ``line`` (the cursor at its end) split by bash into
    ``words`` (the last one: the word under completion)."""
    r = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", CALL, "bash", *words],
        env={**env, "COMP_LINE": line},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def options(group: str, prefix: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob(f"{prefix}*.yaml"))


def test_experiment_names_whole_word(shell_env):
    """A shell that keeps ``key=value`` one word (bash without '=' in COMP_WORDBREAKS, zsh's
    bashcompinit): the replies are whole overrides."""
    line = "fedlightning train experiment=cil_c"
    reply = complete(shell_env, line, line.split())
    expected = [f"experiment={name}" for name in options("experiment", "cil_c")]
    assert expected == ["experiment=cil_citeseer_mm", "experiment=cil_cora"]
    assert sorted(reply) == expected


def test_experiment_names_split_at_equals(shell_env):
    """Bash's default COMP_WORDBREAKS splits ``experiment=cil_c`` into three words:
    the replies replace the last one and complete the line to the whole override."""
    line = "fedlightning train experiment=cil_c"
    words = ["fedlightning", "train", "experiment", "=", "cil_c"]
    reply = complete(shell_env, line, words)
    assert sorted(reply) == ["cil_citeseer_mm", "cil_cora"]
    assert line[: -len(words[-1])] + reply[-1] == "fedlightning train experiment=cil_cora"

    # right after '=', bash's current word is "=" itself, but readline inserts after it
    line = "fedlightning train -m seed=0,1 experiment="
    words = ["fedlightning", "train", "-m", "seed", "=", "0,1", "experiment", "="]
    reply = complete(shell_env, line, words)
    assert sorted(reply) == options("experiment", "")


def bash_words(line: str) -> list[str]:
    """``line`` split as bash splits it for ``COMP_WORDS`` with its default
    ``COMP_WORDBREAKS``: spaces separate, and each '=' or ':' is a word of its own."""
    words = re.findall(r"[=:]|[^\s=:]+", line)
    return [*words, ""] if line.endswith(" ") else words


def readline_lines(env: dict[str, str], line: str) -> list[str]:
    """The command lines readline makes of ``line`` with each reply: it replaces the text
    after the last space, '=' or ':' (its word-break characters) by the reply."""
    start = max(line.rfind(c) for c in " =:") + 1
    replies = [r for r in complete(env, line, bash_words(line)) if r]  # none: one empty line
    return sorted(line[:start] + reply for reply in replies)


@pytest.mark.parametrize(
    ("typed", "group"),
    [("experiment=", "experiment"), ("algorithm=", "algorithm"), ("dataset=", "dataset")],
)
@pytest.mark.parametrize("partial", ["", "c", "fedp"])
def test_group_values_empty_and_partial(shell_env, typed, group, partial):
    """``fedlightning train experiment=<TAB>`` (and ``algorithm=``, ``dataset=``), with
    nothing or the start of a name typed: every option of the group that starts with it,
    as whole overrides on the line (``experiment==`` before)."""
    line = f"fedlightning train {typed}{partial}"
    expected = [f"fedlightning train {group}={name}" for name in options(group, partial)]
    assert readline_lines(shell_env, line) == expected


def test_nested_keys_empty_and_partial(shell_env):
    """Keys of a nested config, after the dot or part of a name, and a key's value (its
    current one is offered)."""
    keys = readline_lines(shell_env, "fedlightning train federation.")
    assert "fedlightning train federation.rounds=" in keys and len(keys) > 3
    assert readline_lines(shell_env, "fedlightning train federation.rou") == [
        "fedlightning train federation.rounds="
    ]
    assert readline_lines(shell_env, "fedlightning train model.net.hidden=") == [
        "fedlightning train model.net.hidden=64"
    ]


def test_groups_and_keys(shell_env):
    line = "fedlightning train algo"
    assert "algorithm=" in complete(shell_env, line, line.split())
    line = "fedlightning train federation.rou"
    assert complete(shell_env, line, line.split()) == ["federation.rounds="]
    line = "fedlightning train experiment=demo model.net.hid"
    assert complete(shell_env, line, line.split()) == ["model.net.hidden="]


def test_keys_follow_the_overrides_before(shell_env):
    """Keys come from the config composed with the overrides already typed: FedProx has
    ``algorithm.mu``, FedAvg has not."""
    line = "fedlightning train algorithm=fedprox algorithm.m"
    assert "algorithm.mu=" in complete(shell_env, line, line.split())
    line = "fedlightning train algorithm=fedavg algorithm.m"
    assert "algorithm.mu=" not in complete(shell_env, line, line.split())


def test_commands(shell_env):
    assert complete(shell_env, "fedlightning tr", ["fedlightning", "tr"]) == ["train"]
    reply = complete(shell_env, "fedlightning ", ["fedlightning", ""])
    assert {"train", "sweep", "report", "flower-sim", "data", "completion"} <= set(reply)
    line = "fedlightning data manifest experiment=temporal_wi"
    assert complete(shell_env, line, line.split()) == ["experiment=temporal_wikipedia"]


def test_hydra_shell_completion_flag(shell_env):
    """The commands of the issue: Hydra's ``-sc`` given to ``fedlightning train`` or to
    ``fedlightning`` no longer fails, and the installed script completes ``fedlightning``."""
    run = {"env": shell_env, "capture_output": True, "text": True, "timeout": HANG_GUARD_S}
    r = subprocess.run(["fedlightning", "train", "-sc", "install=bash"], **run)
    assert r.returncode == 0, r.stderr
    registered = [ln for ln in r.stdout.splitlines() if ln.startswith("complete ")]
    assert registered == ["complete -o default -F _fedlightning_complete fedlightning"]
    env = {**shell_env, "COMP_LINE": "fedlightning train federation.rou", "COMP_POINT": "33"}
    r = subprocess.run(["fedlightning", "-sc", "query=bash"], **{**run, "env": env})
    assert (r.returncode, r.stdout.split()) == (0, ["federation.rounds="]), r.stderr


def test_candidates_in_process():
    """Options, option values (left to the shell's file names) and lines that do not parse."""
    assert candidates("fedlightning flower-sim --r") == ["--run-dir"]
    assert candidates("fedlightning flower-sim --run-dir ") == []
    assert candidates("fedlightning data manifest --out x federation.rou") == ["federation.rounds="]
    assert candidates("fedlightning sweep sw") == []  # a file: the shell's completion
    assert candidates("fedlightning train dataset=no_such_dataset federation.rou") == []


class Terminal:
    """An interactive bash on a pseudo-terminal: what readline makes of typed keys."""

    def __init__(self, env: dict[str, str]):
        import pty

        self.master, slave = pty.openpty()
        self.bash = subprocess.Popen(
            ["bash", "--norc", "--noprofile", "-i"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**env, "HISTFILE": os.devnull, "PS1": "$ "},
            start_new_session=True,
        )
        os.close(slave)
        self.seen = b""

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def read_until(self, pattern: bytes) -> re.Match:
        deadline = time.monotonic() + HANG_GUARD_S
        while (m := re.search(pattern, self.seen)) is None:
            assert time.monotonic() < deadline, self.seen[-2000:]
            if select.select([self.master], [], [], 1)[0]:
                self.seen += os.read(self.master, 4096)
        self.seen = self.seen[m.end() :]
        return m

    def close(self) -> None:
        self.bash.kill()
        self.bash.wait(timeout=HANG_GUARD_S)
        os.close(self.master)


@pytest.mark.skipif(os.name != "posix", reason="a pseudo-terminal")
def test_real_bash_readline(shell_env):
    """TAB in an interactive bash, its default COMP_WORDBREAKS ('=' included): the line
    after completion (a space after a finished override, none after a key awaiting its
    value; ``algo`` stops at the common prefix of ``algorithm.`` and ``algorithm=``)."""
    term = Terminal(shell_env)
    try:
        term.type('bind "set bell-style none"; eval "$(fedlightning completion bash)"\n')
        term.type("echo READY\n")
        term.read_until(rb"[\r\n]READY\r?\n")
        completed = {}
        for line in (
            "fedlightning train federation.rou",
            "fedlightning train experiment=cil_co",
            "fedlightning tr",
            "fedlightning train algo",
            "fedlightning train bank=",
        ):
            term.read_until(rb"\$ ")
            term.type(f'{line}\t\x01echo "LINE:\x05|"\n')  # TAB, then echo the line
            completed[line] = term.read_until(rb"[\r\n]LINE:(.*)\|\r?\n").group(1).decode()
    finally:
        term.close()
    assert completed == {
        "fedlightning train federation.rou": "fedlightning train federation.rounds=",
        "fedlightning train experiment=cil_co": "fedlightning train experiment=cil_cora ",
        "fedlightning tr": "fedlightning train ",
        "fedlightning train algo": "fedlightning train algorithm",
        "fedlightning train bank=": "fedlightning train bank=tg",  # tgat, tgn
    }


ZSH_CALL = """compdef() { print -r -- "compdef $*" }
compadd() { print -r -- "compadd $*" }
_files() { print -r -- "_files" }
eval "$(fedlightning completion zsh)" || exit 3
words=("$@"); CURRENT=$#
_fedlightning
"""


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_function(shell_env):
    """The zsh function with zsh's completion builtins stubbed: whole-word candidates, no
    space after a key awaiting its value, file names when nothing matches."""

    def run(*words: str) -> list[str]:
        cmd = ["zsh", "-f", "-c", ZSH_CALL, "zsh", *words]
        r = subprocess.run(cmd, env=shell_env, capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    first, *added = run("fedlightning", "train", "experiment=cil_c")
    assert first == "compdef _fedlightning fedlightning"
    assert added == ["compadd -Q -- experiment=cil_citeseer_mm experiment=cil_cora"]
    assert run("fedlightning", "train", "federation.rou")[1:] == [
        "compadd -Q -S  -- federation.rounds="
    ]
    assert run("fedlightning", "sweep", "sw")[1:] == ["_files"]
