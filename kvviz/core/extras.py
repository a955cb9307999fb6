"""The optional parts of kvviz and the one line that names the extra a missing part needs.

`pip install kvviz` gives the core (numpy and tqdm). The rest comes with an extra
(pyproject.toml, [project.optional-dependencies]): `model` (torch, transformers and the
model files' readers), `app` (Streamlit and the figures), `class` (the lecture hall's
Redis store), `check` (Hypothesis, for `kvviz check --reference`), `scale` (Ray,
pyarrow and pandas, for sweeps and exports) and `notebook` (anywidget and the app's figures,
for the step-by-step view in Jupyter: kvviz.app.notebook). A part that needs one says so where it is
imported, with `require`; the command line turns any such failure into that one line.
"""
from __future__ import annotations

import importlib.util

# top-level module -> the extra that installs it (tests/test_extras.py checks each against
# pyproject.toml); the first place to look when an import fails for lack of a package
EXTRAS = {
    "torch": "model", "transformers": "model", "gguf": "model", "accelerate": "model", "safetensors": "model",
    "streamlit": "app", "plotly": "app", "PIL": "app", "orjson": "app", "starlette": "app",
    "redis": "class",
    "hypothesis": "check",
    "ray": "scale", "pyarrow": "scale", "pandas": "scale",
    "anywidget": "notebook", "traitlets": "notebook",
}


DISTRIBUTIONS = {"PIL": "pillow"}  # where the name pip installs differs from the module's


def line(what: str, modules, extra: str) -> str:
    """"WHAT needs A, B, which are not installed: pip install 'kvviz[EXTRA]'"."""
    names = [DISTRIBUTIONS.get(m, m) for m in modules]
    verb = "is" if len(names) == 1 else "are"
    return f"{what} needs {', '.join(names)}, which {verb} not installed: pip install 'kvviz[{extra}]'"


class MissingExtra(ModuleNotFoundError):
    """A part of kvviz imported without the extra that installs what it needs: the message
    is one line ending in the command that installs it."""

    def __init__(self, what: str, modules, extra: str):
        self.modules, self.extra = list(modules), extra
        super().__init__(line(what, self.modules, extra), name=self.modules[0])


def missing(*modules: str) -> list[str]:
    """Those of `modules` that cannot be imported here (looked up, not imported)."""
    gone = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # an import hook refusing it, or a None in sys.modules
            found = False
        if not found:
            gone.append(module)
    return gone


def require(what: str, extra: str, *modules: str) -> None:
    """MissingExtra naming `extra` unless every one of `modules` can be imported; `what` is the
    part asking ("kvviz.app", "kvviz check --reference")."""
    if extra not in set(EXTRAS.values()):
        raise ValueError(f"extra must be one of {sorted(set(EXTRAS.values()))}, got {extra!r}")
    gone = missing(*modules)
    if gone:
        raise MissingExtra(what, gone, extra)


def refusal(exc: BaseException, what: str) -> str | None:
    """The one line saying that `what` ("kvviz sweep") needs an extra, when `exc` is an import
    that failed for lack of it (a MissingExtra, or a package of EXTRAS not installed); None for
    any other error."""
    if isinstance(exc, MissingExtra):
        return line(what, exc.modules, exc.extra)
    if not isinstance(exc, ModuleNotFoundError):
        return None
    top = (exc.name or "").partition(".")[0]
    return line(what, [top], EXTRAS[top]) if top in EXTRAS else None
