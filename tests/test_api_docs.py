"""The API reference builds from the docstrings with no warning, and the core documents itself.

The reference is what a newcomer reads after the README; a public name of the core with no
docstring is a hole in it, so every one is required here (a method that overrides a
documented base method inherits that documentation)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import api_docs  # noqa: E402

import kvviz.core  # noqa: E402


def core_modules():
    return [importlib.import_module(m.name)
            for m in pkgutil.walk_packages(kvviz.core.__path__, "kvviz.core.")]


def undocumented(module) -> list[str]:
    missing = [] if inspect.getdoc(module) else [module.__name__]
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if not inspect.getdoc(obj) or (inspect.isclass(obj) and obj.__doc__ is None):
            missing.append(f"{module.__name__}.{name}")
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                    continue
                if not inspect.getdoc(getattr(obj, attr)):
                    missing.append(f"{module.__name__}.{name}.{attr}")
    return missing


def test_every_public_name_of_the_core_has_a_docstring():
    missing = [m for mod in core_modules() for m in undocumented(mod)]
    assert missing == []


def test_the_reference_builds_without_a_warning(tmp_path, long_run):
    """(pdoc over every module: long for its own sake, so the full suite's.)"""
    pages = api_docs.build(tmp_path)  # warnings are errors inside build()
    names = {p.relative_to(tmp_path).as_posix() for p in pages}
    for page in ("kvviz.html", "kvviz/core/replay.html", "kvviz/core/policies/base.html",
                 "kvviz/core/policies/tova.html", "kvviz/model/hf.html", "kvviz/app/figures/cache.html"):
        assert page in names
    facade = (tmp_path / "kvviz.html").read_text(encoding="utf-8")
    for name in ("make_policy", "register_policy", "run_policy", "canonical", "evaluate", "summary"):
        assert f'id="{name}"' in facade, name
    assert "does this policy keep at this budget" in facade  # evaluate's docstring, rendered
