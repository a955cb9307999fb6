"""Allocators from outside the package: register_allocator's rules, the example allocator
plugin (examples/plugins/fixed_share.py) through every surface (the Python API, `kvviz
bench`, `kvviz check`, a process-pool sweep, the loop, the needle test, the Heads view), its
recorded origin, and the scorer factory an allocator is handed at construction."""
import ast
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from apphelp import REPO, ok

from kvviz.core import plugins
from kvviz.core.layers import load_layers, replay_layers
from kvviz.core.policies import (
    ALLOCATORS,
    BUILTIN_ALLOCATORS,
    POLICIES,
    make_policy,
    param_specs,
    register_allocator,
    register_policy,
    unregister_allocator,
)
from kvviz.core.policies.tova import Tova
from kvviz.policies import Allocator, Policy, param

FIXED = str(REPO / "examples" / "plugins" / "fixed_share.py")
DECAY = str(REPO / "examples" / "plugins" / "decay_sinks.py")
FIXED_SHA = hashlib.sha256(Path(FIXED).read_text().encode()).hexdigest()
CODE_KV = str(REPO / "traces" / "code-kv.npz")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
BUILTIN_ALLOCATOR_NAMES = [c.name for c in BUILTIN_ALLOCATORS]


@pytest.fixture(autouse=True)
def _registry_left_as_found():
    env = os.environ.get("KVVIZ_PLUGINS")
    yield
    plugins.forget()
    assert list(ALLOCATORS) == BUILTIN_ALLOCATOR_NAMES
    assert os.environ.get("KVVIZ_PLUGINS") == env


def kvviz_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvviz", *map(str, args)], cwd=REPO,
                          env=env or ENV, capture_output=True, text=True, timeout=300)


def fixed_share_shares(heads, b, decay):
    """The shares by hand: weights decay**g, floors of the exact shares, the slots left one
    each to the largest fractional parts."""
    exact = [heads * b * decay ** g / sum(decay ** h for h in range(heads)) for g in range(heads)]
    base = [int(x) for x in exact]
    for g in sorted(range(heads), key=lambda g: (base[g] - exact[g], g))[: heads * b - sum(base)]:
        base[g] += 1
    return base


def test_one_documented_import_path_gives_the_same_classes_as_the_old_ones():
    import kvviz
    import kvviz.policies
    import kvviz.policies.base
    from kvviz.core.policies import alloc, base

    assert Policy is base.Policy is kvviz.policies.base.Policy is kvviz.Policy
    assert Allocator is alloc.Allocator
    for name in ("Policy", "Allocator", "Rank", "param", "register_policy", "register_allocator"):
        assert name in kvviz.policies.__all__
    text = (REPO / "docs" / "policies.md").read_text()
    imports = {line.strip() for line in text.splitlines() if line.strip().startswith("from kvviz")
               and ("Policy" in line or "Allocator" in line)}
    assert imports and all(line.startswith("from kvviz.policies import ") for line in imports), imports


# --- register_allocator -----------------------------------------------------------------------
@dataclass
class Halves(Allocator):
    """Every head evicts down to its layer's budget (the default choose_layer)."""

    name = "halves-test"
    label = "halves (test)"


def test_register_allocator_adds_it_beside_the_builtins_once_and_unregisters_it():
    assert register_allocator(Halves) is Halves
    try:
        assert register_allocator(Halves) is Halves  # again: a no-op
        assert list(ALLOCATORS)[-1] == "halves-test" and "halves-test" not in POLICIES
        alloc = make_policy("halves-test", 64, scorer="snapkv", pool_kernel=3)
        assert type(alloc) is Halves and alloc.params["pool_kernel"] == 3
        assert plugins.provenance("halves-test")["origin"] == "module"
    finally:
        unregister_allocator("halves-test")
    assert "halves-test" not in ALLOCATORS
    with pytest.raises(ValueError, match="adakv is built in and cannot be unregistered"):
        unregister_allocator("adakv")


def test_register_allocator_refuses_a_taken_name_and_a_broken_declaration():
    @dataclass
    class Clash(Allocator):
        name = "tova"
        label = "not an allocator name"

    with pytest.raises(ValueError, match=r"allocator name 'tova' is already registered \(a policy\)"):
        register_allocator(Clash)

    @dataclass
    class Other(Allocator):
        name = "adakv"
        label = "another adakv"

    with pytest.raises(ValueError, match=r"allocator name 'adakv' is already registered \(by "
                                         r"kvviz.core.policies.adakv.AdaKV\)"):
        register_allocator(Other)

    @dataclass
    class Undeclared(Allocator):
        share: float = 0.5
        name = "undeclared-alloc"
        label = "undeclared"

    with pytest.raises(ValueError, match=r"field 'share' must be declared with param"):
        register_allocator(Undeclared)

    @dataclass
    class Nameless(Allocator):
        label = "no name"

    with pytest.raises(ValueError, match=r"Nameless.name must be its own lowercase name"):
        register_allocator(Nameless)

    @dataclass
    class Unlabelled(Allocator):
        name = "unlabelled"

    with pytest.raises(ValueError, match="unlabelled: label must be a non-empty string"):
        register_allocator(Unlabelled)

    @dataclass
    class BadDefault(Allocator):
        k: int = param(0, label="k", min=1, ui_max=8, help="h", source="s")
        name = "bad-default"
        label = "bad default"

    with pytest.raises(ValueError, match="bad-default.k: the default breaks its own rule"):
        register_allocator(BadDefault)
    with pytest.raises(ValueError, match="is not a subclass of kvviz.policies.Allocator"):
        register_allocator(Tova)
    with pytest.raises(ValueError, match="Halves is an Allocator: register it with register_allocator"):
        register_policy(Halves)
    assert list(ALLOCATORS) == BUILTIN_ALLOCATOR_NAMES


def test_a_policy_cannot_take_an_allocators_name():
    @dataclass
    class Pyr(Tova):
        name = "pyramidkv"
        label = "not pyramidkv"

    with pytest.raises(ValueError, match=r"policy name 'pyramidkv' is already registered \(an allocator\)"):
        register_policy(Pyr)


# --- the scorer factory, handed in at construction --------------------------------------------
def test_make_policy_hands_the_allocator_its_scorer_factory_and_a_given_factory_is_used():
    alloc = make_policy("adakv", 16)
    assert alloc.factory is make_policy and alloc.scorers == tuple(POLICIES)
    built = []

    def factory(name, budget, rng, place, **params):
        built.append((name, budget, place.head))
        return make_policy(name, budget, rng=rng, place=place, **params)

    from kvviz.core.policies.pyramidkv import PyramidKV

    alloc = PyramidKV(budget=16, beta=2, scorer="h2o", factory=factory, scorer_params={"recent_window": 4})
    group = alloc.group(0, 2, 3)
    # a probe at the budget that reads h2o's recent window of 4, then the first layer's heads:
    # the window plus 2(B - 4) - (B - 4)/beta of the rest
    assert built == [("h2o", 16, None), ("h2o", 22, 0), ("h2o", 22, 1), ("h2o", 22, 2)]
    assert [p.recent_window for p in group.policies] == [4, 4, 4]
    with pytest.raises(ValueError, match=r"pyramidkv was built without a scorer factory: build it with "
                                         r"make_policy\('pyramidkv', ...\)"):
        PyramidKV(budget=16).group(0, 1, 2)


def test_a_scorer_outside_the_names_handed_in_is_refused_naming_scorer():
    from kvviz.core.policies.adakv import AdaKV

    with pytest.raises(ValueError, match=r"scorer must be one of 'tova', 'h2o', got 'snapkv'"):
        AdaKV(budget=16, scorer="snapkv", factory=make_policy, scorers=("tova", "h2o"))
    with pytest.raises(ValueError, match=r"scorer must rank its slots"):  # the factory's policy is read
        make_policy("adakv", 16, scorer="random")


def test_no_module_global_wires_the_allocators_and_no_private_name_crosses_a_module():
    import kvviz.core.policies.alloc as alloc

    assert not hasattr(alloc, "_REGISTRY") and not hasattr(alloc, "bind_registry")
    assert "kvviz.core.policies" not in {n.module for n in ast.walk(ast.parse(Path(alloc.__file__).read_text()))
                                         if isinstance(n, ast.ImportFrom)}
    files = sorted((REPO / "kvviz" / "core" / "policies").glob("*.py")) + [
        REPO / "kvviz" / "core" / "plugins.py", REPO / "kvviz" / "policies" / "__init__.py"]
    crossing = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvviz"):
                crossing += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")
                             and a.name != "__all__"]
    assert crossing == []


def test_a_scorer_registered_after_the_allocator_is_a_valid_choice():
    assert plugins.load_plugins([DECAY]) == []
    scorer = next(s for s in param_specs("adakv") if s.name == "scorer")
    assert "decay-sinks" in scorer.choices
    alloc = make_policy("adakv", 32, scorer="decay-sinks", halfLife=4)
    assert [type(p).__name__ for p in alloc.group(0, 1, 2).policies] == ["DecaySinks", "DecaySinks"]


# --- the plugin file --------------------------------------------------------------------------
def test_the_allocator_plugin_loads_and_records_its_file_and_hash():
    assert plugins.load_plugins([FIXED]) == []
    assert plugins.load_plugin(FIXED) == ["fixed-share"]  # idempotent
    assert "fixed-share" in ALLOCATORS and "fixed-share" not in POLICIES
    assert plugins.provenance("fixed-share") == {"origin": "file", "where": FIXED, "sha256": FIXED_SHA}
    assert plugins.worker_specs(["fixed-share", "tova"]) == [f"{FIXED}:FixedShare"]
    alloc = make_policy("fixed-share", 16, decay=0.5)
    assert alloc.shares(3, 16) == [27, 14, 7] == fixed_share_shares(3, 16, 0.5)
    assert alloc.shares(4, 10) == fixed_share_shares(4, 10, 0.5)
    plugins.forget()
    assert "fixed-share" not in ALLOCATORS


def test_the_example_keeps_each_heads_share_at_the_end_of_a_replay():
    assert plugins.load_plugins([FIXED]) == []
    found = replay_layers(load_layers(CODE_KV), make_policy("fixed-share", 64, decay=0.5))
    want = fixed_share_shares(3, 64, 0.5)  # every head of this trace outgrows its share
    assert [found.held[d, :, -1].tolist() for d in range(3)] == [want] * 3


def test_an_allocator_and_a_policy_in_one_file_register_together(tmp_path):
    both = tmp_path / "both.py"
    both.write_text(Path(FIXED).read_text() + (
        "\nfrom kvviz.policies import Policy\n\n\n@dataclass\nclass Oldest(Policy):\n"
        "    name = 'oldest-test'\n    label = 'oldest'\n\n    def priority(self):\n"
        "        return -self.held().astype(float)\n"))
    assert plugins.load_plugin(str(both)) == ["fixed-share", "oldest-test"]
    assert "oldest-test" in POLICIES and "fixed-share" in ALLOCATORS


def test_a_plugin_allocator_named_like_a_policy_is_refused_in_one_line(tmp_path):
    clash = tmp_path / "clash.py"
    clash.write_text(Path(FIXED).read_text().replace('name = "fixed-share"', 'name = "snapkv"'))
    (msg,) = plugins.load_plugins([str(clash)])
    assert msg == f"plugin {clash}: allocator name 'snapkv' is already registered " \
                  "(by kvviz.core.policies.snapkv.SnapKV)"


def test_kvviz_check_runs_the_allocator_rules_on_the_plugin():
    r = kvviz_cli("check", "--plugin", FIXED, "fixed-share")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("fixed-share (") and lines[0].endswith(".FixedShare): PASS")
    assert lines[1:] == ["  PASS  contract: total", "  PASS  contract: victims", "  PASS  contract: floor",
                         "  PASS  contract: candidates",
                         "  PASS  determinism: two runs, identical victims",
                         "  PASS  refusals: bad parameters and budgets raise ValueError naming them",
                         "  PASS  order: each victim is the lowest-priority candidate it may take (per head)"]


def test_kvviz_check_fails_a_plugin_allocator_that_breaks_the_total(tmp_path):
    lax = tmp_path / "lax.py"  # evicts one slot too few whenever the layer is over
    lax.write_text(Path(FIXED).read_text().replace(
        "for _ in range(sum(counts) - len(policies) * b):", "for _ in range(sum(counts) - len(policies) * b - 1):"))
    r = kvviz_cli("check", f"{lax}:FixedShare")
    assert r.returncode == 1
    assert any(line.startswith("  FAIL  contract: total") for line in r.stdout.splitlines()), r.stdout


def test_bench_runs_the_plugin_allocator_by_flag_and_by_environment(tmp_path):
    r = kvviz_cli("bench", "--plugin", FIXED, "--trace", CODE_KV, "--layer", "14",
                  "--policies", "fixed-share:decay=0.5,adakv", "--budgets", "64", "--json", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [x["policy"] for x in rows] == ["fixed-share", "adakv"]
    shares = ", ".join(f"kv{g}={n}" for g, n in enumerate(fixed_share_shares(3, 64, 0.5)))
    assert f"fixed-share @ 64: layer 14 (per-head budget 64, total 192) held at the end: {shares}" in r.stdout
    assert r.stdout.splitlines()[-1] == f"fixed-share: file {FIXED}, sha256 {FIXED_SHA}"
    env = {**ENV, "KVVIZ_PLUGINS": FIXED}
    r2 = kvviz_cli("bench", "--trace", CODE_KV, "--policies", "fixed-share", "--budgets", "64", env=env)
    assert r2.returncode == 0 and "fixed-share" in r2.stdout, r2.stderr


def test_a_process_pool_sweep_loads_the_plugin_allocator_in_its_workers(tmp_path, long_run):
    (tmp_path / "spec.toml").write_text(
        f'traces = [{json.dumps(CODE_KV)}]\nbudgets = [32, 64]\n'
        '[[policies]]\nname = "fixed-share"\ndecay = [0.5]\n')
    r = kvviz_cli("sweep", tmp_path / "spec.toml", "--out", tmp_path / "out", "--workers", "2",
                  "--plugin", FIXED)
    assert r.returncode == 0, r.stdout + r.stderr
    import pandas as pd

    df = pd.read_csv(tmp_path / "out" / "results.csv")
    assert df["status"].tolist() == ["ok", "ok"], df.get("error")
    assert df["head"].tolist() == ["kv*", "kv*"]
    assert plugins.load_plugins([FIXED]) == []
    for budget in (32, 64):
        want = replay_layers(load_layers(CODE_KV), make_policy("fixed-share", budget, decay=0.5))
        assert df.loc[df["budget"] == budget, "memory_bytes"].item() == want.memory_bytes
    recorded = json.loads((tmp_path / "out" / "policies.json").read_text())
    assert recorded["fixed-share"] == {"origin": "file", "where": FIXED, "sha256": FIXED_SHA}


def test_the_heads_views_list_offers_the_plugin_allocator():
    from kvviz.app.ui.view_heads import choices

    assert choices()[0] == sorted(BUILTIN_ALLOCATOR_NAMES)
    assert plugins.load_plugins([FIXED, DECAY]) == []
    allocators, scorers = choices()
    assert allocators == sorted(BUILTIN_ALLOCATOR_NAMES + ["fixed-share"])
    assert "decay-sinks" in scorers and "fixed-share" not in scorers


def test_the_heads_view_runs_the_plugin_allocator_from_the_environment(monkeypatch, apptest):
    import apphelp

    monkeypatch.setenv("KVVIZ_PLUGINS", FIXED)
    at = apphelp.app(timeout=180, view="heads", heads__allocator="fixed-share")
    ok(at)
    assert "fixed-share" in at.sidebar.selectbox(key="heads.allocator").options
    assert at.sidebar.selectbox(key="heads.allocator").value == "fixed-share"
    shares = fixed_share_shares(3, 64, 0.5)
    last = f"layer 14: kv0={shares[0]}, kv1={shares[1]}, kv2={shares[2]} (total 192 of 192)"
    assert any(last in c.value for c in at.caption), [c.value for c in at.caption]


# --- the model ---------------------------------------------------------------------------------
def test_loop_and_needle_run_the_plugin_allocator_and_record_its_file(smollm, tmp_path, monkeypatch):
    import kvviz.model.models
    from kvviz.__main__ import main

    monkeypatch.setattr(kvviz.model.models, "load_model", lambda *a, **k: smollm)
    src, js, npz = tmp_path / "t.txt", tmp_path / "r.json", tmp_path / "r.npz"
    src.write_text((REPO / "traces" / "sources" / "execmodel.txt").read_text()[:300])
    assert main(["loop", "--text", str(src), "--max-tokens", "20", "--budget", "12", "--granularity", "kv-head",
                 "--policy", "fixed-share:decay=0.5", "--plugin", FIXED, "--json", str(js), "--out", str(npz),
                 "--quiet"]) == 0
    results = json.loads(js.read_text())["results"]
    assert [(r["policy"], r["budget"]) for r in results] == [("full", None), ("fixed-share", 12)]
    assert results[1]["params"]["decay"] == 0.5 and np.isfinite(results[1]["perplexity"])
    plugins.forget()
    from kvviz.model.loop import load_loop_result

    assert load_loop_result(npz).configs[1].source == {"origin": "file", "where": FIXED, "sha256": FIXED_SHA}
    out = tmp_path / "needle"
    assert main(["needle", "--out", str(out), "--lengths", "96", "--depths", "50", "--policies", "fixed-share",
                 "--budgets", "32", "--granularity", "kv-head", "--max-new-tokens", "2", "--plugin", FIXED,
                 "--quiet"]) == 0
    (run,) = (out / "runs").glob("*.npz")
    meta = json.loads(str(np.load(run)["meta"]))
    source = next(c["source"] for c in meta["configs"] if c["policy"] == "fixed-share")
    assert source == {"origin": "file", "where": FIXED, "sha256": FIXED_SHA}


def test_an_entry_point_in_the_policies_group_registers_an_allocator(tmp_path):
    site = tmp_path / "site"
    info = site / "kvviz_fixed-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvviz-fixed\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvviz.policies]\nfixed-share = fixed_pkg:FixedShare\n"
                                           "share = fixed_pkg:FixedShare\n")
    (site / "fixed_pkg.py").write_text(Path(FIXED).read_text())
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    r = kvviz_cli("bench", "--trace", CODE_KV, "--layer", "14", "--policies", "fixed-share", "--budgets", "64", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == (
        "kvviz bench: warning: plugin fixed_pkg:FixedShare (entry point share in kvviz.policies of kvviz-fixed): "
        "the entry point's name must be the allocator's name; FixedShare.name is 'fixed-share', the entry "
        "point is 'share' (ignored)")
    where = "fixed_pkg:FixedShare (entry point fixed-share in kvviz.policies of kvviz-fixed)"
    assert r.stdout.splitlines()[-1] == f"fixed-share: entry point {where}, sha256 {FIXED_SHA}"


def test_the_guide_shows_the_example_allocator_as_it_is():
    code = Path(FIXED).read_text()
    assert code[code.index("from dataclasses import dataclass"):] in (REPO / "docs" / "policies.md").read_text()
