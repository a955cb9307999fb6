"""`kvviz check`, `kvviz bench` and `kvviz perf` where numpy is the only dependency installed.

Each command runs in a fresh interpreter whose import system refuses every package that is
neither the standard library, numpy nor kvviz itself, the way a missing package does: an
import of pandas, Streamlit, Plotly, torch, transformers, Ray or pyarrow (or any other
dependency) anywhere on the command's path fails the test, although all are installed here.
"""
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import kvviz
from kvviz.core.trace import canonical
from kvviz.studies.table import Table

ROOT = Path(__file__).resolve().parents[1]  # `-c` puts the working folder first on sys.path
HEAVY = ("pandas", "streamlit", "plotly", "torch", "transformers", "ray", "pyarrow")

# Installed before anything of kvviz loads; judges by top-level package name. What the
# interpreter's own start-up loaded is not kvviz's doing and is let be (Debian's python3
# imports the `sitecustomize` its libpython package ships); but a dependency that start-up
# already loaded (a site .pth file could do that) would slip past the finder, so that counts
# as a failure of the setup, not a pass.
GUARD = """
import sys
ALLOWED = set(sys.stdlib_module_names) | set(sys.argv[1].split(","))
DEPENDENCIES = set(sys.argv[2].split(","))
def refused(name):
    top = name.partition(".")[0]
    return top not in ALLOWED and not top.startswith("_")
early = sorted({m.partition(".")[0] for m in sys.modules if refused(m)} & DEPENDENCIES)
if early:
    sys.exit(f"guard: already imported before the guard: {early}")
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if refused(name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
"""
RUN_KVVIZ = """
import runpy
sys.argv = ["kvviz", *sys.argv[3:]]
runpy.run_module("kvviz", run_name="__main__", alter_sys=True)
"""
BENCH_COLUMNS = ["policy", "budget", "granularity", "retained_mass", "attention_loss", "hh_recall",
                 "memory_bytes", "evicts", "params"]


def numpy_only(*args, code=RUN_KVVIZ):
    return subprocess.run([sys.executable, "-c", GUARD + code, "numpy,kvviz", ",".join(REFUSED), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


REFUSED = HEAVY + ("hypothesis", "tqdm", "PIL", "orjson", "redis", "gguf", "accelerate", "safetensors")


@pytest.mark.parametrize("name", REFUSED)
def test_the_guard_refuses_every_other_package(name):
    out = numpy_only(code=f"import {name}")
    assert out.returncode != 0
    assert f"ModuleNotFoundError: No module named '{name}'" in out.stderr


def test_the_guard_lets_numpy_and_the_standard_library_through():
    out = numpy_only(code="import json, csv, numpy; print('numpy', numpy.__version__)")
    assert out.returncode == 0 and out.stdout.startswith("numpy"), out.stderr


def test_the_guard_lets_be_what_the_interpreter_start_up_loaded():
    # Debian's python3 imports its `sitecustomize` before any command runs: a module loaded
    # ahead of the guard that is no dependency of anything is not kvviz's import
    pre = "import sys, types; sys.modules['sitecustomize'] = types.ModuleType('sitecustomize')\n"
    out = subprocess.run([sys.executable, "-c", pre + GUARD + "print('ran')", "numpy,kvviz", ",".join(REFUSED)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ran", out.stderr


def test_the_guard_fails_when_a_dependency_was_loaded_before_it():
    pre = "import sys, types; sys.modules['pandas'] = types.ModuleType('pandas')\n"
    out = subprocess.run([sys.executable, "-c", pre + GUARD + "print('ran')", "numpy,kvviz", ",".join(REFUSED)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode != 0 and "already imported before the guard: ['pandas']" in out.stderr


def test_check_one_builtin():
    out = numpy_only("check", "tova")
    assert out.returncode == 0, out.stderr
    assert "tova (kvviz.core.policies.tova.Tova): PASS" in out.stdout
    assert "FAIL" not in out.stdout


def test_check_all_builtins(long_run):
    out = numpy_only("check", "--all-builtins")
    assert out.returncode == 0, out.stderr
    verdicts = [ln for ln in out.stdout.splitlines() if not ln.startswith(" ")]
    assert len(verdicts) >= 6 and all(ln.endswith(": PASS") for ln in verdicts), verdicts
    for name in ("tova", "snapkv", "h2o", "streaming-llm", "scissorhands", "random"):
        assert any(ln.startswith(f"{name} (") for ln in verdicts), name


def test_check_reference_without_hypothesis_says_what_to_install():
    out = numpy_only("check", "tova",
                     "--reference", "kvviz.core.reference:RefTova", "--examples", "5")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: --reference needs hypothesis, which is not installed: pip install 'kvviz[check]' "
        "(it draws its scenarios with Hypothesis)"]
    assert "PASS" not in out.stdout  # refused before any rule ran


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    where = tmp_path_factory.mktemp("bench")
    out = numpy_only("bench", "--budgets", "256", "--policies", "tova,snapkv",
                     "--csv", str(where / "t.csv"), "--json", str(where / "t.json"))
    return out, where


def test_bench_prints_the_table(bench):
    out, _ = bench
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "trace: canonical (4096 steps), head mean"
    assert lines[1].split() == BENCH_COLUMNS
    rows = [ln.split() for ln in lines[2:]]
    assert [r[:2] for r in rows] == [["tova", "256"], ["snapkv", "256"]]
    for r in rows:
        assert r[2] == "mean"  # one stream, the heads' mean
        assert all(len(v.partition(".")[2]) == 4 for v in r[3:6])  # four decimals, as before
        assert r[7] == "True"


def test_bench_files_hold_what_evaluate_computes(bench):
    """The CSV and JSON against the metrics computed here, in this process, by the library
    call the docs point to: the same columns in order, the same numbers to the last bit."""
    out, where = bench
    assert out.returncode == 0, out.stderr
    trace = canonical()
    expected = []
    for name in ("tova", "snapkv"):
        row = kvviz.evaluate(trace, name, 256)
        expected.append({"policy": row["policy"], "budget": row["budget"], "granularity": "mean",
                         **{k: row[k] for k in BENCH_COLUMNS[3:7]}, "evicts": 256 < trace.steps,
                         "params": ", ".join(f"{k}={v}" for k, v in row["params"].items())})

    with open(where / "t.csv", newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header, *lines = list(reader)
    assert header == BENCH_COLUMNS
    assert len(lines) == len(expected)
    for line, want in zip(lines, expected):
        got = dict(zip(header, line))
        assert got["policy"] == want["policy"] and int(got["budget"]) == want["budget"]
        for k in ("retained_mass", "attention_loss", "hh_recall"):
            assert float(got[k]) == want[k], k
        assert int(got["memory_bytes"]) == want["memory_bytes"]
        assert got["evicts"] == str(want["evicts"]) and got["params"] == want["params"]

    records = json.loads((where / "t.json").read_text(encoding="utf-8"))
    assert [list(r) for r in records] == [BENCH_COLUMNS] * len(expected)
    assert records == expected


def test_perf_prints_the_speed_table():
    out = numpy_only("perf", "--long-steps", "0", "--steps", "256")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("canonical trace, 256 steps, budget 512")
    assert lines[1].split() == ["policy", "fast_cpu_s", "reference_cpu_s", "speedup"]
    rows = [ln.split() for ln in lines[2:]]
    assert {"tova", "snapkv", "h2o"} <= {r[0] for r in rows}
    assert all(len(r) == 4 and float(r[1]) >= 0 for r in rows)


def test_perf_streams_prints_its_rows():
    out = numpy_only("perf", "--streams", "1,2", "--steps", "256")
    assert out.returncode == 0, out.stderr
    ways = [ln.split()[1] for ln in out.stdout.splitlines()[1:]]
    assert {"lean", "Replay", "run_streams"} <= set(ways)
    assert "DIFFERENT" not in out.stdout


def test_table_spells_missing_numbers_per_format(tmp_path):
    """NaN (a plugin without a reference in `perf`) prints as NaN, is an empty CSV field and
    JSON null; numpy scalars are written as plain numbers; to_frame gives pandas the rows."""
    import numpy as np

    table = Table([{"policy": "a", "fast": np.float64(0.5), "ref": math.nan, "n": np.int64(3)},
                   {"policy": "bb", "fast": 0.25, "ref": 1.0, "n": 4}])
    assert table.to_string(float_format=lambda v: f"{v:.2f}").splitlines() == [
        "policy  fast   ref  n",
        "     a  0.50   NaN  3",
        "    bb  0.25  1.00  4"]
    table.to_csv(tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_text() == "policy,fast,ref,n\na,0.5,,3\nbb,0.25,1.0,4\n"
    table.to_json(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == [
        {"policy": "a", "fast": 0.5, "ref": None, "n": 3},
        {"policy": "bb", "fast": 0.25, "ref": 1.0, "n": 4}]
    frame = table.to_frame()
    assert list(frame.columns) == ["policy", "fast", "ref", "n"] and frame["n"].tolist() == [3, 4]
