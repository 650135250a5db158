#!/usr/bin/env bash
# Set up fedlightning in ./.venv: the CPU build of torch first (an unpinned torch would pull
# a multi-GB CUDA build), then the package with its development, feature-extraction and Flower
# extras (`features`: the encoders of `fedlightning data features`; `flower`: runner=flower). Idempotent.
# pip byte-compiles file by file on one core; here it installs without compiling and
# compileall then compiles the environment on every core, once per set of installed packages
# (fresh set-ups one after the other on two cores: 3 min 18 s with pip's compilation, 2 min 44 s so).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PIP=(.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Done already for this pyproject.toml and this script (the editable install follows the
# code by itself): nothing to do. Remove .venv/.setup to redo it.
setup="$(cat pyproject.toml tools/setup.sh | sha256sum | cut -c1-16)"
[ "$(cat .venv/.setup 2>/dev/null || true)" = "$setup" ] && exit 0
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[dev,features,flower]"
freeze=(.venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check)
stamp="$("${freeze[@]}" 2>/dev/null | sha256sum | cut -c1-16)"
if [ "$(cat .venv/.compiled 2>/dev/null || true)" != "$stamp" ]; then
  site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # a package's deliberately invalid test files fail to compile, as they do under pip
  .venv/bin/python -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
  echo "$stamp" >.venv/.compiled
fi
echo "$setup" >.venv/.setup
