"""Every ```python snippet in README.md and docs/ (with docs/studies/) runs as shown.

Each is compiled and checked for names it uses but never defines (the loop snippet once
used an undefined `text`), then run in a fresh folder that sees the checkout's traces/, so
what a snippet writes (out/...) lands there and the checkout stays clean. Snippets that run
the model need the capture stack (a failure in CI, KVVIZ_REQUIRE_CAPTURE=1) and share the
session's one model load.
"""
import ast
import builtins
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runs_the_model(code: str) -> bool:
    return any(call in code for call in ("run_loop(", "capture(", "generate(", "_batch("))


def snippets():
    out = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text[:m.start()].count("\n") + 2
            out.append(pytest.param(m.group(1), id=f"{doc.relative_to(ROOT)}:{line}"))
    return out


SNIPPETS = snippets()
MODEL_SNIPPETS = [s for s in SNIPPETS if runs_the_model(s.values[0])]
PLAIN_SNIPPETS = [s for s in SNIPPETS if not runs_the_model(s.values[0])]


def undefined_names(code: str) -> set[str]:
    """Names read but never bound anywhere in the snippet (flat code: no scoping needed)."""
    tree = ast.parse(code)
    bound, used = set(dir(builtins)), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            (used if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.alias):
            bound.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    return used - bound


def test_the_docs_have_snippets():
    assert len(SNIPPETS) >= 3  # README: the library and the loop; docs/app.md: slides


def test_the_name_check_catches_an_undefined_name():
    assert undefined_names("from kvviz.model.loop import run_loop\nres = run_loop(text, [])") == {"text"}
    assert undefined_names("import numpy as np\nx = np.zeros(3)\nprint(x)") == set()


@pytest.mark.parametrize("code", PLAIN_SNIPPETS)
def test_snippet_runs_as_shown(code, tmp_path, monkeypatch):
    run_snippet(code, tmp_path, monkeypatch)


@pytest.mark.parametrize("code", MODEL_SNIPPETS)
def test_model_snippet_runs_as_shown(code, tmp_path, monkeypatch, smollm):
    """Snippets that run the model share the session's one model load (tests/conftest.py)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_snippet(code, tmp_path, monkeypatch)


def run_snippet(code, tmp_path, monkeypatch):
    compiled = compile(code, "<snippet>", "exec")
    assert not undefined_names(code), undefined_names(code)
    (tmp_path / "traces").symlink_to(ROOT / "traces")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__snippet__"}
    exec(compiled, namespace)
    last = ast.parse(code).body[-1]
    if isinstance(last, ast.Expr) and "# True" in code.splitlines()[last.lineno - 1]:
        assert eval(compile(ast.Expression(last.value), "<snippet>", "eval"), namespace) is True
