"""The package's layers hold: core < model < studies < app, no upward import, no cycle; the
lab (lab/, outside the package) may import the package and is never imported by it; the layout
map in docs/development.md names exactly the modules there are; no dead docstrings.

Every module's imports are read from its source (imports inside functions count: they are
how a cycle hides), so the rule is checked without importing anything. A module may import
from its own layer and the layers below it. The package root holds the public facade
(`kvviz`, re-exporting the core), the command line (`kvviz.__main__`, the top) and two short
documented paths that forward to a layer (`kvviz.hf`, `kvviz.policies.base`); nothing inside
a layer imports the facade or the command line.

Cycles are refused at two grains: between modules, and between the units directly under a
layer (`kvviz.app.ui`, `kvviz.app.figures`, `kvviz.core.trace`, ...), so two folders of one
layer cannot lean on each other either.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvviz"
LAYERS = ("core", "model", "studies", "app")
TOP = len(LAYERS)
ROOTS = {  # the package root's modules and the layer each stands at
    "kvviz": TOP, "kvviz.__main__": TOP,
    "kvviz.hf": LAYERS.index("model"),
    "kvviz.policies": LAYERS.index("core"), "kvviz.policies.base": LAYERS.index("core"),
}


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(package: Path = PACKAGE) -> dict[str, tuple[str, str]]:
    """{module: (file, source)} for every module of the package (build output excluded)."""
    return {module_name(p, package): (str(p.relative_to(package.parent)), p.read_text(encoding="utf-8"))
            for p in sorted(package.rglob("*.py")) if "_bundle" not in p.parts}


def imports(module: str, source: str, known: set[str]) -> set[str]:
    """The package's modules `module` imports, anywhere in its body."""
    is_pkg = module in known and any(k.startswith(module + ".") for k in known)
    out = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_pkg else module.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known and name != module and name.split(".")[0] == "kvviz":
                out.add(name)
    return out


def layer(module: str) -> int:
    if module in ROOTS:
        return ROOTS[module]
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        raise AssertionError(f"{module} is in no layer: put it under kvviz/{{{','.join(LAYERS)}}}/")
    return LAYERS.index(parts[1])


def unit(module: str) -> str:
    """The folder or module directly under the module's layer."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 1 and parts[1] in LAYERS else module


def name_of(rank: int) -> str:
    return LAYERS[rank] if rank < TOP else "the package root"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one node."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(_path(graph, sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph, comp):
    """A concrete cycle inside one component, starting at its first node."""
    members, start = set(comp), comp[0]
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def violations(mods: dict[str, tuple[str, str]]) -> list[str]:
    known = set(mods)
    graph = {m: imports(m, src, known) for m, (_, src) in mods.items()}
    out = []
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            if layer(t) > layer(m) or (t == "kvviz" and m not in ROOTS):
                out.append(f"upward import: {mods[m][0]} ({name_of(layer(m))}) imports "
                           f"{mods[t][0]} ({name_of(layer(t))})")
    for cyc in cycles(graph):
        out.append("import cycle: " + " -> ".join(mods[m][0] for m in cyc))
    units: dict[str, set[str]] = {}
    for m, targets in graph.items():
        units.setdefault(unit(m), set()).update(unit(t) for t in targets if unit(t) != unit(m))
    for cyc in cycles(units):
        out.append("cycle between folders: " + " -> ".join(cyc))
    return out


def test_layers_hold():
    assert violations(sources()) == []


def test_every_module_is_in_a_layer():
    for m in sources():
        layer(m)  # raises, naming the module


def with_line(mods, module, line):
    changed = dict(mods)
    file, src = changed[module]
    changed[module] = (file, src + "\n" + line + "\n")
    return changed


def test_an_upward_import_is_named_with_both_files():
    mods = sources()
    bad = violations(with_line(mods, "kvviz.core.trace", "def f():\n    from kvviz.app.ui import layout"))
    assert bad[0] == "upward import: kvviz/core/trace.py (core) imports kvviz/app/ui/layout.py (app)"
    assert all(line.startswith(("import cycle", "cycle between")) for line in bad[1:])


def test_a_cycle_is_named():
    mods = sources()
    bad = violations(with_line(mods, "kvviz.core.harness", "def f():\n    import kvviz.core.groups"))
    assert "import cycle: kvviz/core/groups.py -> kvviz/core/harness.py -> kvviz/core/groups.py" in bad


def test_a_cycle_between_folders_of_one_layer_is_named():
    mods = sources()
    bad = violations(with_line(mods, "kvviz.app.figures.common", "import kvviz.app.ui.layout"))
    assert "cycle between folders: kvviz.app.figures -> kvviz.app.ui -> kvviz.app.figures" in bad


def test_a_layer_never_imports_the_facade():
    mods = sources()
    bad = violations(with_line(mods, "kvviz.model.models", "from kvviz import make_policy"))
    assert bad and bad[0].startswith("upward import: kvviz/model/models.py (model) imports kvviz/__init__.py")


# --- the lab: outside the package, above it -----------------------------------------------
LAB = PACKAGE.parent / "lab"


def lab_sources() -> dict[str, tuple[str, str]]:
    return sources(LAB)


def imported_names(source: str) -> set[str]:
    """Every absolute module name a source imports, anywhere in its body (`from M import a`:
    M, and M.a, which may be a module or a name M defines)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def defines(source: str) -> set[str]:
    """The names a module's top level binds (functions, classes, assignments, imports)."""
    out = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return out


def lab_violations(package: dict[str, tuple[str, str]], lab: dict[str, tuple[str, str]]) -> list[str]:
    """The package importing the lab, or the lab importing a kvviz module (or a name of one)
    that does not exist: a module moved out of the package leaves no stale import behind."""
    out = [f"the package imports the lab: {file} imports {name}"
           for _, (file, src) in sorted(package.items()) for name in sorted(imported_names(src))
           if name == "lab" or name.startswith("lab.")]
    for _, (file, src) in sorted(lab.items()):
        for name in sorted(imported_names(src)):
            if name.split(".")[0] != "kvviz" or name in package:
                continue
            parent, _, attr = name.rpartition(".")
            if parent not in package or attr not in defines(package[parent][1]):
                out.append(f"no such module: {file} imports {name}")
    return out


def test_the_lab_stands_above_the_package():
    lab = lab_sources()
    assert "lab.tasks_report" in lab and "lab" in lab
    assert lab_violations(sources(), lab) == []


def test_a_package_module_importing_the_lab_is_named():
    mods = with_line(sources(), "kvviz.studies.table", "def f():\n    from lab import tasks_report")
    assert lab_violations(mods, lab_sources()) == [
        "the package imports the lab: kvviz/studies/table.py imports lab",
        "the package imports the lab: kvviz/studies/table.py imports lab.tasks_report"]


def test_a_lab_import_of_a_moved_module_is_named():
    lab = with_line(lab_sources(), "lab.loop_report", "import kvviz.studies.loop_report")
    assert lab_violations(sources(), lab) == ["no such module: lab/loop_report.py imports kvviz.studies.loop_report"]
    lab = with_line(lab_sources(), "lab.loop_report", "from kvviz.studies import pooling_study")
    assert lab_violations(sources(), lab) == ["no such module: lab/loop_report.py imports kvviz.studies.pooling_study"]


# --- the layout map in docs/development.md, checked against this table and the tree ----------
DEV = PACKAGE.parent / "docs" / "development.md"


def layout_map(text: str) -> tuple[list[str], set[str]]:
    """(the folders named at the left margin, in order; every path the map names) from the
    first ```text block after "## Four layers". A line at the margin names paths from the
    checkout's root (a folder there opens a group); a line indented by two names paths inside
    the open group; deeper lines continue a description. A line's names are its first field
    (up to two spaces), split at ", "."""
    block = text.split("## Four layers", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    headings, named, group = [], set(), ""
    for line in block.splitlines():
        if not line.strip() or line.startswith("   "):
            continue
        inner = line.startswith("  ")
        field = line.strip().split("  ", 1)[0]
        for name in field.split(", "):
            path = (group + name) if inner else name
            named.add(path.rstrip("/") + ("/" if name.endswith("/") else ""))
            if not inner and name.endswith("/"):
                headings.append(name)
                group = name
            elif not inner:
                group = ""
    return headings, named


def map_problems(text: str, root: Path = PACKAGE.parent) -> list[str]:
    headings, named = layout_map(text)
    out = []
    layers = [h for h in headings if h.startswith("kvviz/")]
    want = [f"kvviz/{layer}/" for layer in LAYERS]
    if [h for h in layers if h in want] != want:
        out.append(f"the map's layers are {layers}, the layering test's {want}")
    for m in ROOTS:  # the package root's modules, each at its layer in the table
        rel = m.replace(".", "/")
        if not ({rel + ".py", rel + "/__init__.py"} & named or any(n.startswith(rel + "/") for n in named)):
            out.append(f"the map names no {rel}.py (the package root's {m})")
    folders = {n for n in named if n.endswith("/") and n not in headings}  # name all of their files
    for n in sorted(named):
        if not (root / n).exists():
            out.append(f"the map names {n}, which does not exist")
    for base in (PACKAGE, LAB):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "_bundle" in path.parts or rel in named or any(rel.startswith(f) for f in folders):
                continue
            pkg = rel.rsplit("/", 1)[0] + "/"
            if path.name == "__init__.py" and (pkg in named or any(n.startswith(pkg) for n in named)):
                continue  # a package is named by its folder or by a module of it
            out.append(f"the map names no {rel}")
    return out


def test_the_layout_map_names_every_module_and_only_modules_that_exist():
    assert map_problems(DEV.read_text(encoding="utf-8")) == []


def test_the_layout_map_check_names_a_missing_and_a_stale_module():
    text = DEV.read_text(encoding="utf-8")
    gone = text.replace("  spans.py          span integrity\n", "")
    assert map_problems(gone) == ["the map names no kvviz/core/spans.py"]
    stale = text.replace("  spans.py          span integrity\n",
                         "  spans.py          span integrity\n  ghost.py          never written\n")
    assert map_problems(stale) == ["the map names kvviz/core/ghost.py, which does not exist"]
    swapped = text.replace("kvviz/model/        torch", "kvviz/modelx/       torch")
    assert "the map's layers are" in map_problems(swapped)[0]


# --- no dead docstrings: a string statement after the first in a module, class or function ---
def dead_strings(source: str) -> list[int]:
    out = []
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            out += [s.lineno for s in body[1:] if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                    and isinstance(s.value.value, str)]
    return out


def test_no_dead_docstrings():
    found = {file: lines for file, src in list(sources().values()) + list(lab_sources().values())
             if (lines := dead_strings(src))}
    assert found == {}
    assert dead_strings('"""doc."""\nimport os\n"""dead."""\ndef f():\n    """doc."""\n    """dead."""\n') == [3, 6]
