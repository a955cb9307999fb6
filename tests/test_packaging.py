"""pyproject.toml's extras name everything the code and the tests import.

A fresh `pip install '.[test]'` once lacked websockets, which tests/test_crowd.py needs
through scripts/stclient.py. The imports are read from the source (ast), the installed
distribution of each from importlib.metadata, so nothing here is a copied list.
"""
import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCAL = {"kvviz", *(p.stem for p in (ROOT / "tests").glob("*.py")),
         *(p.stem for p in (ROOT / "scripts").glob("*.py"))}


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def declared(*groups: str) -> set[str]:
    out = set()
    for g in groups:
        reqs = PROJECT["dependencies"] if g == "main" else PROJECT["optional-dependencies"][g]
        out |= {_name(r) for r in reqs}
    return out


def imports(files) -> set[str]:
    """Top-level module names imported anywhere in these files (inside functions too)."""
    mods = set()
    for f in files:
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Import):
                mods |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                mods.add(n.module.split(".")[0])
    return mods


def third_party(files) -> set[str]:
    """Distributions providing the non-stdlib, non-local imports of `files` (and of the
    scripts they import, which tests load from scripts/)."""
    files = list(files)
    mods = imports(files)
    scripts = {m for m in mods if (ROOT / "scripts" / f"{m}.py").is_file()}
    mods |= imports(ROOT / "scripts" / f"{m}.py" for m in scripts)
    dists = md.packages_distributions()
    out = set()
    for m in sorted(mods - set(sys.stdlib_module_names) - LOCAL - {"__future__"}):
        assert m in dists, f"{m} is imported but no installed distribution provides it"
        out |= {d.lower().replace("_", "-") for d in dists[m]}
    return out


def test_the_test_extra_covers_what_the_tests_import(torch_stack):
    # maps import names to installed distributions: the capture stack must be installed
    needed = third_party((ROOT / "tests").rglob("*.py"))
    missing = needed - declared("main", "test", "capture", "scale")
    assert not missing, f"add to [project.optional-dependencies] test: {sorted(missing)}"
    assert "websockets" in declared("test")


def test_the_package_declares_what_it_imports(torch_stack):
    # maps import names to installed distributions: the capture stack must be installed
    needed = third_party((ROOT / "kvviz").rglob("*.py"))
    missing = needed - declared("main", "capture", "scale")
    assert not missing, f"kvviz imports {sorted(missing)}, which no dependency or extra names"


def _version(text: str) -> tuple:
    return tuple(int(x) for x in text.split("."))


def _inside(version: str, spec: str) -> bool:
    """`version` satisfies every clause of `spec` (">=2.13,<3"; plain release numbers only)."""
    ops = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b,
           "!=": lambda a, b: a != b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}
    v = _version(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op = next(o for o in ops if clause.startswith(o))
        b = _version(clause[len(op):].strip())
        width = max(len(v), len(b))
        if not ops[op](v + (0,) * (width - len(v)), b + (0,) * (width - len(b))):
            return False
    return True


def _split(req: str) -> tuple[str, str]:
    name = _name(req)
    return name, req.strip()[len(name):].split(";")[0].strip()


def test_requirements_files_pin_inside_the_ranges():
    """pyproject.toml names ranges, the requirements files the measured pins: the same
    names (a pin in one and not the other is how websockets went missing), an exact pin
    for each, inside its range, and no package in two lists of one install."""
    def pins(name):
        lines = (ROOT / name).read_text().splitlines()
        return dict(_split(ln.split("#")[0]) for ln in lines
                    if ln.split("#")[0].strip() and not ln.startswith("-"))

    for extra, req in (("main", "requirements.txt"), ("test", "requirements-dev.txt"),
                       ("capture", "requirements-capture.txt"), ("scale", "requirements-scale.txt")):
        ranges = dict(_split(r) for r in (PROJECT["dependencies"] if extra == "main"
                                          else PROJECT["optional-dependencies"][extra]))
        pinned = pins(req)
        assert set(pinned) == set(ranges), req
        for name, spec in ranges.items():
            assert not spec.startswith("=="), f"{extra}: {name} is pinned; pyproject.toml gives ranges"
            assert pinned[name].startswith("=="), f"{req}: {name} must be an exact pin"
            assert _inside(pinned[name][2:], spec), f"{req}: {name}{pinned[name]} is outside {spec}"
    main = {_name(r) for r in PROJECT["dependencies"]}
    for extra, reqs in PROJECT["optional-dependencies"].items():
        assert not main & {_name(r) for r in reqs}, f"{extra} repeats a main dependency"
