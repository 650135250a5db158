"""Shell completion of ``fedlightning``: its commands, and the Hydra overrides of
``fedlightning train``, ``flower-sim`` and ``data manifest`` (config groups and their
options, e.g. ``experiment=cil_cora algorithm=fedogl``, and keys of the composed config, e.g.
``federation.rounds=``).

Installed with ``eval "$(fedlightning completion bash)"`` (or ``zsh``; docs/experiments.md).
The shell function calls ``fedlightning completion query LINE`` with the command line up to
the cursor; :func:`candidates` answers with Hydra's own completer over ``conf/train.yaml``,
without importing torch. Hydra's ``-sc``/``--shell-completion`` flag is answered here too
(Hydra's own script would register ``fedlightning train`` as the command)."""

from __future__ import annotations

import os
import sys

COMMANDS = ("train", "sweep", "report", "flower-sim", "data", "completion", "--help")
SUBCOMMANDS = {"data": ("features", "manifest"), "completion": ("bash", "zsh", "query")}
# options of the override-taking commands, and those of them that take a value
OPTIONS = {
    "train": ("--multirun", "--cfg", "--resolve", "--package", "--info", "--help"),
    "flower-sim": ("--run-dir", "--help"),
    "manifest": ("--out", "--help"),
}
VALUE_OPTIONS = ("--run-dir", "--out", "--cfg", "-c", "--package", "-p", "--info", "-i")
SHELL_FLAGS = ("-sc", "--shell-completion")
SHELLS = ("bash", "zsh")

# Our own script, not Hydra's: Hydra's registers one program and completes only overrides;
# this one completes the commands too and asks Hydra's completer (candidates) for the rest.
BASH = r"""# fedlightning shell completion (bash): eval "$(fedlightning completion bash)"
_fedlightning_complete() {
    local line="${COMP_LINE:0:COMP_POINT}"
    local cur="${COMP_WORDS[COMP_CWORD]}"
    # a lone '=' or ':' is a word to bash but not to readline, which inserts after it
    [[ "$cur" == [=:] ]] && cur=""
    local token="${line##*[[:space:]]}"  # the word under completion, '=' and ':' included
    local prefix=""  # what bash splits off before $cur at COMP_WORDBREAKS ('=' and ':')
    [[ "$token" == *"$cur" ]] && prefix="${token%"$cur"}"
    local IFS=$'\n' choice nospace=""
    local program="${COMP_WORDS[0]/#\~/$HOME}"
    local choices=($("$program" completion query "$line" 2>/dev/null))
    COMPREPLY=()
    for choice in "${choices[@]}"; do
        [[ "$choice" == *[=./] ]] && nospace=1
        COMPREPLY+=("${choice#"$prefix"}")
    done
    [[ -n "$nospace" ]] && compopt -o nospace 2>/dev/null
    return 0
}
complete -o default -F _fedlightning_complete fedlightning
"""

ZSH = r"""# fedlightning shell completion (zsh, after compinit): eval "$(fedlightning completion zsh)"
_fedlightning() {
    local -a choices open closed
    local choice
    choices=("${(@f)$(${words[1]} completion query "${(j: :)words[1,CURRENT]}" 2>/dev/null)}")
    for choice in $choices; do
        [[ -z $choice ]] && continue
        if [[ $choice == *[=./] ]]; then open+=("$choice"); else closed+=("$choice"); fi
    done
    (( $#open )) && compadd -Q -S '' -- "${open[@]}"
    (( $#closed )) && compadd -Q -- "${closed[@]}"
    (( $#open + $#closed )) || _files
}
compdef _fedlightning fedlightning
"""


def script(shell: str) -> str:
    """The completion script of ``shell`` (``bash`` or ``zsh``)."""
    return {"bash": BASH, "zsh": ZSH}[shell]


def _overrides(words: list[str]) -> list[str]:
    """The Hydra overrides among ``words``, options and their values left out (``-m`` kept)."""
    kept, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("-m", "--multirun"):
            kept.append("-m")
        elif w.startswith("-"):
            skip = w in VALUE_OPTIONS
        else:
            kept.append(w)
    return kept


def override_candidates(done: list[str], word: str) -> list[str]:
    """Hydra's completions of the override ``word`` after the overrides ``done``: config
    groups (``algorithm=``), their options (``experiment=cil_cora algorithm=fedogl``) and keys of the
    config composed with ``done`` (``federation.rounds=``)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.plugins.completion_plugin import DefaultCompletionPlugin

    from fedlightning.resources import conf_dir

    line = " ".join([*done, word])
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        return DefaultCompletionPlugin(loader)._query(config_name="train", line=line)


def candidates(line: str) -> list[str]:
    """The completions of the last word of ``line``, a ``fedlightning`` command line up to
    the cursor (a trailing space: a new word). Never raises: a line that cannot be read, or
    a config that does not compose, completes nothing (the shell then offers file names)."""
    words = line.split()[1:]  # without the program
    word = "" if not line or line[-1].isspace() or not words else words.pop()
    try:
        if not words:
            return [c for c in COMMANDS if c.startswith(word)]
        command, args = words[0], words[1:]
        if command in SUBCOMMANDS and not args:
            return [c for c in SUBCOMMANDS[command] if c.startswith(word)]
        if command == "data" and args[0] == "manifest":
            command, args = "manifest", args[1:]
        if command not in OPTIONS:
            return []
        if word.startswith("-"):
            return [o for o in OPTIONS[command] if o.startswith(word)]
        if args and args[-1] in VALUE_OPTIONS:
            return []  # a value of an option (a folder): the shell's file names
        return override_candidates(_overrides(args), word)
    except Exception:  # completion must never print a traceback into the user's shell
        return []


def shell_completion_request(args: list[str]) -> str | None:
    """Hydra's ``-sc``/``--shell-completion`` request among ``args`` (e.g.
    ``install=bash``), else ``None``."""
    for i, a in enumerate(args):
        if a.startswith("--shell-completion="):
            return a.split("=", 1)[1]
        if a in SHELL_FLAGS:
            return args[i + 1] if i + 1 < len(args) else ""
    return None


def main(args: list[str]) -> int:
    """``fedlightning completion bash|zsh|query LINE``, or Hydra's ``-sc install=bash``,
    ``uninstall=bash``, ``query=bash`` (the line in ``COMP_LINE``) given to ``fedlightning``
    or ``fedlightning train``."""
    request = shell_completion_request(args)
    if request is not None:
        action, _, shell = request.partition("=")
        if shell not in SHELLS or action not in ("install", "uninstall", "query"):
            print(
                f"error: -sc: expected install|uninstall|query=bash|zsh, got {request!r}",
                file=sys.stderr,
            )
            return 2
        if action == "install":
            print(script(shell), end="")
        elif action == "uninstall":
            print("complete -r fedlightning" if shell == "bash" else "compdef -d fedlightning")
        else:  # Hydra's scripts read the answer as words separated by spaces
            print(" ".join(candidates(os.environ.get("COMP_LINE", ""))))
        return 0
    rest = args[1:]  # after "completion"
    if rest[:1] == ["query"] and len(rest) == 2:
        print("\n".join(candidates(rest[1])))
        return 0
    if len(rest) == 1 and rest[0] in SHELLS:
        print(script(rest[0]), end="")
        return 0
    print(
        "usage: fedlightning completion bash|zsh   (install: "
        'eval "$(fedlightning completion bash)" in ~/.bashrc)',
        file=sys.stderr,
    )
    return 2
