"""`pip install .` gives a working `kvviz` command outside the checkout.

Offline and quick: the package is built from a copy of the checkout into a fresh venv that
sees this test environment's packages through a .pth file (so --no-deps and no index), with
this environment's setuptools (--no-build-isolation). Everything then runs from a temporary
directory with no PYTHONPATH, so only the installed copy can be imported.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PORT = 8663  # the "heads" helper's port range (8661-8669)


def run(cmd, cwd, env, timeout=180):
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "app.py"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvviz", src / "kvviz", ignore=shutil.ignore_patterns("__pycache__", "_bundle"))
    shutil.copytree(ROOT / "traces", src / "traces")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "outer.pth").write_text("\n".join(sorted(outer)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
         "--no-deps", "--no-build-isolation", "--no-index", str(src)], cwd=tmp, env=env)
    work = tmp / "elsewhere"
    work.mkdir()
    return venv, work, env


def test_kvviz_help_and_bench_from_outside_the_checkout(installed):
    venv, work, env = installed
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
    assert 0 < float(row[2]) < 1  # retained mass of a real eviction run
    assert list(work.iterdir()) == []  # wrote nothing where it ran
    shipped = run([kvviz, "bench", "--trace", "code-kv.npz", "--layer", "29", "--head", "kv1",
                   "--budgets", "64", "--policies", "tova"], work, env)
    assert "trace: code-kv (512 steps), model layer 29 of stored 0, 14, 29, head kv1" in shipped.stdout


def test_kvviz_app_serves_the_installed_page_and_traces(installed):
    venv, work, env = installed
    kvviz = venv / "bin" / "kvviz"
    dry = run([kvviz, "app", "--dry-run", f"--server.port={PORT}"], work, env)
    bundle = venv / "lib"
    app_line, traces_line = dry.stdout.strip().splitlines()
    app = Path(app_line.split(" run ")[1].split()[0])
    assert app.is_relative_to(bundle) and app.read_bytes() == (ROOT / "app.py").read_bytes()
    assert "--server.address=127.0.0.1" in app_line and "--browser.gatherUsageStats=false" in app_line
    assert app_line.count("server.port") == 1 and f"--server.port={PORT}" in app_line
    traces = Path(traces_line.removeprefix("traces: "))
    assert traces.is_relative_to(bundle)
    shipped = sorted(p.name for p in (ROOT / "traces").glob("*.npz"))
    assert shipped and sorted(p.name for p in traces.glob("*.npz")) == shipped
    assert (traces / "README.md").is_file() and (traces / "sources" / "PSF-LICENSE.txt").is_file()
    server = subprocess.Popen([kvviz, "app", f"--server.port={PORT}"], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, health = time.time() + 45, ""
        while time.time() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/_stcore/health", timeout=2) as r:
                    health = r.read().decode()
                    break
            except OSError:
                time.sleep(0.3)
        assert health == "ok", server.stdout.read().decode() if server.poll() is not None else "no answer"
    finally:
        server.terminate()
        server.wait(timeout=20)
