"""Sweeps: every engine gives the same table, a killed sweep resumes to the same table,
a bad spec is refused before any cell runs, a failing cell is recorded and the rest run."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sweephelp import kill_after_cells

from kvviz.core.metrics import evaluate
from kvviz.core.trace import canonical, load_trace, pack_rows, save_trace
from kvviz.studies.sweep.run import run_sweep
from kvviz.studies.sweep.spec import SpecError
from kvviz.studies.sweep.store import SweepDirError

ROOT = Path(__file__).resolve().parents[1]
T = 512
LAYERS = [3, 7]
# 2 traces x 2 layers x 4 policy configurations x 2 budgets = 32 cells; the second trace
# is broken inside (a negative weight) but its header is fine, so the spec is valid and
# its 16 cells fail when they load it.
SPEC = """
traces = ["good.npz", "broken.npz"]
layers = [3, 7]
budgets = [40, 96]

[[policies]]
name = "tova"

[[policies]]
name = "snapkv"
pool_kernel = [1, 3]
obs_window = 8

[[policies]]
name = "h2o"
"""


def _matrix(seed: int) -> np.ndarray:
    c = canonical(T, seed)
    m = np.zeros((T, T), np.float32)
    for t in range(1, T):
        m[t, :t] = c.row(t)
    return m


def _write_broken(path: Path) -> None:
    """A trace whose header is valid and whose weights are not (one negative weight)."""
    packed = np.stack([pack_rows(_matrix(5)), pack_rows(_matrix(6))]).astype(np.float16)
    packed[1, 10] = -0.5
    np.savez(path, format_version=np.int64(1),  # version 1: (layers, packed)
             attn=packed,
             layers=np.asarray(LAYERS, np.int64), meta=np.str_(json.dumps({"model": "broken"})))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    save_trace(d / "good.npz", np.stack([_matrix(1), _matrix(2)]), layers=LAYERS,
               meta={"model": "test-model"})
    _write_broken(d / "broken.npz")
    (d / "spec.toml").write_text(SPEC)
    return d


@pytest.fixture(scope="module")
def serial_table(workdir):
    return run_sweep(workdir / "spec.toml", workdir / "serial", base=workdir, progress=False)


def _same(a: pd.DataFrame, b: pd.DataFrame):
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    for m in ("retained_mass", "hh_recall"):  # bit for bit, NaN where a cell failed
        assert a[m].to_numpy().tobytes() == b[m].to_numpy().tobytes()


def test_serial_table_rows_match_the_library(workdir, serial_table):
    df = serial_table
    assert len(df) == 32
    assert list(df.columns[:5]) == ["trace", "layer", "head", "policy", "budget"]
    assert {"obs_window", "pool_kernel", "recent_window", "trace_sha256", "model",
            "kvviz_version"} <= set(df.columns)
    ok = df[df.status == "ok"]
    assert len(ok) == 16 and (ok.trace == "good.npz").all()
    # each row is what the library computes for that cell on its own (the sweep replays a
    # trace's layers together through kvviz.core.streams)
    for _, r in ok.iterrows():
        trace = load_trace(workdir / "good.npz", layer=int(r.layer))
        params = {} if r.policy == "tova" else {"recent_window": int(r.recent_window)}
        if r.policy == "snapkv":
            params.update(pool_kernel=int(r.pool_kernel), obs_window=int(r.obs_window))
        want = evaluate(trace, r.policy, int(r.budget), **params)
        assert r.retained_mass == want["retained_mass"] and r.hh_recall == want["hh_recall"]
        assert r.memory_bytes == want["memory_bytes"]
    sha = __import__("hashlib").sha256((workdir / "good.npz").read_bytes()).hexdigest()
    assert (ok.trace_sha256 == sha).all() and (ok.model == "test-model").all()
    assert set(zip(ok.layer, ok.budget)) == {(3, 40), (3, 96), (7, 40), (7, 96)}
    assert df[df.policy == "snapkv"].pool_kernel.tolist().count(3) == 8
    assert df[df.policy == "tova"].pool_kernel.isna().all()


def test_failing_cells_are_recorded_and_the_sweep_goes_on(serial_table):
    df = serial_table
    bad = df[df.trace == "broken.npz"]
    # the broken trace comes second: its 16 cells are the last, each ran and failed alone
    assert list(bad.index) == list(range(16, 32))
    assert (bad.status == "error").all()
    assert bad.error.str.contains("non-negative").all()
    assert bad.retained_mass.isna().all() and (df[df.status == "ok"].error == "").all()


def test_pool_and_ray_give_the_serial_table(workdir, serial_table, ray_local):
    pool = run_sweep(workdir / "spec.toml", workdir / "pool", base=workdir, workers=2,
                     progress=False)
    _same(pool, serial_table)
    ray = run_sweep(workdir / "spec.toml", workdir / "ray", base=workdir, ray=ray_local,
                    workers=2, progress=False)
    _same(ray, serial_table)
    for d in ("pool", "ray"):  # the files too
        assert (workdir / d / "results.csv").read_bytes() == (workdir / "serial" / "results.csv").read_bytes()
        _same(pd.read_parquet(workdir / d / "results.parquet"), serial_table)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # an orphan's zombie waits for init, which may not reap in a container


def test_sigkill_then_resume_gives_the_uninterrupted_table(workdir, serial_table):
    """SIGKILL a sweep on a 2-worker pool right after its 5th cell (mid-task: a task is a
    trace's two layers); its workers go too; resuming (serially: the engine may change) runs
    exactly the missing cells and gives the uninterrupted table, bit for bit."""
    out = workdir / "killed"
    args = ["sweep", "spec.toml", "--out", str(out), "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = kill_after_cells(5, [*args, "--workers", "2"], workdir, env)
    cells = out / "cells"
    before = {p.name: p.stat().st_mtime_ns for p in cells.glob("*.json")}
    assert len(before) == 5
    assert not (out / "results.csv").exists()
    assert workers
    deadline = time.monotonic() + 15  # they notice the driver's death within a second
    while any(_alive(int(p)) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(int(p)) for p in workers), "pool workers outlived the killed driver"
    resumed = subprocess.run([sys.executable, "-m", "kvviz", *args], cwd=workdir, env=env,
                             capture_output=True, text=True)
    # the broken trace's 16 cells fail (by design of SPEC): the sweep says so and exits 1
    assert resumed.returncode == 1, resumed.stderr
    assert "16 of 32 cells failed; first (" in resumed.stderr
    assert "broken.npz): ValueError: attn weights must be non-negative" in resumed.stderr
    after = {p.name: p.stat().st_mtime_ns for p in cells.glob("*.json")}
    assert len(after) == 32
    assert {n: after[n] for n in before} == before  # finished cells were not re-run
    _same(pd.read_parquet(out / "results.parquet"), serial_table)
    assert (out / "results.csv").read_bytes() == (workdir / "serial" / "results.csv").read_bytes()


def test_a_different_spec_or_trace_into_the_same_folder_is_refused(workdir, serial_table):
    out = workdir / "serial"
    files = sorted(p.name for p in (out / "cells").iterdir())
    other = SPEC.replace("budgets = [40, 96]", "budgets = [40, 64]")
    (workdir / "other.toml").write_text(other)
    with pytest.raises(SweepDirError, match="another spec"):
        run_sweep(workdir / "other.toml", out, base=workdir, progress=False)
    changed = workdir / "changed"
    changed.mkdir()
    save_trace(changed / "good.npz", np.stack([_matrix(1), _matrix(3)]), layers=LAYERS)
    (changed / "broken.npz").write_bytes((workdir / "broken.npz").read_bytes())
    with pytest.raises(SweepDirError, match="good.npz.*changed"):
        run_sweep(workdir / "spec.toml", out, base=changed, progress=False)
    assert sorted(p.name for p in (out / "cells").iterdir()) == files
    # the same spec again: nothing to run, same table
    _same(run_sweep(workdir / "spec.toml", out, base=workdir, progress=False), serial_table)


BAD = [
    ('[[policies]]\nname = "tova"', '[[policies]]\nname = "lru"', r"policies\[0\]\.name = 'lru'"),
    ('name = "h2o"', 'name = "h2o"\nsinks = 4', r"policies\[2\]\.sinks = 4: h2o has no parameter"),
    ("pool_kernel = [1, 3]", "pool_kernel = [1, 4]", r"pool_kernel = 4.*odd"),
    ('"broken.npz"]', '"missing.npz"]', r"traces = 'missing.npz': file not found"),
    ("layers = [3, 7]", "layers = [3, 14]", r"layers = \[3, 14\]: good.npz stores .*not 14"),
    ("budgets = [40, 96]", "budgets = [0, 96]", r"budgets = \[0, 96\]: budget must be >= 1"),
    ("budgets = [40, 96]", "budgets = [16, 96]",
     r"policies\[1\] \(snapkv.*at budget 16: recent_window must be smaller"),
    ('name = "h2o"', 'name = "h2o"\nrecent_window = 2.5', r"policies\[2\]\.recent_window = 2.5"),
    ('traces =', 'trace =', r"trace = .*unknown key"),
    ('traces =', 'mode = "loop"\ntraces =', r"layers = \[3, 7\]: unknown key for mode = 'loop'"),
    ('traces =', 'mode = "needle"\ntraces =', r"layers = \[3, 7\]: unknown key for mode = 'needle'"),
    ('traces =', 'mode = "loops"\ntraces =', r"mode = 'loops': must be one of 'replay', 'loop', 'needle'"),
    ('budgets', 'heads = ["q0"]\nbudgets', r"heads = \['q0'\]: good.npz stores heads \['mean'\]"),
]


@pytest.mark.parametrize("old,new,message", BAD)
def test_a_bad_spec_is_refused_before_any_cell_runs(workdir, old, new, message):
    assert old in SPEC
    (workdir / "bad.toml").write_text(SPEC.replace(old, new, 1))
    out = workdir / "bad"
    with pytest.raises(SpecError, match=message) as err:
        run_sweep(workdir / "bad.toml", out, base=workdir, progress=False)
    assert "\n" not in str(err.value)
    assert not out.exists()  # nothing ran, nothing written


def test_cli_refuses_a_bad_spec_in_one_line(workdir):
    (workdir / "bad_cli.toml").write_text(SPEC.replace("pool_kernel = [1, 3]", "pool_kernel = 4"))
    r = subprocess.run([sys.executable, "-m", "kvviz", "sweep", "bad_cli.toml", "--out", "cli_out"],
                       cwd=workdir, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m kvviz sweep: error: policies[1] "
                                                   "(snapkv, obs_window = 8, pool_kernel = 4) at budget 40: ")
    assert "odd" in lines[0]
    assert not (workdir / "cli_out").exists()


# --- the app: the Metrics view opens a sweep's results.parquet ---------------------------
def _arr(v):
    """Plotly JSON array (list or typed {dtype, bdata}) -> numpy."""
    if isinstance(v, dict) and "bdata" in v:
        import base64
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
    return np.asarray(v)


def _metrics_page(workdir, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("KVVIZ_TRACES_DIR", str(workdir))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    for k, v in {"trace": "file:good.npz", "budget": "48", "view": "metrics"}.items():
        at.query_params[k] = v
    return at.run()


def test_metrics_view_draws_a_sweep_by_trace_and_layer(workdir, serial_table, monkeypatch, apptest):
    at = _metrics_page(workdir, monkeypatch)
    assert not at.exception and not at.get("plotly_chart")
    parquet = (workdir / "serial" / "results.parquet").read_bytes()
    at.file_uploader(key="w.sweep_file").set_value(("results.parquet", parquet, "application/octet-stream")).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("32 cells, 16 failed" in c.value for c in at.caption)
    for metric in ("retained_mass", "hh_recall"):
        if metric != "retained_mass":
            at.radio(key="w.sweep_file_metric").set_value(metric).run()
        spec = json.loads(at.get("plotly_chart")[-1].proto.spec)
        titles = [a["text"] for a in spec["layout"]["annotations"]]
        assert titles == ["good.npz · layer 3", "good.npz · layer 7"]
        lines = {(d["xaxis"], d["name"]): d for d in spec["data"]}
        assert {n for _, n in lines} == {"tova", "snapkv (poolKernel=1)", "snapkv (poolKernel=3)", "h2o"}
        for (axis, name), d in lines.items():  # every point is the table's value for that cell
            layer = 3 if axis == "x" else 7
            policy, _, kernel = name.removesuffix(")").partition(" (poolKernel=")
            want = serial_table[(serial_table.trace == "good.npz") & (serial_table.layer == layer)
                                & (serial_table.policy == policy)]
            if kernel:
                want = want[want.pool_kernel == int(kernel)]
            assert _arr(d["x"]).tolist() == [40, 96]
            assert _arr(d["y"]).tolist() == want.sort_values("budget")[metric].tolist()
    # a file that is not a sweep table: an error on the page, no traceback
    junk = ("results.parquet", b"not parquet", "application/octet-stream")
    at.file_uploader(key="w.sweep_file").set_value(junk).run()
    assert not at.exception
    assert any("results.parquet: could not be read as Parquet" in e.value for e in at.error)


def test_metrics_view_without_pyarrow_says_so(workdir, monkeypatch, apptest):
    from kvviz.app.ui import sweep_view

    monkeypatch.setattr(sweep_view, "pyarrow_available", lambda: False)
    at = _metrics_page(workdir, monkeypatch)
    assert not at.exception
    assert any("needs pyarrow" in i.value for i in at.info)


def test_heads_are_an_axis(tmp_path):
    m = np.stack([_matrix(1), _matrix(4)])[None]  # 1 layer, 2 heads
    save_trace(tmp_path / "h.npz", m, layers=[5], heads=["mean", "q0"])
    spec = {"traces": ["h.npz"], "heads": ["q0", "mean"], "budgets": [64],
            "policies": [{"name": "tova"}]}
    df = run_sweep(spec, tmp_path / "out", base=tmp_path, progress=False)
    assert df["head"].tolist() == ["q0", "mean"] and df["layer"].tolist() == [5, 5]
    for _, r in df.iterrows():
        want = evaluate(load_trace(tmp_path / "h.npz", layer=5, head=r["head"]), "tova", 64)
        assert r.retained_mass == want["retained_mass"]
    assert df.retained_mass[0] != df.retained_mass[1]


def test_retry_failed_runs_only_the_failed_cells_again(workdir, serial_table):
    out = workdir / "serial"
    before = {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}
    df = run_sweep(workdir / "spec.toml", out, base=workdir, retry_failed=True, progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}
    rerun = sorted(int(n[:6]) for n in before if after[n] != before[n])
    assert rerun == list(range(16, 32))  # exactly the broken trace's cells
    _same(df, serial_table)


def test_progress_bar_counts_done_failed_and_eta():
    import io

    from kvviz.studies.sweep.progress import Progress

    buf = io.StringIO()
    bar = Progress(10, already=4, failed=1, stream=buf, every=0)
    assert "4/10" in buf.getvalue() and "1 failed" in buf.getvalue()
    bar.bar.start_t -= 2.0  # two cells in two seconds: 1 cell/s, 4 left
    bar.update(ok=True)
    bar.update(ok=False)
    last = buf.getvalue().split("\r")[-1]
    assert "6/10" in last and "2 failed" in last
    assert re.search(r"<00:0[45],", last)  # 4 s, or 5 if this process stalled
    for _ in range(4):
        bar.update(ok=True)
    final = buf.getvalue().split("\r")[-1]
    assert "10/10" in final and "2 failed" in final and final.endswith("\n")  # closed when done


def test_small_multiples_give_the_canonical_trace_one_panel(serial_table):
    from kvviz.app.figures.sweep import check_results, sweep_grid_figure

    ok = serial_table[serial_table.status == "ok"]
    canon = ok[ok.layer == 3].assign(trace="canonical", layer=pd.NA, head=None)
    df = pd.concat([ok, canon], ignore_index=True)
    fig = sweep_grid_figure(df, "hh_recall")
    titles = [a.text for a in fig.layout.annotations]
    assert titles[:2] == ["good.npz · layer 3", "good.npz · layer 7"] and titles[2] == "canonical"
    canon_lines = [d for d in fig.data if d.xaxis == "x3"]
    assert len(canon_lines) == 4 and not any(d.showlegend for d in canon_lines)
    assert sorted(y for d in canon_lines for y in d.y) == sorted(canon.hh_recall)
    with pytest.raises(ValueError, match="no column 'status'"):
        check_results(df.drop(columns="status"))


def test_bench_spec_holds_only_policies_its_traces_can_run():
    """sweep --bench replays the three shipped texts, which carry no key norms: every policy
    in its spec must be able to replay them (knorm would fail every cell)."""
    from kvviz.core.policies import POLICIES
    from kvviz.core.replay import runnable
    from kvviz.core.trace import load_trace
    from kvviz.studies.sweep.cli import bench_spec

    spec = bench_spec()
    names = [p["name"] for p in spec["policies"]]
    for path in spec["traces"]:
        assert set(names) <= set(runnable(load_trace(path)))
    assert "knorm" in POLICIES and "knorm" not in names and "tova" in names
