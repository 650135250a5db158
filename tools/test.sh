#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the test suite. Real-data tests read ../shared/data
# (or FEDLIGHTNING_TEST_DATA); with CI set, a missing data directory fails them.
# Tests run on FEDLIGHTNING_TEST_WORKERS pytest-xdist workers (default: the number of cores,
# at most 4; 0 runs them in this process), work-stealing so that one long test does not hold
# up the rest; `-n N` on the command line overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# the package's byte code, which no test process then compiles again for itself (where
# PYTHONDONTWRITEBYTECODE is set, none writes it: half a second for each process)
.venv/bin/python -m compileall -q -j 0 fedlightning >/dev/null
cores="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
workers="${FEDLIGHTNING_TEST_WORKERS:-$((cores < 4 ? cores : 4))}"
xdist=()
case " $* " in
  *" -n "* | *" -n"[0-9]* | *" --numprocesses"*) ;;
  *) [ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist worksteal) ;;
esac
exec .venv/bin/python -m pytest "${xdist[@]}" "$@"
