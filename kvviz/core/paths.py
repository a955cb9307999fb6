"""Where the shipped things are: the explorer page, the traces, the closed-loop results, the lessons.

One rule for all of them, from a checkout or an install: $KVVIZ_TRACES_DIR if set; else the
current directory's traces/ when the current directory is a kvviz checkout (so a trace captured
there shows up even when an installed `kvviz` runs); else this package's own (the installed
bundle, kvviz/_bundle/ found through importlib.resources, or the checkout beside the package).
What the bundle holds is declared in pyproject.toml ([tool.kvviz] bundle). The page is always
this package's own, so page and library never come from two versions. Every module that needs a
shipped file asks here.
"""
from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path

BUNDLE = Path(str(resources.files("kvviz") / "_bundle"))
REPO = Path(__file__).resolve().parents[2]


def checkout(folder: Path | None = None) -> Path | None:
    """`folder` (default: the current directory) if it is a kvviz checkout: a pyproject.toml
    naming the project kvviz, with app.py and traces/ beside it."""
    folder = Path.cwd() if folder is None else Path(folder)
    try:
        name = tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))["project"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if name == "kvviz" and (folder / "app.py").is_file() and (folder / "traces").is_dir():
        return folder.resolve()
    return None


def app_file() -> Path:
    """The explorer page `kvviz app` serves: always this package's own copy (the bundle in an
    install, app.py beside the package in a checkout), so page and library match."""
    for path in (BUNDLE / "app.py", REPO / "app.py"):
        if path.is_file():
            return path
    raise RuntimeError(f"the explorer's app.py is neither in {BUNDLE} nor in {REPO}; "
                       "reinstall kvviz with `pip install .` from a checkout")


def traces_dir() -> Path | None:
    """$KVVIZ_TRACES_DIR, the current checkout's traces/, the bundle's or the package's checkout's."""
    if os.environ.get("KVVIZ_TRACES_DIR"):
        return Path(os.environ["KVVIZ_TRACES_DIR"])
    here = checkout()
    candidates = ([here / "traces"] if here else []) + [BUNDLE / "traces", REPO / "traces"]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.npz")):
            return path
    return None


def loop_dir() -> Path | None:
    """$KVVIZ_LOOP_DIR, else loop/ in the traces folder chosen above."""
    if os.environ.get("KVVIZ_LOOP_DIR"):
        return Path(os.environ["KVVIZ_LOOP_DIR"])
    traces = traces_dir()
    return traces / "loop" if traces is not None and (traces / "loop").is_dir() else None


def lessons_dir() -> Path | None:
    """$KVVIZ_LESSONS_DIR, the current checkout's lessons/, the bundle's or the package's
    checkout's: the rule of traces_dir, for lessons/*.toml (kvviz.app.teach.lesson)."""
    if os.environ.get("KVVIZ_LESSONS_DIR"):
        return Path(os.environ["KVVIZ_LESSONS_DIR"])
    here = checkout()
    candidates = ([here / "lessons"] if here else []) + [BUNDLE / "lessons", REPO / "lessons"]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.toml")):
            return path
    return None


def lessons_or_default() -> Path:
    """lessons_dir(), or the folder it would be (for a message) when there is none."""
    return lessons_dir() or (BUNDLE / "lessons" if BUNDLE.is_dir() else REPO / "lessons")


def traces_or_default() -> Path:
    """traces_dir(), or the folder it would be (for a message) when there is none."""
    return traces_dir() or (BUNDLE / "traces" if BUNDLE.is_dir() else REPO / "traces")


def loop_or_default() -> Path:
    """`loop_dir()`, else loop/ inside the default traces folder (which may not exist): a
    path to look in even when nothing was found, so a caller lists it as empty instead of
    testing for None."""
    return loop_dir() or traces_or_default() / "loop"


def needle_dir() -> Path:
    """$KVVIZ_NEEDLE_DIR, else needle/ in traces_or_default(): the pass-key results
    (`kvviz needle --out traces/needle`; the folder may not exist)."""
    if os.environ.get("KVVIZ_NEEDLE_DIR"):
        return Path(os.environ["KVVIZ_NEEDLE_DIR"])
    return traces_or_default() / "needle"


def tasks_dir() -> Path:
    """$KVVIZ_TASKS_DIR, else tasks/ in traces_or_default(): the recall, distractors and
    phrase tasks' results (`kvviz needle --task ... --out traces/tasks`), their key-attention
    files (attention/) and answers.json (the folder may not exist)."""
    if os.environ.get("KVVIZ_TASKS_DIR"):
        return Path(os.environ["KVVIZ_TASKS_DIR"])
    return traces_or_default() / "tasks"


def source_file(name: str) -> Path:
    """A shipped source text (traces/sources/NAME): beside the chosen traces, else the
    bundle's, else the checkout's. FileNotFoundError names where it looked."""
    looked = []
    for folder in ([traces_dir()] if traces_dir() else []) + [BUNDLE / "traces", REPO / "traces"]:
        path = folder / "sources" / name
        if path.is_file():
            return path
        looked.append(str(path.parent))
    raise FileNotFoundError(f"shipped source {name} is in none of {', '.join(looked)}")


def trace_file(name: str) -> Path:
    """A shipped trace (NAME.npz, e.g. "prose") in traces_or_default()."""
    return traces_or_default() / (name if name.endswith(".npz") else f"{name}.npz")


def version() -> str:
    """kvviz's version from its one source, pyproject.toml: read from the checkout this package
    sits in, else from the installed package's metadata (built from that same file)."""
    try:
        data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        if data["name"] == "kvviz" and (REPO / "kvviz" / "__init__.py").is_file():
            return data["version"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvviz")
    except PackageNotFoundError:
        return "unknown"
