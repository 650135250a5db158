#!/usr/bin/env bash
# Set up fedlightning in ./.venv: the CPU build of torch first (an unpinned torch would pull
# a multi-GB CUDA build), then the package with its development, feature-extraction and Flower
# extras (`features`: the encoders of `fedlightning data features`; `flower`: runner=flower). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,features,flower]"
