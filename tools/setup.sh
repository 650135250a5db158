#!/usr/bin/env bash
# Set up fedlightning in ./.venv: the CPU build of torch first (an unpinned torch would pull
# a multi-GB CUDA build), then the package with its development, feature-extraction and Flower
# extras (`features`: the encoders of `fedlightning data features`; `flower`: runner=flower). Idempotent.
# uv (installed into the environment by pip) resolves, downloads and installs in parallel, with
# pip's find-links; it does not byte-compile, and compileall then compiles the
# environment on every core, once per set of installed packages (fresh set-ups on two cores:
# pip 2 min 44 s, uv 2 min 5 s with an empty uv cache, of which compileall 1.5 min).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Done already for this pyproject.toml and this script (the editable install follows the
# code by itself): nothing to do. Remove .venv/.setup to redo it.
setup="$(cat pyproject.toml tools/setup.sh | sha256sum | cut -c1-16)"
[ "$(cat .venv/.setup 2>/dev/null || true)" = "$setup" ] && exit 0
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q --no-compile "uv>=0.5"
# uv reads no pip configuration: pip's find-links (where a local CPU torch may lie) for uv too
links="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-$("${pip[@]}" config get global.find-links 2>/dev/null || true)}}"
[ -z "$links" ] || export UV_FIND_LINKS="$links"
uv=(.venv/bin/uv pip install --python .venv/bin/python --quiet)
"${uv[@]}" "torch==2.13.0"
"${uv[@]}" -e ".[dev,features,flower]"
freeze=("${pip[@]}" freeze --exclude-editable)
stamp="$("${freeze[@]}" 2>/dev/null | sha256sum | cut -c1-16)"
if [ "$(cat .venv/.compiled 2>/dev/null || true)" != "$stamp" ]; then
  site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # a package's deliberately invalid test files fail to compile, as they do under pip
  .venv/bin/python -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
  echo "$stamp" >.venv/.compiled
fi
echo "$setup" >.venv/.setup
