#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the test suite. Real-data tests read ../shared/data
# (or FEDLIGHTNING_TEST_DATA); with CI set, a missing data directory fails them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/python -m pytest "$@"
