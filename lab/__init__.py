"""The lab: the studies' runners and report generators, outside the installed package.

Run from the repository root, e.g. `python -m lab.tasks_report traces/tasks --write`. The lab
may import kvviz; kvviz never imports the lab (tests/test_layers.py). Each report prints by
default and writes its tracked files (docs/studies/, traces/<study>/) only with `--write`.
"""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout: where docs/ and traces/ are
STUDIES = Path("docs") / "studies"  # the generated study pages, under REPO
