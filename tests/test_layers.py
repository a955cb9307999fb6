"""The package's layers hold: core < model < studies < app, no upward import, no cycle.

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
    bad = violations(with_line(mods, "kvviz.core.harness", "def f():\n    import kvviz.core.replay"))
    assert "import cycle: kvviz/core/harness.py -> kvviz/core/replay.py -> kvviz/core/harness.py" in bad


def test_a_cycle_between_folders_of_one_layer_is_named():
    mods = sources()
    bad = violations(with_line(mods, "kvviz.app.figures.common", "import kvviz.app.ui.layout"))
    assert "cycle between folders: kvviz.app.figures -> kvviz.app.ui -> kvviz.app.figures" in bad


def test_a_layer_never_imports_the_facade():
    mods = sources()
    bad = violations(with_line(mods, "kvviz.model.models", "from kvviz import make_policy"))
    assert bad and bad[0].startswith("upward import: kvviz/model/models.py (model) imports kvviz/__init__.py")
