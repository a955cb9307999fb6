"""Build hook only (the metadata is in pyproject.toml): an installed kvviz carries the
explorer page (app.py) and the shipped traces in kvviz/_bundle/, so `kvviz app` works from
anywhere. They are copied at build time; the checkout keeps one copy of each."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithBundle(build_py):
    def run(self):
        super().run()
        bundle = Path(self.build_lib) / "kvviz" / "_bundle"
        bundle.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "app.py", bundle / "app.py")
        # the whole folder: traces, their README and sources/ with the licences they require
        shutil.copytree(ROOT / "traces", bundle / "traces", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.tmp", "__pycache__"))


setup(cmdclass={"build_py": BuildWithBundle})
