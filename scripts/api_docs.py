"""Build the API reference from the docstrings with pdoc: `python scripts/api_docs.py [OUT]`.

Every package of kvviz is passed to pdoc by name (a package that declares `__all__` would
otherwise hide its submodules), and any warning pdoc raises (a docstring link it cannot
resolve, an annotation it cannot read) fails the build, so the reference never ships with
a broken page. The pages go to OUT (default out/api), which is git-ignored.
"""
from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _declares_all(init: Path) -> bool:
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
               for n in ast.parse(init.read_text(encoding="utf-8")).body)


def modules() -> list[str]:
    """kvviz, plus each module pdoc would not reach by walking from it: pdoc follows a
    package's submodules unless the package declares `__all__`, so those are named here.
    Found from the tree, so nothing is kept in step by hand."""
    pkg = ROOT / "kvviz"
    names = []
    for path in sorted(pkg.rglob("*.py")):
        if "_bundle" in path.parts or path.name == "__main__.py" or path == pkg / "__init__.py":
            continue
        parent = path.parent if path.name != "__init__.py" else path.parent.parent
        if _declares_all(parent / "__init__.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return ["kvviz", *names]


def build(out: Path) -> list[Path]:
    """Write the reference to `out`; raise on any warning. Returns the pages written."""
    sys.path.insert(0, str(ROOT))
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="markdown", search=True,
                          footer_text="kvviz API reference, built from the docstrings")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pdoc.pdoc(*modules(), output_directory=Path(out))
    return sorted(Path(out).rglob("*.html"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "out" / "api"
    pages = build(out)
    print(f"{len(pages)} pages in {out}")
