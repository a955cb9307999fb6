"""Build hook only (the metadata is in pyproject.toml): an installed kvviz carries the
explorer page (app.py), the shipped traces, the study results the app's views read and the
lessons in kvviz/_bundle/, so `kvviz app`, `kvviz lesson` and the views work from anywhere
(kvviz/core/paths.py reads them through importlib.resources). They are copied at build time;
the checkout keeps one copy of each.

What ships is declared in pyproject.toml, [tool.kvviz] bundle: globs relative to the
checkout, nothing computed here. In a git checkout only the tracked files they match ship, so
a user's own capture (traces/mine.npz) or an extra pass-key run in traces/needle/runs/ never
goes into a wheel; in a copy without git the globs alone decide (they name the canonical
traces one by one for that). The bundle folder is emptied first, because setuptools reuses
build/ and copying only adds files.
"""
import shutil
import subprocess
import tomllib
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def tracked(root: Path) -> set[str] | None:
    """The files git tracks in `root` when `root` is a git checkout's top, else None."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, check=True).stdout.strip()
        if Path(top).resolve() != root.resolve():
            return None
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(filter(None, listed.split("\0")))


def bundle_files(root: Path = ROOT) -> list[str]:
    """The files pyproject.toml's [tool.kvviz] bundle globs match in `root` (tracked ones
    only in a git checkout), as sorted paths relative to it."""
    globs = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["kvviz"]["bundle"]
    found = {p.relative_to(root).as_posix() for g in globs for p in root.glob(g) if p.is_file()}
    known = tracked(root)
    return sorted(found if known is None else found & known)


class BuildWithBundle(build_py):
    def run(self):
        super().run()
        bundle = Path(self.build_lib) / "kvviz" / "_bundle"
        shutil.rmtree(bundle, ignore_errors=True)
        for name in bundle_files():
            target = bundle / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target)


setup(cmdclass={"build_py": BuildWithBundle})
