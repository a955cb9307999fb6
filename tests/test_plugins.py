"""Policies from outside the package: the two examples in examples/plugins/ through every
surface (Python API, bench, sweep on three engines, the app, the loop CLI), the refusals
of broken plugins, and the sweep rules that plugins made necessary (an edited policy
re-runs its cells; failed cells give a non-zero exit)."""
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import numpy as np
import pytest
from apphelp import APP, REPO, ok, softmax_rows, traces_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvviz
from kvviz.core import plugins
from kvviz.core.check import compare, scenarios
from kvviz.core.policies import (
    BUILTINS,
    POLICIES,
    make_policy,
    param_specs,
    parse_params,
    reference_class,
    score_labels,
    unregister_policy,
)
from kvviz.core.trace import save_trace
from kvviz.studies.sweep.cell import PluginLoadError
from kvviz.studies.sweep.run import run_sweep

EXAMPLES = REPO / "examples" / "plugins"
DECAY, VOTE = str(EXAMPLES / "decay_sinks.py"), str(EXAMPLES / "window_vote.py")
BUILTIN_NAMES = [c.name for c in BUILTINS]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _registry_left_as_found():
    """Later test files count the built-ins: no plugin and no KVVIZ_PLUGINS outlive a test."""
    env = os.environ.get("KVVIZ_PLUGINS")
    yield
    plugins.forget()
    assert os.environ.get("KVVIZ_PLUGINS") == env


@pytest.fixture
def loaded():
    assert plugins.load_plugins([DECAY, VOTE]) == []
    yield
    plugins.forget()
    assert list(POLICIES) == BUILTIN_NAMES


def kvviz_cli(*args, cwd=REPO, env=None):
    return subprocess.run([sys.executable, "-m", "kvviz", *map(str, args)], cwd=cwd,
                          env=env or ENV, capture_output=True, text=True, timeout=300)


# --- the Python API --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["decay-sinks", "window-vote"])
def test_examples_match_their_slow_references(loaded, name):
    @settings(max_examples=200, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(data=st.data())
    def check(data):
        cls = POLICIES[name]
        compare(cls, reference_class(name), data.draw(scenarios(cls)))

    check()


def test_declarations_reach_every_list(loaded):
    from kvviz.app.figures.metrics import policy_colour
    from kvviz.app.state import MAX_COMPARE, default_cmp
    from kvviz.model.loop.cli import perf_policies
    from kvviz.model.loop.config import parse_policy

    half_life, = [s for s in param_specs("decay-sinks") if s.name == "half_life"]
    assert (half_life.kind, half_life.default, half_life.label) == ("float", 8.0, "halfLife")
    reduce_, = [s for s in param_specs("window-vote") if s.name == "reduce"]
    assert (reduce_.kind, reduce_.choices) == ("choice", ("mean", "max"))
    assert score_labels("decay-sinks")["score"] == "decayed attention"  # the two share a key
    assert score_labels("window-vote")["score"] == "window score"
    assert score_labels("snapkv")["pooled"] == "pooled window sum"
    colours = [policy_colour(n) for n in POLICIES]
    assert len(set(colours)) == len(colours) == len(POLICIES)  # the two plugins take free palette colours
    assert {"decay-sinks", "window-vote"} <= set(perf_policies())
    assert len(POLICIES) > MAX_COMPARE
    picked = default_cmp("decay-sinks", "window-vote")
    assert len(picked) == MAX_COMPARE and {"decay-sinks", "window-vote"} <= set(picked)
    # one parser: labels or names, text or numbers, the rule named when refused
    assert parse_params("decay-sinks", {"halfLife": "0.5", "sinks": 2}) == {"half_life": 0.5, "sinks": 2}
    with pytest.raises(ValueError, match=r"half_life must be in 0.5..1024.0, got 0.25"):
        parse_params("decay-sinks", {"half_life": "0.25"})
    with pytest.raises(ValueError, match=r"reduce must be one of 'mean', 'max', got 'median'"):
        make_policy("window-vote", reduce="median")
    assert parse_policy("window-vote:reduce=max,window=4") == ("window-vote", {"reduce": "max", "window": 4})
    assert make_policy("decay-sinks", half_life=2).half_life == 2.0  # an int is a float here


# --- refusals --------------------------------------------------------------------------
BROKEN = {
    "boom.py": ("raise RuntimeError('boom at import')", "import failed: RuntimeError: boom at import"),
    "syntax.py": ("def f(:\n    pass", "import failed: SyntaxError"),
    "nothing.py": ("X = 1", "defines no Policy or Allocator subclass with a name"),
    "dupe.py": ("""
        from dataclasses import dataclass
        from kvviz.core.policies.base import Policy
        @dataclass
        class Mine(Policy):
            name = "tova"
            label = "not TOVA"
            def priority(self):
                return self.held() * 0.0
        """, "policy name 'tova' is already registered"),
    "undeclared.py": ("""
        from dataclasses import dataclass
        from kvviz.core.policies.base import Policy
        @dataclass
        class Mine(Policy):
            rate: float = 0.5
            name = "undeclared"
            label = "undeclared"
        """, "field 'rate' must be declared with param(...)"),
    "outside.py": ("""
        from dataclasses import dataclass
        from kvviz.core.policies.base import Policy, param
        @dataclass
        class Mine(Policy):
            rate: float = param(5.0, label="rate", min=0.0, max=1.0, help="h", source="s")
            name = "outside"
            label = "outside"
        """, "outside.rate: the default breaks its own rule: rate must be in 0.0..1.0, got 5.0"),
}


def test_a_broken_plugin_is_refused_in_one_line_and_the_builtins_keep_working(tmp_path):
    paths = []
    for fname, (code, _) in BROKEN.items():
        (tmp_path / fname).write_text(textwrap.dedent(code))
        paths.append(str(tmp_path / fname))
    try:
        messages = plugins.load_plugins(paths + [DECAY])
        assert len(messages) == len(BROKEN)
        for msg, path, (_, rule) in zip(messages, paths, BROKEN.values()):
            assert "\n" not in msg and msg.startswith(f"plugin {path}: ") and rule in msg, msg
        assert list(POLICIES) == BUILTIN_NAMES + ["decay-sinks"]  # the good one loaded anyway
        assert POLICIES["tova"].__module__ == "kvviz.core.policies.tova"
        assert len(make_policy("tova", budget=4).kept) == 0
    finally:
        plugins.forget()


def test_register_policy_same_class_twice_is_a_no_op_another_is_refused():
    from kvviz.core.policies.tova import Tova

    assert kvviz.register_policy(Tova) is Tova
    try:
        assert plugins.load_plugins([DECAY]) == []
        cls = POLICIES["decay-sinks"]
        assert kvviz.register_policy(cls) is cls
        fake = dataclass(type("Other", (cls,), {"name": "decay-sinks", "__module__": __name__}))
        with pytest.raises(ValueError, match="'decay-sinks' is already registered"):
            kvviz.register_policy(fake)
        with pytest.raises(ValueError, match="built in"):
            unregister_policy("tova")
    finally:
        plugins.forget()


# --- bench ------------------------------------------------------------------------------
def test_bench_rows_for_plugins_by_flag_and_by_environment(tmp_path):
    r = kvviz_cli("bench", "--plugin", DECAY, "--plugin", VOTE, "--policies",
                  "tova,decay-sinks,window-vote", "--budgets", "256", "--json", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [x["policy"] for x in rows] == ["tova", "decay-sinks", "window-vote"]
    assert rows[1]["params"] == "sinks=4, half_life=8.0"
    assert all(0 < x["retained_mass"] < 1 for x in rows)
    env = {**ENV, "KVVIZ_PLUGINS": os.pathsep.join([DECAY, VOTE])}
    r2 = kvviz_cli("bench", "--policies", "window-vote", "--budgets", "256", env=env)
    assert r2.returncode == 0 and "window-vote" in r2.stdout, r2.stderr
    bad = kvviz_cli("bench", "--plugin", tmp_path / "nope.py", "--budgets", "256")
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"kvviz bench: error: plugin {tmp_path / 'nope.py'}: file not found"


# --- sweeps -----------------------------------------------------------------------------
SPEC = """
traces = ["two.npz"]
budgets = [24, 40]
[[policies]]
name = "decay-sinks"
half_life = [2.0, 8.0]
[[policies]]
name = "window-vote"
reduce = ["mean", "max"]
[[policies]]
name = "tova"
"""


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin_sweep")
    save_trace(d / "two.npz", softmax_rows(np.random.default_rng(5), 80, 2), layers=[0, 1])
    (d / "spec.toml").write_text(SPEC)
    return d


def test_sweep_serial_pool_and_ray_give_one_table(sweep_dir, ray_local):
    tables = {}
    try:
        for label, kw in [("serial", {}), ("pool", {"workers": 2}), ("ray", {"ray": ray_local, "workers": 2})]:
            tables[label] = run_sweep(sweep_dir / "spec.toml", sweep_dir / label, base=sweep_dir,
                                      progress=False, plugins=[DECAY, VOTE], **kw)
    finally:
        plugins.forget()
    serial = tables["serial"]
    assert len(serial) == 2 * 2 * (2 + 2 + 1) and (serial["status"] == "ok").all()
    assert set(serial["policy"]) == {"decay-sinks", "window-vote", "tova"}
    assert serial["half_life"].dtype == "float64" and set(serial["reduce"].dropna()) == {"mean", "max"}
    for label in ("pool", "ray"):
        assert tables[label].equals(serial), label
        assert (sweep_dir / label / "results.csv").read_bytes() == (sweep_dir / "serial" / "results.csv").read_bytes()


def test_a_worker_that_cannot_load_a_plugin_stops_the_sweep_before_any_cell(sweep_dir, tmp_path):
    src = (EXAMPLES / "decay_sinks.py").read_text()
    fails = tmp_path / "only_here.py"  # loads in the driver, refuses in a worker process
    fails.write_text("import multiprocessing\nif multiprocessing.parent_process() is not None:\n"
                     "    raise ImportError('not in a worker')\n" + src.replace('"decay-sinks"', '"only-here"'))
    (tmp_path / "spec.toml").write_text('traces = ["canonical"]\nbudgets = [32]\n'
                                        '[[policies]]\nname = "only-here"\n')
    try:
        with pytest.raises(PluginLoadError, match=rf"no cell ran: plugin {fails}.*not in a worker"):
            run_sweep(tmp_path / "spec.toml", tmp_path / "out", workers=2, progress=False,
                      plugins=[str(fails)])
    finally:
        plugins.forget()
    assert not list((tmp_path / "out" / "cells").glob("*.json"))


def test_a_policy_registered_without_a_file_cannot_go_to_workers():
    code = ("from dataclasses import dataclass\nimport kvviz\nfrom kvviz.core.policies.tova import Tova\n"
            "@dataclass\nclass T2(Tova):\n    name = 'tova-two'\n    label = 'tova two'\n"
            "kvviz.register_policy(T2)\nfrom kvviz.studies.sweep.run import run_sweep\n"
            "spec = {'traces': ['canonical'], 'budgets': [32], 'policies': [{'name': 'tova-two'}]}\n"
            "try:\n    run_sweep(spec, 'out_never', workers=2, progress=False)\n"
            "except ValueError as exc:\n    print(exc)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert "policy tova-two was registered from code with no file" in r.stdout, r.stderr
    assert not (REPO / "out_never").exists()


def _cells(out):
    return {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}


def test_an_edited_policy_re_runs_its_cells_and_an_unchanged_one_resumes(tmp_path, long_run):
    plugin = tmp_path / "mine.py"
    plugin.write_text((EXAMPLES / "decay_sinks.py").read_text())
    (tmp_path / "spec.toml").write_text('traces = ["canonical"]\nbudgets = [64, 128]\n'
                                        '[[policies]]\nname = "decay-sinks"\n[[policies]]\nname = "tova"\n')
    cmd = ("sweep", "spec.toml", "--out", "out", "--plugin", "mine.py", "--quiet")
    first = kvviz_cli(*cmd, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "out"
    before, table = _cells(out), (out / "results.csv").read_text()
    assert len(before) == 4
    again = kvviz_cli(*cmd, cwd=tmp_path)
    assert again.returncode == 0 and _cells(out) == before  # unchanged: every cell resumed
    plugin.write_text(plugin.read_text().replace("score *= 0.5 ** (1.0 / self.half_life)",
                                                 "score *= 0.9 ** (1.0 / self.half_life)"))
    edited = kvviz_cli(*cmd, cwd=tmp_path)
    assert edited.returncode == 0, edited.stderr
    after = _cells(out)
    # cells 0, 1: decay-sinks at 64 and 128 (re-run); 2, 3: tova (resumed)
    assert [after[n] != before[n] for n in sorted(after)] == [True, True, False, False]
    rows_before, rows_after = table.splitlines(), (out / "results.csv").read_text().splitlines()
    assert rows_before[3:] == rows_after[3:] and rows_before[1:3] != rows_after[1:3]


def test_a_sweep_with_failed_cells_exits_non_zero_with_the_count_and_first_error(tmp_path):
    (tmp_path / "flaky.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from kvviz.core.policies.tova import Tova

        @dataclass
        class Flaky(Tova):
            name = "flaky"
            label = "flaky"

            def observe(self, attn):
                if self.budget == 8 and len(attn) == 8:  # once full
                    raise ValueError("flaky gives up at budget 8")
                super().observe(attn)
        """))
    (tmp_path / "spec.toml").write_text('traces = ["canonical"]\nbudgets = [8, 16, 32]\n'
                                        '[[policies]]\nname = "flaky"\n')
    r = kvviz_cli("sweep", "spec.toml", "--out", "out", "--plugin", "flaky.py", "--quiet", cwd=tmp_path)
    assert r.returncode == 1
    assert "3 cells, 1 failed" in r.stdout
    assert ("1 of 3 cells failed; first (flaky at budget 8 on canonical): "
            "ValueError: flaky gives up at budget 8") in r.stderr
    assert (tmp_path / "out" / "results.csv").exists()  # the table is still written


# --- the app ------------------------------------------------------------------------------
def test_app_selectors_controls_compare_and_colours(loaded, apptest):
    from streamlit.testing.v1 import AppTest

    from kvviz.app.figures.metrics import policy_colour

    at = AppTest.from_file(APP, default_timeout=120)
    for k, v in {"a": "decay-sinks", "b": "window-vote", "a.halfLife": "2.5", "b.reduce": "max",
                 "budget": "256"}.items():
        at.query_params[k] = v
    at.run()
    ok(at)
    assert {"decay-sinks", "window-vote"} <= set(at.selectbox(key="w.a").options)
    assert at.slider(key="w.pa.half_life").value == 2.5  # a float control
    reduce_ = at.selectbox(key="w.pb.reduce")  # a choice control
    assert reduce_.options == ["mean", "max"] and reduce_.value == "max"
    reduce_.set_value("mean").run()
    ok(at)
    assert not at.error
    at.segmented_control(key="w.view").set_value("compare").run()
    ok(at)  # eight registered, the multiselect holds at most six: no crash
    chosen = at.multiselect(key="w.cmp").value
    assert len(chosen) == 6 and {"decay-sinks", "window-vote"} <= set(chosen)
    assert any(f"{len(POLICIES)} policies are registered and at most 6 are compared at once" in c.value
               for c in at.caption)
    survival = [s for s in (c.proto.spec for c in at.get("plotly_chart")) if "survival" in s.lower()]
    colours = {t["name"]: t["line"]["color"] for t in json.loads(survival[-1])["data"]
               if "line" in t and "name" in t}
    label = next(n for n in colours if n.startswith("decay-sinks"))
    assert colours[label] == policy_colour("decay-sinks")


def test_app_loads_plugins_from_the_environment(monkeypatch, tmp_path, apptest):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("KVVIZ_PLUGINS", os.pathsep.join([VOTE, str(tmp_path / "missing.py")]))
    try:
        at = AppTest.from_file(APP, default_timeout=120)
        at.query_params["b"] = "window-vote"
        at.run()
        ok(at)
        assert at.selectbox(key="w.b").value == "window-vote"
        assert any(f"plugin {tmp_path / 'missing.py'}: file not found" in e.value for e in at.error)
    finally:
        plugins.forget()


def test_loop_view_offers_every_registered_policy(loaded, apptest, torch_stack):
    """The run form (drawn only where torch is installed) offers every policy."""
    from streamlit.testing.v1 import AppTest

    with traces_dir(REPO / "traces"):
        at = AppTest.from_file(APP, default_timeout=120)
        for k, v in {"view": "loop", "trace": "file:prose.npz", "budget": "128"}.items():
            at.query_params[k] = v
        at.run()
        ok(at)
        assert list(at.multiselect(key="loop.new.policies").options) == list(POLICIES)


# --- the model in the loop ------------------------------------------------------------------
def test_loop_cli_runs_the_plugins(smollm, tmp_path, monkeypatch):
    import kvviz.model.models

    monkeypatch.setattr(kvviz.model.models, "load_model", lambda *a, **k: smollm)  # loaded once per session
    src, js, npz = tmp_path / "t.txt", tmp_path / "r.json", tmp_path / "r.npz"
    src.write_text((REPO / "traces" / "sources" / "execmodel.txt").read_text()[:300])
    from kvviz.__main__ import main

    try:
        assert main(["loop", "--text", str(src), "--max-tokens", "20", "--budget", "12",
                     "--policy", "decay-sinks:sinks=2,halfLife=4", "--policy", "window-vote:reduce=max,recentWindow=2",
                     "--plugin", DECAY, "--plugin", VOTE, "--json", str(js), "--out", str(npz), "--quiet"]) == 0
    finally:
        plugins.forget()
    results = json.loads(js.read_text())["results"]
    assert [(r["policy"], r["budget"]) for r in results] == [("full", None), ("decay-sinks", 12),
                                                             ("window-vote", 12)]
    assert results[1]["params"] == {"sinks": 2, "half_life": 4.0}
    assert results[2]["params"]["reduce"] == "max"
    assert all(np.isfinite(r["perplexity"]) for r in results)
    # the saved result loads in a process that never loads the plugins
    code = ("import json; from kvviz.core.policies import POLICIES; from kvviz.model.loop import load_loop_result\n"
            f"res = load_loop_result({str(npz)!r}); assert 'decay-sinks' not in POLICIES\n"
            "print(json.dumps([[r['policy'], r['params'], r['perplexity']] for r in res.results]))\n"
            "print(json.dumps(res.configs[1].source)); print(len(res.to_frame()))")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows, source, n = r.stdout.splitlines()
    assert json.loads(rows) == [[x["policy"], x["params"], x["perplexity"]] for x in results]
    source = json.loads(source)
    assert (source["origin"], source["where"]) == ("file", DECAY) and len(source["sha256"]) == 64
    assert int(n) == 3 * 30 * 20  # configs x layers x positions


def test_app_command_checks_its_plugins_and_hands_them_on(monkeypatch, capsys, tmp_path):
    from kvviz.__main__ import main

    monkeypatch.setenv("KVVIZ_PLUGINS", "")  # main() sets it; monkeypatch puts it back after
    assert main(["app", "--plugin", str(tmp_path / "nope.py"), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == f"kvviz app: error: plugin {tmp_path / 'nope.py'}: file not found"
    monkeypatch.chdir(REPO)
    try:
        assert main(["app", "--plugin", "examples/plugins/decay_sinks.py", f"--plugin={VOTE}",
                     "--dry-run"]) == 0
    finally:
        plugins.forget()
    assert os.environ["KVVIZ_PLUGINS"] == os.pathsep.join([DECAY, VOTE])  # absolute, for the page
    assert "--plugin" not in capsys.readouterr().out  # not passed on to streamlit


@pytest.mark.parametrize("path, ref", [(DECAY, "RefDecaySinks"), (VOTE, "RefWindowVote")])
def test_kvviz_check_passes_the_examples_with_their_references(path, ref):
    r = kvviz_cli("check", path, "--reference", f"{path}:{ref}", "--examples", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and "PASS  differential" in r.stdout


def test_kvviz_check_takes_plugin_and_all_builtins_stays_the_builtins(long_run):
    """--plugin registers the file's policies, which are then checked by name; a refused
    plugin is exit 2 in one line; --all-builtins checks the built-ins (policies, then
    allocators), not the plugins."""
    r = kvviz_cli("check", "window-vote", "--plugin", VOTE, "--steps", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("window-vote (") and "FAIL" not in r.stdout
    r = kvviz_cli("check", "tova", "--plugin", "no/such/plugin.py")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "kvviz check: error:" in r.stderr
    r = kvviz_cli("check", "--all-builtins", "--plugin", VOTE, "--steps", "32")
    from kvviz.core.policies import ALLOCATORS, BUILTINS
    checked = [ln.split(" (")[0] for ln in r.stdout.splitlines() if not ln.startswith(" ")]
    assert checked == [c.name for c in BUILTINS] + list(ALLOCATORS), r.stdout + r.stderr


# --- a float parameter from the command line; entry points ---------------------------------
def _ema_source(name="ema-sinks", default=0.1):
    """A plugin as a researcher writes one: sinks plus an exponentially decayed score whose
    float `alpha` is the weight of the newest step."""
    return textwrap.dedent(f'''
        from dataclasses import dataclass
        import numpy as np
        from kvviz.policies.base import Policy, Rank, param

        @dataclass
        class EmaSinks(Policy):
            alpha: float = param({default}, label="alpha", min=0.001, max=1.0, help="weight of the newest step",
                                 source="an example value")
            name = "{name}"
            label = "EMA + sinks"
            rank = Rank("score", "EMA attention", "lowest EMA goes first")

            def columns(self):
                return {{"score": (np.float64, (), 0.0)}}

            def observe(self, attn):
                score = self.col("score")
                score *= 1.0 - self.alpha
                score += self.alpha * attn

            def protected_tail(self):
                return 1

            def priority(self):
                prio = self.col("score").copy()
                prio[:4] = np.inf
                return prio

            def candidates(self):
                cand = super().candidates()
                cand[:4] = False
                return cand
        ''')


def test_bench_and_perf_take_a_plugins_float_parameter(tmp_path):
    plugin = tmp_path / "ema_sinks.py"
    plugin.write_text(_ema_source())
    r = kvviz_cli("bench", "--plugin", plugin, "--policies", "ema-sinks:alpha=0.05,ema-sinks:alpha=0.5",
                  "--budgets", "128", "--json", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [x["params"] for x in rows] == ["alpha=0.05", "alpha=0.5"]
    assert rows[0]["retained_mass"] != rows[1]["retained_mass"]  # the value reached the policy
    r = kvviz_cli("perf", "--plugin", plugin, "--policies", "tova,ema-sinks:alpha=0.05",
                  "--long-steps", "0", "--steps", "200", "--budget", "64")
    assert r.returncode == 0, r.stderr
    assert [ln.split()[0] for ln in r.stdout.splitlines()[2:]] == ["tova", "ema-sinks:alpha=0.05"]
    bad = kvviz_cli("perf", "--plugin", plugin, "--policies", "ema-sinks:alpha=2", "--long-steps", "0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == ("kvviz perf: error: --policies 'ema-sinks:alpha=2': "
                                                   "alpha must be in 0.001..1.0, got 2.0")


def _installed(tmp_path, entries: str, modules: dict) -> dict:
    """An installed distribution (a .dist-info with entry_points.txt) on PYTHONPATH."""
    site = tmp_path / "site"
    info = site / "kvviz_ema-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvviz-ema\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvviz.policies]\n{entries}\n")
    for name, text in modules.items():
        (site / f"{name}.py").write_text(text)
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


def test_an_entry_point_registers_under_its_name_and_bench_varies_its_parameter(tmp_path):
    env = _installed(tmp_path, "ema-sinks = ema_pkg:EmaSinks", {"ema_pkg": _ema_source()})
    r = kvviz_cli("bench", "--policies", "ema-sinks:alpha=0.05", "--budgets", "128", env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines()[2].split()[:2] == ["ema-sinks", "128"]


def test_an_entry_point_named_otherwise_than_its_policy_is_refused_in_one_line(tmp_path):
    env = _installed(tmp_path, "ema = ema_pkg:EmaSinks\nboth = two_pkg", {
        "ema_pkg": _ema_source(),
        "two_pkg": _ema_source("ema-one") + _ema_source("ema-two").replace("class EmaSinks", "class Two")})
    r = kvviz_cli("bench", "--policies", "tova", "--budgets", "128", env=env)
    assert r.returncode == 0
    warned = r.stderr.strip().splitlines()
    assert warned == [
        "kvviz bench: warning: plugin ema_pkg:EmaSinks (entry point ema in kvviz.policies of kvviz-ema): "
        "the entry point's name must be the policy's name; EmaSinks.name is 'ema-sinks', the entry point "
        "is 'ema' (ignored)",
        "kvviz bench: warning: plugin two_pkg (entry point both in kvviz.policies of kvviz-ema): the entry "
        "point's name must be the policy's name; the module defines 'ema-one', 'ema-two', the entry point "
        "is 'both' (ignored)"]
    r = kvviz_cli("bench", "--policies", "ema-sinks", "--budgets", "128", env=env)
    assert r.returncode == 2 and "unknown policy 'ema-sinks'" in r.stderr


def test_a_module_entry_point_registers_only_its_named_policy(tmp_path):
    env = _installed(tmp_path, "ema-two = two_pkg", {
        "two_pkg": _ema_source("ema-one") + _ema_source("ema-two").replace("class EmaSinks", "class Two")})
    code = ("from kvviz.core import plugins; from kvviz.core.policies import POLICIES\n"
            "print(plugins.load_entry_points()); print(sorted(n for n in POLICIES if n.startswith('ema')))\n"
            "print(plugins.provenance('ema-two'))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:2] == ["[]", "['ema-two']"]
    prov = eval(lines[2])  # noqa: S307 (a dict printed by the child)
    assert prov["origin"] == "entry point" and prov["where"].startswith("two_pkg (entry point ema-two in")
    assert len(prov["sha256"]) == 64


def test_an_explicit_plugin_replaces_an_installed_one_of_the_same_name_with_one_line(tmp_path):
    env = _installed(tmp_path, "ema-sinks = ema_pkg:EmaSinks", {"ema_pkg": _ema_source(default=0.1)})
    edited = tmp_path / "ema_edit.py"  # the file being edited: another default
    edited.write_text(_ema_source(default=0.25))
    r = kvviz_cli("bench", "--plugin", edited, "--policies", "ema-sinks", "--budgets", "128", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"kvviz bench: plugin {edited} replaces the installed policy 'ema-sinks' "
        "(ema_pkg:EmaSinks (entry point ema-sinks in kvviz.policies of kvviz-ema))"]
    assert r.stdout.splitlines()[2].split()[-1] == "alpha=0.25"  # the file's policy ran
    plain = kvviz_cli("bench", "--policies", "ema-sinks", "--budgets", "128", env=env)
    assert plain.returncode == 0 and plain.stderr == ""
    assert plain.stdout.splitlines()[2].split()[-1] == "alpha=0.1"  # the installed one
