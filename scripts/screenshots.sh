#!/usr/bin/env bash
# Regenerate the screenshots in docs/images/ from the browser tests that take them (Debian's
# chromium and the playwright package, as for the tests themselves):
#
#   ./scripts/screenshots.sh            every docs/images/screenshot*.png
#   ./scripts/screenshots.sh lecture    only the lecture's projector pages
#   ./scripts/screenshots.sh notebook   only the notebook widget in JupyterLab
#
# each test writes its pages to artifacts/ and, with KVVIZ_SCREENSHOT=1, copies them to docs/images/:
#   tests/test_e2e.py            docs/images/screenshot.png, -zoom.png, -scores.png, -tokens.png
#   tests/test_e2e_projector.py  docs/images/screenshot-1024.png, -zoom125.png (the explorer)
#   tests/test_e2e_present.py    docs/images/screenshot-present-1024.png, -present-150.png
#   tests/test_e2e_lecture.py    docs/images/screenshot-lecture-1024.png, -lecture-zoom125.png,
#                                -lecture-question.png, -lecture-reveal-student.png
#   tests/test_e2e_notebook.py   docs/images/screenshot-notebook.png (the replay view in JupyterLab)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
case "${1:-all}" in
  lecture) TESTS=(tests/test_e2e_lecture.py) ;;
  notebook) TESTS=(tests/test_e2e_notebook.py) ;;
  all) TESTS=(tests/test_e2e.py tests/test_e2e_projector.py tests/test_e2e_present.py
              tests/test_e2e_lecture.py tests/test_e2e_notebook.py) ;;
  *) echo "usage: $0 [all|lecture|notebook]" >&2; exit 2 ;;
esac
KVVIZ_SCREENSHOT=1 KVVIZ_REQUIRE_E2E=1 OMP_NUM_THREADS=1 "$PY" -m pytest -q "${TESTS[@]}"
