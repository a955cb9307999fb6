"""Test tiers: what a test needs, read from the fixtures it takes, and a check that none is
forgotten.

The markers (registered in pyproject.toml's [tool.pytest.ini_options]): `model` (torch,
transformers or the SmolLM2 model), `browser` (chromium driven by playwright), `page` (the
whole Streamlit page under AppTest), `server` (a real streamlit / `kvviz app` server
process), `slow` (long for another reason: a sweep on a local Ray cluster, or a test long for
its own sake, which takes `long_run`). tests/conftest.py gives a test the markers of the
fixtures it takes (FIXTURE_MARKS), so a test marks itself by asking for what
it uses; `./scripts/test.sh --fast` leaves out what the fast tier cannot afford.

`static_needs` reads a test module's source and says, per test function, which markers what
it reaches calls for: the names it uses, followed through the module's own helper
functions, aliases and fixtures. conftest fails the collection naming any test that reaches
one of these without the marker (it took the thing directly instead of through its fixture).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

# fixture name -> the marker a test that takes it gets
FIXTURE_MARKS = {
    "smollm": "model",
    "torch_stack": "model",
    "chromium": "browser",
    "apptest": "page",
    "server": "server",
    "caddy": "server",  # the proxy of `kvviz app --workers N`, there with the servers
    "ray_local": "slow",
    "long_run": "slow",  # long for its own sake: thousands of Hypothesis scenarios, ...
}

# names whose use means a marker: a Name or the last part of an Attribute (M.server -> server)
_NAMES = {
    "AppTest": "page",
    "sync_playwright": "browser",
    "require_browser": "browser",
    "start_server": "server",
    "Server": "server",
    "require_capture_stack": "model",
    "load_model": "model",
}
# `M.server()` / `M.browser()` from scripts/measure_latency.py (imported as M), `apphelp.app()`
_ATTRS = {("M", "server"): "server", ("M", "browser"): "browser", ("apphelp", "app"): "page"}
_MODULES = {"torch": "model", "transformers": "model", "playwright": "browser"}
# a subprocess started with one of these arguments runs a server
_SERVER_ARGS = ("app", "run")  # `kvviz app ...`, `streamlit run ...`
_SERVER_FILES = ("predict_server.py",)


def _direct(node: ast.AST, apphelp_app: bool) -> tuple[set[str], set[str]]:
    """(markers this code calls for by itself, the module-level names it refers to)."""
    marks, refs = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            refs.add(n.id)
            if n.id in _NAMES:
                marks.add(_NAMES[n.id])
            if apphelp_app and n.id == "app" and isinstance(n.ctx, ast.Load):
                marks.add("page")
        elif isinstance(n, ast.Attribute):
            if n.attr in _NAMES:
                marks.add(_NAMES[n.attr])
            if isinstance(n.value, ast.Name) and (n.value.id, n.attr) in _ATTRS:
                marks.add(_ATTRS[(n.value.id, n.attr)])
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            for m in mods:
                if m.split(".")[0] in _MODULES:
                    marks.add(_MODULES[m.split(".")[0]])
        elif isinstance(n, ast.Dict):  # run_sweep(..., **{"ray": ...})
            if any(isinstance(k, ast.Constant) and k.value == "ray" for k in n.keys):
                marks.add("slow")
        elif isinstance(n, ast.Call):
            if any(k.arg == "ray" for k in n.keywords):  # run_sweep(..., ray="local")
                marks.add("slow")
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if (name == "getfixturevalue" and n.args and isinstance(n.args[0], ast.Constant)
                    and n.args[0].value in FIXTURE_MARKS):  # a fixture taken at run time
                marks.add(FIXTURE_MARKS[n.args[0].value])
            if name == "importorskip" and n.args and isinstance(n.args[0], ast.Constant):
                if str(n.args[0].value).split(".")[0] in _MODULES:  # importorskip("torch")
                    marks.add(_MODULES[str(n.args[0].value).split(".")[0]])
            if name in ("Popen", "run", "check_output", "call"):
                strings = [a.value for a in ast.walk(n) if isinstance(a, ast.Constant)
                           and isinstance(a.value, str)]
                if (any(s in _SERVER_ARGS for s in strings) and "streamlit" in strings
                        or any(s.endswith(_SERVER_FILES) for s in strings)
                        or name == "Popen" and _kvviz_app(n)):
                    marks.add("server")
    return marks, refs


def _kvviz_app(call: ast.Call) -> bool:
    """An argument list [<the kvviz command>, "app", ...] without --dry-run or --help."""
    if not call.args or not isinstance(call.args[0], ast.List):
        return False
    items = call.args[0].elts
    consts = [e.value for e in items if isinstance(e, ast.Constant)]
    return (len(items) >= 2 and isinstance(items[1], ast.Constant) and items[1].value == "app"
            and not {"--dry-run", "--help"} & set(consts))


@functools.lru_cache(maxsize=None)
def static_needs(path: str) -> dict[str, set[str]]:
    """{test function name: the markers it reaches} for the test module at `path`."""
    tree = ast.parse(Path(path).read_text(), path)
    apphelp_app = any(isinstance(n, ast.ImportFrom) and n.module == "apphelp"
                      and any(a.name == "app" and a.asname is None for a in n.names)
                      for n in ast.walk(tree))
    defs: dict[str, tuple[set[str], set[str]]] = {}
    params: dict[str, list[str]] = {}
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[n.name] = _direct(n, apphelp_app)
            params[n.name] = [a.arg for a in n.args.args + n.args.kwonlyargs]
        elif isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) for t in n.targets):
            d = _direct(n.value, apphelp_app)
            for t in n.targets:
                defs[t.id] = d

    @functools.lru_cache(maxsize=None)
    def reach(name: str, seen: frozenset = frozenset()) -> frozenset:
        if name not in defs or name in seen:
            return frozenset()
        marks, refs = defs[name]
        out = set(marks)
        for r in refs | set(params.get(name, ())):  # helpers it calls, fixtures it takes
            out |= reach(r, seen | {name})
        return frozenset(out)

    return {name: set(reach(name)) for name in defs if name.startswith("test")}
