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
LOCAL = {"kvviz", "lab", *(p.stem for p in (ROOT / "tests").glob("*.py")),  # lab/: the studies, not installed
         *(p.stem for p in (ROOT / "scripts").glob("*.py"))}


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def requirements(group: str) -> list[str]:
    """A group's requirements ("main": the dependencies), an extra naming kvviz's own
    extras (capture = kvviz[model]) read as theirs."""
    if group == "main":
        return list(PROJECT["dependencies"])
    out = []
    for req in PROJECT["optional-dependencies"][group]:
        if _name(req) == "kvviz":
            for extra in req[req.index("[") + 1:req.index("]")].split(","):
                out += requirements(extra.strip())
        else:
            out.append(req)
    return out


EXTRAS = tuple(PROJECT["optional-dependencies"])


def declared(*groups: str) -> set[str]:
    return {_name(r) for g in groups for r in requirements(g)}


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
    missing = needed - declared("main", *EXTRAS)
    assert not missing, f"add to [project.optional-dependencies] test: {sorted(missing)}"
    assert "websockets" in declared("test")


def test_the_package_declares_what_it_imports(torch_stack):
    # maps import names to installed distributions: the capture stack must be installed
    needed = third_party((ROOT / "kvviz").rglob("*.py"))
    missing = needed - declared("main", *(e for e in EXTRAS if e != "test"))
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


# each requirements file pins these groups of pyproject.toml, no more and no fewer names
FILES = {"requirements.txt": ("main", "app"), "requirements-dev.txt": ("test", "check", "class"),
         "requirements-capture.txt": ("model",), "requirements-scale.txt": ("scale",),
         "requirements-notebook.txt": ("notebook",)}


def own(group: str) -> list[str]:
    """A group's requirements without the kvviz extras it names (notebook = kvviz[app] and
    anywidget: its file includes requirements.txt for the app's pins and pins anywidget)."""
    return requirements(group) if group == "main" else [
        r for r in PROJECT["optional-dependencies"][group] if _name(r) != "kvviz"]


def pins(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    return dict(_split(ln.split("#")[0]) for ln in lines
                if ln.split("#")[0].strip() and not ln.startswith("-"))


def test_requirements_files_pin_inside_the_ranges():
    """pyproject.toml names ranges, the requirements files the measured pins: the same
    names (a pin in one and not the other is how websockets went missing), an exact pin
    for each, inside its range, and no package in two lists of one install."""
    covered = set()
    for req, groups in FILES.items():
        ranges = dict(_split(r) for g in groups for r in own(g))
        pinned = pins(req)
        assert set(pinned) == set(ranges), req
        for name, spec in ranges.items():
            assert not spec.startswith("=="), f"{groups}: {name} is pinned; pyproject.toml gives ranges"
            assert pinned[name].startswith("=="), f"{req}: {name} must be an exact pin"
            assert _inside(pinned[name][2:], spec), f"{req}: {name}{pinned[name]} is outside {spec}"
        covered |= set(groups)
    assert covered == {"main", *EXTRAS} - {"capture"}, "an extra no requirements file pins"
    main = declared("main")
    for extra in EXTRAS:
        assert not main & declared(extra), f"{extra} repeats a main dependency"


def test_the_core_needs_numpy_and_tqdm_only():
    """`pip install kvviz` is the library: what the app, the model and the rest need comes
    with an extra; `capture` stays the other name of `model`; a package in two extras has
    the same range in each."""
    assert declared("main") == {"numpy", "tqdm"}
    assert requirements("capture") == requirements("model")
    assert {"torch", "transformers"} <= declared("model") and "streamlit" in declared("app")
    assert declared("check") == {"hypothesis"} and declared("class") == {"redis"}
    ranges: dict[str, str] = {}
    for extra in EXTRAS:
        for name, spec in (_split(r) for r in requirements(extra)):
            assert ranges.setdefault(name, spec) == spec, f"{name}: {spec} in {extra}, {ranges[name]} elsewhere"


def test_the_same_pin_wherever_a_package_is_pinned():
    seen: dict[str, tuple[str, str]] = {}
    for req in FILES:
        for name, pin in pins(req).items():
            first = seen.setdefault(name, (pin, req))
            assert first[0] == pin, f"{name}{pin} in {req}, {first[0]} in {first[1]}"
