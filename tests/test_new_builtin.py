"""A built-in policy is its own file plus its reference: then it is everywhere.

The package is copied to a temporary folder, one new file is added to its policies folder
and the policy's slow reference is appended to kvviz/core/reference.py, as
docs/development.md says; kvviz is run from the copy. Nothing else in the copy is edited:
the registry, `kvviz check --all-builtins` (which checks it against that reference),
`kvviz bench`'s default table, the model loop's policy list and the app's policy choices
must all find it."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

NEW_POLICY = '''
"""Oldest first: a policy that evicts the oldest positions, for a test."""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, Rank


@dataclass
class Oldest(Policy):
    name = "oldest"
    label = "oldest first"
    rank = Rank("age", "position", "the oldest position goes first")
    reference = "kvviz.core.reference:RefOldest"
    uses_attention = False

    def columns(self):
        return {"age": (np.float64, (), 0.0)}

    def observe(self, attn):
        pass

    def priority(self):
        return self.kept.astype(np.float64)
'''

NEW_REFERENCE = '''

class RefOldest(RefPolicy):
    """The slow statement of the rule: rank each slot by its position."""

    name = "oldest"

    def observe(self, weights):
        pass

    def new_record(self):
        return None

    def rank(self, i):
        return self.keep[i]
'''


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvviz-copy")
    shutil.copytree(REPO / "kvviz", root / "kvviz", ignore=shutil.ignore_patterns("__pycache__", "_bundle"))
    for name in ("pyproject.toml", "app.py"):
        shutil.copy2(REPO / name, root / name)
    shutil.copytree(REPO / "traces", root / "traces")
    (root / "kvviz" / "core" / "policies" / "oldest.py").write_text(NEW_POLICY, encoding="utf-8")
    with open(root / "kvviz" / "core" / "reference.py", "a", encoding="utf-8") as ref:
        ref.write(NEW_REFERENCE)
    return root


def run(copy: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=copy, capture_output=True, text=True, timeout=600)


def test_the_registry_and_every_list_find_the_new_file(copy):
    code = textwrap.dedent("""
        import kvviz
        from kvviz.core.policies import BUILTINS
        from kvviz.core.reference import make_reference
        from kvviz.model.loop.cli import perf_policies
        from kvviz.app.state import default_cmp
        print(list(kvviz.POLICIES))
        print([c.name for c in BUILTINS])
        print("oldest" in perf_policies(), "oldest" in default_cmp("tova", "oldest"))
        print(type(make_reference("oldest", budget=8)).__name__)
    """)
    r = run(copy, "-c", code)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    order = ["tova", "snapkv", "h2o", "streaming-llm", "scissorhands", "knorm", "random", "vatp",
             "expected-attention", "oldest", "raas", "rkv"]
    assert lines[0] == repr(order)  # the built-ins keep their order; new files follow by name
    assert lines[1] == repr(order)
    assert lines[2] == "True True"
    assert lines[3] == "RefOldest"


def test_kvviz_check_all_builtins_checks_it_against_its_reference(copy, long_run):
    r = run(copy, "-m", "kvviz", "check", "--all-builtins")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "oldest" in r.stdout and "FAIL" not in r.stdout


def test_kvviz_bench_lists_it_by_default(copy):
    r = run(copy, "-m", "kvviz", "bench", "--budgets", "64")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    assert any(row and row[0] == "oldest" for row in rows), r.stdout


def test_the_shipped_package_has_no_such_file():
    assert not (REPO / "kvviz" / "core" / "policies" / "oldest.py").exists()
