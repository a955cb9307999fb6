"""`pip install .` gives a working `kvviz` command outside the checkout.

Offline and quick: a wheel is built from a copy of the checkout (with this environment's
setuptools, --no-build-isolation) and installed into a fresh venv that sees this test
environment's packages through a .pth file (so --no-deps and no index). Everything then runs
from a temporary directory with no PYTHONPATH, so only the installed copy can be imported.
The copy also holds a user's own trace and a stale file in a reused build/: neither may ship.
A second venv holds the bare wheel with numpy and tqdm alone (what `pip install kvviz` gives):
the core runs there, and each other part refuses in one line naming its extra.
"""
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from kvviz.core.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, cwd, env, timeout=180):
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def installed(tmp_path_factory, long_run):
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "app.py"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvviz", src / "kvviz", ignore=shutil.ignore_patterns("__pycache__", "_bundle"))
    shutil.copytree(ROOT / "traces", src / "traces")
    shutil.copytree(ROOT / "lessons", src / "lessons")
    (src / "traces" / "mine.npz").write_bytes(b"a user's own capture")  # not tracked
    stale = src / "build" / "lib" / "kvviz" / "_bundle" / "traces" / "old.npz"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"left by an earlier build")  # setuptools reuses build/
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "outer.pth").write_text("\n".join(sorted(outer)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    dist = tmp / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(dist), str(src)], cwd=tmp, env=env)
    wheel = next(dist.glob("kvviz-*.whl"))
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
         "--no-deps", "--no-index", str(wheel)], cwd=tmp, env=env)
    work = tmp / "elsewhere"
    work.mkdir()
    return venv, work, env, wheel


def tracked(*paths) -> list[str]:
    res = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, f"tests run from a git checkout: {res.stderr}"
    return sorted(res.stdout.split())


def shipped(files: list[str]) -> list[str]:
    """Of the tracked files under app.py, lessons/ and traces/, those a user's installed page
    reads: the studies' run files and haystacks stay in the checkout (lab/ runs them), their
    answers (which the lesson quotes) ship."""
    def stays(name: str) -> bool:
        return name.startswith("traces/haystacks/") or (
            name.startswith("traces/studies/") and not name.endswith("/answers.json"))
    return [f for f in files if not stays(f)]


def test_wheel_ships_the_tracked_page_traces_and_lessons_only(installed):
    wheel = installed[3]
    with zipfile.ZipFile(wheel) as zf:
        bundled = sorted(n.removeprefix("kvviz/_bundle/") for n in zf.namelist()
                         if n.startswith("kvviz/_bundle/"))
        assert zf.read("kvviz/_bundle/app.py") == (ROOT / "app.py").read_bytes()
    assert bundled == shipped(tracked("app.py", "lessons", "traces"))  # so no mine.npz, no stale old.npz
    assert "traces/studies/recall/answers.json" in bundled
    assert "lessons/tova-vs-snapkv.toml" in bundled
    assert "traces/mine.npz" not in bundled and "traces/old.npz" not in bundled


def setup_module_of(root: Path, monkeypatch) -> dict:
    """setup.py's names, read without building: a stand-in setuptools whose setup() does nothing."""
    import runpy
    import types

    stub = types.ModuleType("setuptools")
    stub.setup = lambda **kw: None
    build_py = types.ModuleType("setuptools.command.build_py")
    build_py.build_py = type("build_py", (), {})
    for name, mod in (("setuptools", stub), ("setuptools.command", types.ModuleType("setuptools.command")),
                      ("setuptools.command.build_py", build_py)):
        monkeypatch.setitem(sys.modules, name, mod)
    return runpy.run_path(str(root / "setup.py"))


def test_in_a_git_checkout_only_tracked_files_ship(tmp_path, monkeypatch):
    """The bundle's globs (pyproject.toml) select; in a git checkout, of what they select only
    the tracked files ship: a user's extra pass-key run in traces/needle/runs/ stays out."""
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy2(ROOT / name, tmp_path / name)
    files = ("app.py", "lessons/a.toml", "traces/code.npz", "traces/mine.npz", "traces/needle/runs/L1.npz",
             "traces/needle/runs/mine.npz", "traces/notes.txt")
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    bundle_files = setup_module_of(tmp_path, monkeypatch)["bundle_files"]
    assert bundle_files(tmp_path) == ["app.py", "lessons/a.toml", "traces/code.npz", "traces/needle/runs/L1.npz",
                                      "traces/needle/runs/mine.npz"]  # no git: the globs alone
    git = ["git", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-f", "app.py", "lessons/a.toml", "traces/code.npz", "traces/needle/runs/L1.npz",
                    "traces/notes.txt"], check=True)
    assert bundle_files(tmp_path) == ["app.py", "lessons/a.toml", "traces/code.npz", "traces/needle/runs/L1.npz"]
    assert setup_module_of(ROOT, monkeypatch)["bundle_files"]() == shipped(tracked("app.py", "lessons", "traces"))


def test_kvviz_help_and_bench_from_outside_the_checkout(installed):
    venv, work, env, _ = installed
    kvviz = venv / "bin" / "kvviz"
    where = run([venv / "bin" / "python", "-c", "import kvviz; print(kvviz.__file__)"], work, env)
    assert where.stdout.strip().startswith(str(venv))  # the installed copy, not the checkout
    helped = run([kvviz, "--help"], work, env)
    for command in ("bench", "perf", "capture", "app"):
        assert command in helped.stdout
    bench = run([kvviz, "bench", "--budgets", "64", "--policies", "tova"], work, env)
    assert "trace: canonical (4096 steps), head mean" in bench.stdout
    lines = [ln.split() for ln in bench.stdout.splitlines()]
    row = next(ln for ln in lines if ln[:2] == ["tova", "64"])
    assert row[2] == "mean" and 0 < float(row[3]) < 1  # retained mass of a real eviction run
    assert list(work.iterdir()) == []  # wrote nothing where it ran
    shipped = run([kvviz, "bench", "--trace", "code-kv.npz", "--layer", "29", "--head", "kv1",
                   "--budgets", "64", "--policies", "tova"], work, env)
    assert "trace: code-kv (512 steps), model layer 29 of stored 0, 14, 29, head kv1" in shipped.stdout


def test_kvviz_app_serves_the_installed_page_and_traces(installed, server):
    venv, work, env, _ = installed
    kvviz = venv / "bin" / "kvviz"
    dry = run([kvviz, "app", "--dry-run", "--server.port=8765"], work, env)  # a dry run binds nothing
    bundle = venv / "lib"
    app_line, traces_line, loop_line = dry.stdout.strip().splitlines()
    app = Path(app_line.split(" run ")[1].split()[0])
    assert app.is_relative_to(bundle) and app.read_bytes() == (ROOT / "app.py").read_bytes()
    assert "--server.address=127.0.0.1" in app_line and "--browser.gatherUsageStats=false" in app_line
    assert app_line.count("server.port") == 1 and "--server.port=8765" in app_line
    traces = Path(traces_line.removeprefix("traces: "))
    assert traces.is_relative_to(bundle)
    shipped = sorted(p.name for p in (ROOT / "traces").glob("*.npz"))
    assert shipped and sorted(p.name for p in traces.glob("*.npz")) == shipped
    assert (traces / "README.md").is_file() and (traces / "sources" / "PSF-LICENSE.txt").is_file()
    assert loop_line == f"loop results: {traces / 'loop'}"
    import measure_latency as M  # on sys.path through the `server` fixture

    # port 0: the operating system picks a free port as the server binds; its URL line says which
    proc = subprocess.Popen([kvviz, "app", "--server.port=0"], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = M.Output(proc)
    try:
        port = out.wait_port(timeout=120)
        deadline, health = time.time() + 45, ""
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    health = r.read().decode()
                    break
            except OSError:
                time.sleep(0.3)  # the URL line comes as the server binds; health soon after
        assert health == "ok", out.text() if proc.poll() is not None else "no answer"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_installed_kvviz_app_in_a_checkout_serves_its_traces(installed):
    """The rule `kvviz app --help` states: inside a kvviz checkout, its traces/ (and the
    user's own capture in it); the page stays the installed one."""
    venv, work, env, _ = installed
    checkout = work.parent / "src"  # the copy the wheel was built from, with traces/mine.npz
    helped = run([venv / "bin" / "kvviz", "app", "--help"], checkout, env)
    assert "./traces when the current directory is a kvviz checkout" in " ".join(helped.stdout.split())
    app_line, traces_line, loop_line = run([venv / "bin" / "kvviz", "app", "--dry-run"],
                                           checkout, env).stdout.strip().splitlines()
    assert traces_line == f"traces: {checkout.resolve() / 'traces'}"
    assert (checkout / "traces" / "mine.npz").is_file()
    assert loop_line == f"loop results: {checkout.resolve() / 'traces' / 'loop'}"
    assert Path(app_line.split(" run ")[1].split()[0]).is_relative_to(venv / "lib")
    inner = checkout / "kvviz"  # a sub-folder of a checkout is not the checkout
    elsewhere = run([venv / "bin" / "kvviz", "app", "--dry-run"], inner, env).stdout.splitlines()[1]
    assert Path(elsewhere.removeprefix("traces: ")).is_relative_to(venv / "lib")


def test_installed_kvviz_finds_and_checks_the_bundled_lesson(installed):
    """From outside the checkout: lessons/ comes from the bundle (kvviz.core.paths.lessons_dir),
    and `kvviz lesson check` computes every note against the bundled traces and results."""
    venv, work, env, _ = installed
    kvviz = venv / "bin" / "kvviz"
    where = run([venv / "bin" / "python", "-c", "from kvviz.core.paths import lessons_dir; "
                 "print(lessons_dir())"], work, env).stdout.strip()
    assert Path(where).is_relative_to(venv / "lib") and Path(where).name == "lessons"
    listed = run([kvviz, "lesson", "list"], work, env).stdout
    assert listed.startswith("tova-vs-snapkv · ") and "TOVA against SnapKV" in listed
    checked = run([kvviz, "lesson", "check", "tova-vs-snapkv"], work, env).stdout
    assert checked.strip().splitlines()[-1].endswith("50 min: ok")
    assert list(work.iterdir()) == []


def test_installed_loop_view_lists_shipped_results_and_perf_runs(installed, torch_stack):
    """From outside the checkout: the loop view finds the bundled results, the version is
    pyproject's, and `kvviz loop --perf` finds its shipped text (a tiny run)."""
    import tomllib

    venv, work, env, _ = installed
    code = ("import kvviz\nfrom kvviz.app.ui.view_loop import shipped\n"
            "print(kvviz.__version__)\nprint('\\n'.join(str(p) for p in shipped()))")
    lines = run([venv / "bin" / "python", "-c", code], work, env).stdout.split()
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert lines[0] == want
    listed = [Path(x) for x in lines[1:]]
    assert sorted(p.name for p in listed) == sorted(p.name for p in (ROOT / "traces" / "loop").glob("*.npz"))
    assert listed and all(p.is_relative_to(venv / "lib") for p in listed)
    perf = run([venv / "bin" / "kvviz", "loop", "--perf", "--perf-tokens", "50", "--budget", "33"],
               work, dict(env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), timeout=900)
    assert "perf: 50 tokens of execmodel.txt, budget 33" in perf.stdout
    assert list(work.iterdir()) == []


def test_installed_check_reference_runs_with_the_check_extra(installed, tmp_path):
    """The README's `kvviz check ... --reference ...` from the installed copy, where the
    `check` extra (Hypothesis) is installed: the differential check runs and passes."""
    venv, work, env, wheel = installed
    requires = wheel_requires(wheel)
    assert [r for r in requires if r.lower().startswith("hypothesis")] == ['hypothesis<7,>=6.170; extra == "check"']
    plugin = tmp_path / "decay_sinks.py"
    shutil.copy2(ROOT / "examples" / "plugins" / "decay_sinks.py", plugin)
    res = run([venv / "bin" / "kvviz", "check", str(plugin), "--reference", f"{plugin}:RefDecaySinks",
               "--examples", "20"], work, dict(env, OMP_NUM_THREADS="1"))
    first = res.stdout.splitlines()[0]
    assert first.startswith(f"{plugin}:DecaySinks (") and first.endswith(": PASS"), res.stdout
    assert any("reference" in ln for ln in res.stdout.splitlines()[1:]) and "FAIL" not in res.stdout
    assert list(work.iterdir()) == []


def wheel_requires(wheel) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return [ln.removeprefix("Requires-Dist: ") for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]


def test_the_wheel_requires_numpy_and_tqdm_and_the_rest_by_extra(installed):
    core = [r for r in wheel_requires(installed[3]) if "extra ==" not in r]
    assert sorted(r.split("<")[0].split(">")[0] for r in core) == ["numpy", "tqdm"], core


@pytest.fixture(scope="module")
def bare(installed):
    """A fresh venv (with pip) holding the built wheel and, of everything else, numpy and
    tqdm: this environment's own copies, linked in with their metadata so `pip check` can
    judge the wheel's requirements (offline: no index, nothing downloaded)."""
    wheel, env = installed[3], installed[2]
    venv = installed[0].parent / "bare"
    run([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent, env=env)
    site = next(venv.glob("lib/python3*/site-packages"))
    for name in ("numpy", "tqdm"):
        dist = md.distribution(name)
        for top in sorted({Path(f).parts[0] for f in dist.files if not str(f).startswith("..")}):
            (site / top).symlink_to(dist.locate_file(top))
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)],
        venv.parent, env)
    work = venv.parent / "bare-work"
    work.mkdir()
    return venv, work, env


def fails(cmd, cwd, env) -> list[str]:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0, f"{cmd} ran: {res.stdout}"
    return res.stderr.strip().splitlines()


@pytest.mark.slow
def test_the_bare_wheel_runs_the_core_and_names_the_extras(bare):
    venv, work, env = bare
    py, kvviz = venv / "bin" / "python", venv / "bin" / "kvviz"
    # numpy and tqdm alone satisfy the wheel's requirements; nothing of an extra is there
    assert "No broken requirements found" in run([py, "-m", "pip", "check"], work, env).stdout
    absent = run([py, "-c", "import importlib.util as u, sys; "
                  "print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))", *EXTRAS], work, env)
    assert absent.stdout.split() == []
    loaded = run([py, "-c", "import sys; before = set(sys.modules); import kvviz; print(kvviz.__file__); "
                  "print(*sorted({m.partition('.')[0] for m in set(sys.modules) - before} "
                  "- set(sys.stdlib_module_names)))"], work, env).stdout.splitlines()
    assert loaded[0].startswith(str(venv)) and loaded[1].split() == ["kvviz", "numpy"]

    bench = run([kvviz, "bench", "--budgets", "64", "--policies", "tova"], work, env)
    assert "trace: canonical (4096 steps), head mean" in bench.stdout
    row = next(ln.split() for ln in bench.stdout.splitlines() if ln.split()[:2] == ["tova", "64"])
    assert row[2] == "mean" and 0 < float(row[3]) < 1
    shipped = run([kvviz, "bench", "--trace", "code-kv.npz", "--budgets", "64", "--policies", "tova"], work, env)
    assert shipped.stdout.startswith("trace: code-kv (512 steps)")  # a trace from the package's data
    checked = run([kvviz, "check", "tova"], work, env).stdout.splitlines()
    assert checked[0] == "tova (kvviz.core.policies.tova.Tova): PASS" and "FAIL" not in "".join(checked)

    for module, extra in (("kvviz.app", "app"), ("kvviz.hf", "model")):
        err = fails([py, "-c", f"import {module}"], work, env)
        named = [ln for ln in err if f"kvviz[{extra}]" in ln]
        assert named == [err[-1]] and err[-1].startswith(f"kvviz.core.extras.MissingExtra: {module} needs "), err
    assert fails([kvviz, "app"], work, env) == [
        "kvviz app needs streamlit, plotly, pandas, pillow, which are not installed: pip install 'kvviz[app]'"]
    assert fails([kvviz, "check", "tova", "--reference", "kvviz.core.reference:RefTova"], work, env) == [
        "error: --reference needs hypothesis, which is not installed: pip install 'kvviz[check]' "
        "(it draws its scenarios with Hypothesis)"]
    assert fails([kvviz, "sweep", "--bench"], work, env) == [
        "kvviz sweep needs pandas, which is not installed: pip install 'kvviz[scale]'"]
    assert list(work.iterdir()) == []
