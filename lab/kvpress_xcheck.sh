#!/usr/bin/env bash
# The kvpress cross-check for attention-scored presses, in one command: builds kvpress's venv if
# it is missing (lab/kvpress_venv.sh), records what kvpress 0.5.5 keeps (lab/kvpress_attn.py, in
# that venv), then compares kvviz on the same tokens (lab/kvpress_xcompare.py, in kvviz's .venv).
#
#   ./lab/kvpress_xcheck.sh OUT [--write]
#
# OUT gets kvpress_attn.json (kvpress's side) and kvpress_xcheck.json (the comparison). Only with
# --write are the tracked files rewritten: docs/studies/loop_kvpress_attn.json and the figures
# block of docs/studies/loop_kvpress_attn.md. KVPRESS_VENV (default: venv-kvpress beside the
# checkout) and KVVIZ_PYTHON (default: the checkout's .venv/bin/python) choose the interpreters.
# Not run by CI: about 2 minutes with the venv built, ~1.5 min and ~1.5 GB more to build it.
set -euo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ] || { [ $# -eq 2 ] && [ "$2" != "--write" ]; } || [ $# -gt 2 ]; then
    echo "usage: $0 OUT [--write]" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$1"
WRITE=("${@:2}")
VENV="${KVPRESS_VENV:-$(dirname "$ROOT")/venv-kvpress}"
PY="${KVVIZ_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$VENV/bin/python" ] || "$ROOT/lab/kvpress_venv.sh" "$VENV"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$VENV/bin/python" "$ROOT/lab/kvpress_attn.py" --text "$ROOT/traces/sources/execmodel.txt" \
    --tokens 512 --budget 128 --out "$OUT/kvpress_attn.json"
cd "$ROOT"
"$PY" -m lab.kvpress_xcompare --kvpress "$OUT/kvpress_attn.json" --out "$OUT" "${WRITE[@]}"
