"""Build hook only (the metadata is in pyproject.toml): an installed kvviz carries the
explorer page (app.py), the shipped traces and the lessons in kvviz/_bundle/, so `kvviz app` works from
anywhere. They are copied at build time; the checkout keeps one copy of each.

SHIPPED is the explicit list (tests/test_install.py checks it against `git ls-files`): a
user's own traces/mine.npz never goes into a wheel. The bundle folder is emptied first,
because setuptools reuses build/ and copying only adds files.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent

# the pass-key grid of README, "The pass-key test": each depth its own ten seeds (30 keys a cell)
DEPTH_SEEDS = ((10, range(0, 10)), (50, range(10, 20)), (90, range(20, 30)))
NEEDLE = (
    "traces/needle/results.csv", "traces/needle/results.json", "traces/needle/predictors.json",
    *(f"traces/needle/runs/L{n}-d{d}-s{s}-{mode}-{gran}.npz" for n, mode, gran in (
        (256, "decode", "layer"), (256, "prefill", "layer"), (512, "prefill", "layer"),
        (512, "prefill", "kv-head")) for d, seeds in DEPTH_SEEDS for s in seeds),
)

# the tasks study (scripts/tasks_study.sh): the files of its grid that exist, nothing else
TASK_RUNS = (
    *(f"recall{k}-L256-d10-s{s}-{mode}-layer" for k, modes in ((20, "DP"), (3, "DP"), (5, "DP"), (10, "P"))
      for s in range(30) for mode in ("decode" if m == "D" else "prefill" for m in modes)),
    *(f"recall{k}-L512-d10-s{s}-prefill-layer" for k in (20, 5) for s in range(30)),
    *(f"recall{k}-L512-d10-s{s}-decode-layer" for k in (20, 1000) for s in range(30)),
    *(f"{task}-L512-d{d}-s{s}-prefill-layer" for task in ("phrase4", "distractors2") for d in (10, 50, 90)
      for s in range(30)),
    *(f"{task}-L2048-d{d}-s{s}-prefill-layer" for task, d in (("phrase4", 50), ("recall5", 10)) for s in range(30)),
)
TASKS = tuple(p for p in ("traces/tasks/results.csv", "traces/tasks/answers.json", "traces/tasks/summary.csv",
                          *(f"traces/tasks/runs/{i}.npz" for i in TASK_RUNS),
                          *(f"traces/tasks/attention/{i}.npz" for i in TASK_RUNS))
              if (ROOT / p).is_file())
SHIPPED = (
    "app.py",
    "lessons/tova-vs-snapkv.toml",
    "traces/README.md",
    "traces/code-kv.npz",
    "traces/code.npz",
    "traces/prose.npz",
    "traces/table.npz",
    "traces/toy.npz",
    *(f"traces/loop/{text}-{gran}.{ext}" for text in ("code", "prose", "table")
      for gran in ("kv-head", "layer") for ext in ("json", "npz")),
    "traces/sources/PSF-LICENSE.txt",
    "traces/sources/elements.md",
    "traces/sources/execmodel.txt",
    "traces/sources/graphlib.py.txt",
    "traces/sources/make_table.py",
    *(NEEDLE if (ROOT / "traces/needle/results.csv").is_file() else ()),
    *(f"traces/alloc/{name}.json" for name in ("kvpress", "kvpress_compare", "loop", "summary")),
    *(f"traces/alloc/needle/L512-d{d}-s{s}.json" for d in (10, 50, 90) for s in range(4)),
    *TASKS,
)


class BuildWithBundle(build_py):
    def run(self):
        super().run()
        bundle = Path(self.build_lib) / "kvviz" / "_bundle"
        shutil.rmtree(bundle, ignore_errors=True)
        for name in SHIPPED:
            target = bundle / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target)


setup(cmdclass={"build_py": BuildWithBundle})
