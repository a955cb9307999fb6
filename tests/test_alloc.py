"""Shared budgets: where a stream sits (Place), budgets enforced and measured, allocators.

AdaKV is checked against a slow reference written from its rule (kvviz.core.reference.RefAdaKV)
on Hypothesis scenarios and on the shipped multi-head trace; `check_allocator` passes the
built-ins and fails one deliberately broken allocator per rule.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvviz.core import harness, plugins
from kvviz.core.check_alloc import check_allocator
from kvviz.core.layers import load_layers, replay_layers
from kvviz.core.metrics import summary
from kvviz.core.policies import (
    config_label,
    make_policy,
    parse_params,
    register_policy,
)
from kvviz.core.policies.base import BudgetError, Place
from kvviz.core.policies.pyramidkv import pyramid
from kvviz.core.policies.tova import Tova
from kvviz.core.reference import RefAdaKV
from kvviz.core.replay import Replay, run_policy
from kvviz.core.streams import run_streams
from kvviz.core.trace import canonical, load_trace
from kvviz.studies import bench

CODE_KV = "traces/code-kv.npz"


@pytest.fixture(autouse=True)
def _clean_registry():
    yield
    plugins.forget()


class Recorder(Tova):
    name = "recorder"
    label = "recorder"
    seen: ClassVar[list] = []

    def observe(self, attn):
        type(self).seen.append(self.place)
        super().observe(attn)


# -- Place --------------------------------------------------------------------------------
def test_a_single_stream_replay_tells_the_policy_nothing_it_does_not_have():
    register_policy(Recorder)
    Recorder.seen = []
    run_policy(canonical(40), "recorder", 16)
    assert set(Recorder.seen) == {Place()}  # all None
    Recorder.seen = []
    run_policy(load_trace(CODE_KV, layer=14, head="kv1"), "recorder", 64)
    assert set(Recorder.seen) == {Place(layer=14, layers=None, head=1, heads=None)}


def test_a_multi_head_replay_tells_each_scorer_its_layer_and_head():
    register_policy(Recorder)
    Recorder.seen = []
    grid = [[tr for tr in row] for row in load_layers(CODE_KV)]
    for row in grid:
        for tr in row:
            tr.steps = 80  # the first 80 rows are enough to see every stream step
    replay_layers(grid, make_policy("adakv", 32, scorer="recorder"))
    assert set(Recorder.seen) == {Place(layer, None, g, 3) for layer in (0, 14, 29) for g in range(3)}


def test_make_policy_sets_the_place_and_refuses_a_bad_one():
    p = make_policy("tova", 8, place=Place(3, 30, 1, 3))
    assert p.place == Place(3, 30, 1, 3) and make_policy("tova", 8).place == Place()
    with pytest.raises(ValueError, match="place.head must be below place.heads"):
        Place(0, 1, 3, 3)
    with pytest.raises(ValueError, match="place.layers must be None or an integer >= 1"):
        Place(0, 0)


# -- the budget, enforced and measured ----------------------------------------------------
OVER = '''
from kvviz.core.policies.tova import Tova


class KeepsOneMore(Tova):
    name = "keeps-one-more"
    label = "keeps one more"

    def evict(self, budget):
        return super().evict(budget + 1)  # one victim too few
'''


def _over_plugin(tmp_path):
    path = tmp_path / "over.py"
    path.write_text(OVER)
    return str(path)


def test_a_policy_over_its_budget_stops_the_replay_with_one_line(tmp_path):
    plugins.load_plugins([_over_plugin(tmp_path)])
    with pytest.raises(BudgetError) as exc:
        run_policy(load_trace(CODE_KV, layer=14, head="kv0"), "keeps-one-more", 64)
    assert str(exc.value) == ("keeps-one-more held 65 slots in stream code-kv (layer 14, head 0) "
                              "after step 64, over its budget of 64: a policy must evict down "
                              "to its budget")


def test_bench_stops_on_a_policy_over_its_budget(tmp_path, capsys):
    from kvviz.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--plugin", _over_plugin(tmp_path), "--policies", "keeps-one-more",
              "--budgets", "64", "--trace", CODE_KV])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "keeps-one-more held 65 slots in stream code-kv (layer 0) after step 64" in err


def test_a_sweep_cell_over_its_budget_fails_and_the_sweep_exits_non_zero(tmp_path, capsys):
    from kvviz.studies.sweep import cli

    spec = tmp_path / "spec.toml"
    spec.write_text('traces = ["canonical"]\nbudgets = [64]\n[[policies]]\nname = "keeps-one-more"\n'
                    '[[policies]]\nname = "tova"\n')
    rc = cli.main([str(spec), "--out", str(tmp_path / "out"), "--quiet", "--plugin",
                   _over_plugin(tmp_path)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "1 of 2 cells failed" in err and "keeps-one-more held 65 slots" in err


def test_memory_comes_from_the_recorded_held_counts():
    run = run_policy(canonical(50), "tova", 64)  # never fills its budget
    assert run.held.tolist() == list(range(1, 51))
    assert summary(canonical(50), run)["memory_bytes"] == 13 * 50
    run = run_policy(canonical(100), "h2o", 16, recent_window=4)
    assert run.held.max() == 16 and summary(canonical(100), run)["memory_bytes"] == 13 * 16
    streams = run_streams([canonical(60, seed=s) for s in range(2)], "tova", 64)
    assert all(r.held.max() == 60 for r in streams)


# -- allocators through the parameter system ----------------------------------------------
def test_an_allocator_takes_its_scorer_and_the_scorers_parameters():
    assert parse_params("adakv", {"scorer": "snapkv", "poolKernel": "3"}) == {
        "scorer": "snapkv", "pool_kernel": 3}
    a = make_policy("adakv", 64, scorer="snapkv", poolKernel=3)
    assert a.params["pool_kernel"] == 3 and a.params["alpha"] == 0.2
    assert config_label("adakv", a.params, budget=64) == "adakv (scorer=snapkv, poolKernel=3) @ 64"
    assert bench.policy_list("tova,adakv:scorer=snapkv,poolKernel=3,h2o") == [
        "tova", "adakv:scorer=snapkv,poolKernel=3", "h2o"]
    with pytest.raises(ValueError, match="tova has no parameter"):
        make_policy("adakv", 64, pool_kernel=3)  # the default scorer, tova, has none
    with pytest.raises(ValueError, match="scorer must be one of"):
        make_policy("adakv", 64, scorer="pyramidkv")
    with pytest.raises(ValueError, match="random chooses victims without one"):
        make_policy("adakv", 64, scorer="random")
    with pytest.raises(ValueError, match="alpha must be in 0.0..1.0"):
        parse_params("adakv", {"alpha": "1.5"})


def test_a_single_stream_refuses_an_allocator_in_one_line():
    with pytest.raises(ValueError, match="adakv is an allocator") as exc:
        Replay(canonical(10), make_policy("adakv", 4))
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="stores no KV heads"):
        bench.table(bench.open_trace("traces/code.npz"), [64], ["adakv"])


def test_bench_prints_each_heads_held_count_beside_the_row(capsys):
    from kvviz.__main__ import main

    assert main(["bench", "--trace", CODE_KV, "--layer", "14", "--policies", "adakv:scorer=tova",
                 "--budgets", "64"]) == 0
    out = capsys.readouterr().out
    assert "adakv @ 64: layer 14 (per-head budget 64, total 192) held at the end: kv0=46, kv1=38, kv2=108" in out


@given(st.integers(1, 300), st.integers(1, 40), st.integers(1, 50))
def test_the_pyramid_keeps_the_total_exactly_and_decreases(budget, layers, beta):
    b = pyramid(budget, layers, beta)
    assert sum(b) == layers * budget and len(b) == layers
    assert all(x >= y for x, y in zip(b, b[1:]))
    if beta == 1:
        assert b == [budget] * layers


def test_pyramidkv_refuses_a_layer_with_no_slots():
    with pytest.raises(ValueError, match=r"beta=20 at budget 8 over 30 layers leaves layer 29 "
                                         r"\(the last of the 30 that share it, counted from 0\) 0 slots per head"):
        make_policy("pyramidkv", 8).layer_budgets(30)
    assert pyramid(64, 3, 20) == [125, 64, 3]


def test_pyramidkv_keeps_its_scorers_recent_window_in_every_layer(capsys):
    # the paper's code and kvpress: each layer keeps the window, the pyramid shares the rest
    snap = make_policy("pyramidkv", 64, scorer="snapkv")  # recentWindow 32
    assert snap.layer_budgets(3) == [32 + x for x in pyramid(64 - 32, 3, 20)] == [94, 64, 34]
    assert make_policy("pyramidkv", 64).layer_budgets(3) == pyramid(64, 3, 20)  # tova: no window
    found = replay_layers(load_layers(CODE_KV), snap)
    assert [found.held[d, :, -1].tolist() for d in range(3)] == [[94] * 3, [64] * 3, [34] * 3]
    from kvviz.__main__ import main

    assert main(["bench", "--trace", CODE_KV, "--policies", "pyramidkv:scorer=snapkv", "--budgets", "64"]) == 0
    assert "pyramidkv @ 64: layer 29 (per-head budget 34, total 102)" in capsys.readouterr().out
    with pytest.raises(ValueError) as exc:
        make_policy("pyramidkv", 40, scorer="snapkv").layer_budgets(30)
    assert str(exc.value) == (
        "beta=20 at budget 40 over 30 layers leaves layer 29 (the last of the 30 that share it, counted "
        "from 0) 32 slots per head, only the "
        "scorer's recent window of 32: its share of budget - recentWindow = 8 is 0, and each layer "
        "needs at least 1 slot beyond the window (lower beta, raise the budget or lower the scorer's "
        "recentWindow)")
    budgets = make_policy("pyramidkv", 40, scorer="snapkv", recent_window=8).layer_budgets(30)
    assert sum(budgets) == 30 * 40 and min(budgets) > 8  # the fix it names works


# -- the allocator contract ---------------------------------------------------------------
@pytest.mark.parametrize("name, params", [("adakv", {"scorer": "tova"}),
                                          ("adakv", {"scorer": "h2o", "recent_window": 2}),
                                          ("adakv", {"scorer": "snapkv", "recent_window": 2, "alpha": 0.5}),
                                          ("pyramidkv", {"scorer": "tova", "beta": 4})])
def test_the_built_in_allocators_pass_the_contract(name, params):
    results = check_allocator(lambda b: make_policy(name, b, **params))
    assert all(r.passed for r in results), [r.line() for r in results if not r.passed]


def broken(name: str):
    """One of the broken allocators of BROKEN (below), the file `kvviz check` is given too."""
    ns: dict = {}
    exec(compile(BROKEN, "broken.py", "exec"), ns)
    return ns[name]


@pytest.mark.parametrize("cls, params, rule", [
    ("OneTooFew", {}, "total"),
    ("NoFloor", {"alpha": 0.5}, "floor"),
    ("IgnoresCandidates", {"scorer": "h2o", "recent_window": 4}, "candidates"),
    ("Restless", {}, "two runs, identical victims"),
    ("Lax", {}, "bad parameters and budgets raise ValueError naming them"),
])
def test_each_broken_allocator_fails_its_rule(cls, params, rule):
    cls = broken(cls)
    scorer = {k: v for k, v in params.items() if k not in ("scorer", "alpha")}

    def make(b):
        a = cls(budget=b, scorer=params.get("scorer", "tova"), alpha=params.get("alpha", 0.2))
        a.scorer_params = scorer
        return a

    failed = {r.name for r in check_allocator(make, cls) if not r.passed}
    assert rule in failed


# -- AdaKV against its slow reference -------------------------------------------------------
def _both(heads, budget, scorer, alpha, scorer_params):
    fast = make_policy("adakv", budget, scorer=scorer, alpha=alpha, **scorer_params).group(0, 1, heads)
    ref = RefAdaKV(budget, heads, scorer=scorer, alpha=alpha, **scorer_params)
    return fast, ref


def _agree(fast, ref, rows_of, steps):
    for t in range(steps):
        raws = [rows_of(t, g, fast.policies[g].held()) for g in range(fast.heads)]
        got = harness.step_layer(fast, t, raws)
        for g, r in enumerate(ref.heads):
            harness.feed(r, t, rows_of(t, g, r.held()))
        want = ref.evict()
        assert [v.tolist() for v in got] == [v.tolist() for v in want], f"step {t}"


SCORERS = st.sampled_from([("tova", {}), ("h2o", {"recent_window": 1}),
                           ("snapkv", {"recent_window": 0, "pool_kernel": 1, "obs_window": 2}),
                           ("snapkv", {"recent_window": 1, "pool_kernel": 3, "obs_window": 3,
                                       "pooling": "avg"})])


@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 4), budget=st.integers(2, 10), alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
       scorer=SCORERS, seed=st.integers(0, 2**16), kind=st.sampled_from(["random", "ties", "onehot"]),
       steps=st.integers(1, 40))
def test_adakv_matches_its_reference_on_generated_scenarios(heads, budget, alpha, scorer, seed, kind, steps):
    name, params = scorer
    fast, ref = _both(heads, budget, name, alpha, params)
    table = {}

    def rows_of(t, g, held):
        if (t, g) not in table:
            rng = np.random.default_rng([seed, t, g])
            if kind == "ties":
                table[t, g] = rng.choice(np.array([0.25, 0.5], np.float32), t)
            elif kind == "onehot" and g == 0:
                table[t, g] = np.eye(max(t, 1), dtype=np.float32)[rng.integers(max(t, 1))][:t]
            else:
                table[t, g] = rng.random(t).astype(np.float32)
        return table[t, g][held]

    _agree(fast, ref, rows_of, steps)


@pytest.mark.parametrize("layer, scorer, params", [(14, "tova", {}), (29, "snapkv", {"recent_window": 8})])
def test_adakv_matches_its_reference_on_the_multi_head_trace(layer, scorer, params):
    row = load_layers(CODE_KV, [layer])[0]
    fast, ref = _both(3, 64, scorer, 0.2, params)
    steps = 512 if scorer == "tova" else 200
    _agree(fast, ref, lambda t, g, held: row[g].row(t)[held], steps)


def test_a_sweep_runs_an_allocator_over_every_kv_head_and_refuses_one_without(tmp_path):
    from kvviz.studies.sweep.rules import SpecError
    from kvviz.studies.sweep.run import run_sweep

    spec = {"traces": [CODE_KV], "budgets": [64],
            "policies": [{"name": "adakv", "scorer": "snapkv", "pool_kernel": 3}]}
    df = run_sweep(spec, tmp_path / "out", progress=False)
    row = df.iloc[0]
    assert (row["head"], row["status"], row["scorer"], row["pool_kernel"]) == ("kv*", "ok", "snapkv", 3)
    grid = load_layers(CODE_KV)
    want = replay_layers(grid, make_policy("adakv", 64, scorer="snapkv", pool_kernel=3))
    assert row["memory_bytes"] == want.memory_bytes
    with pytest.raises(SpecError, match="adakv is an allocator"):
        run_sweep({**spec, "traces": ["canonical"]}, tmp_path / "other", progress=False)


# -- kvviz check on allocators --------------------------------------------------------------
BROKEN = '''
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.adakv import AdaKV
from kvviz.core.policies.alloc import shared_victims
from kvviz.core.policies.base import param


class OneTooFew(AdaKV):
    name = "one-too-few"

    def choose_layer(self, policies, b):
        out = super().choose_layer(policies, b)
        for i, v in enumerate(out):
            if len(v):
                out[i] = v[1:]
                break
        return out


class NoFloor(AdaKV):
    name = "no-floor"

    def floor(self, b):
        return b // 2  # claims half the budget, then evicts below it

    def choose_layer(self, policies, b):
        return shared_victims(policies, len(policies) * b, 0)


class IgnoresCandidates(AdaKV):
    name = "ignores-candidates"

    def choose_layer(self, policies, b):  # the newest slots: tova never offers its unobserved newcomer
        out = []
        for p in policies:
            n = len(p.held())
            out.append(np.arange(b, n) if n > b else np.empty(0, np.int64))
        return out


class Restless(AdaKV):
    name = "restless"

    def choose_layer(self, policies, b):
        order = np.random.default_rng().permutation(len(policies))  # unseeded: runs differ
        chosen = shared_victims([policies[g] for g in order], len(policies) * b, self.floor(b))
        out = [None] * len(policies)
        for k, g in enumerate(order):
            out[g] = chosen[k]
        return out


@dataclass
class Lax(AdaKV):
    name = "lax"
    alpha: float = param(0.2, label="alpha", min=0.0, max=1.0, help="floor share",
                         source="a broken copy of adakv's")

    def __post_init__(self):  # skips the parameters' rules
        self.scorer_params = {}
'''


def test_kvviz_check_runs_the_allocator_contract_on_the_built_ins(capsys, long_run):
    from kvviz.__main__ import main

    assert main(["check", "adakv", "pyramidkv", "headroles"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, cls in [("adakv", "AdaKV"), ("pyramidkv", "PyramidKV"), ("headroles", "HeadRoles")]:
        at = lines.index(f"{name} (kvviz.core.policies.{name}.{cls}): PASS")
        assert lines[at + 1:at + 7] == [
            "  PASS  contract: total", "  PASS  contract: victims", "  PASS  contract: floor",
            "  PASS  contract: candidates",
            "  PASS  determinism: two runs, identical victims",
            "  PASS  refusals: bad parameters and budgets raise ValueError naming them"]


def test_kvviz_check_all_builtins_includes_the_allocators(capsys, monkeypatch, long_run):
    import kvviz.core.policies as registry
    from kvviz.core import check

    monkeypatch.setattr(registry, "BUILTINS", ())  # the policies' own run is test_check's
    assert check.main(["--all-builtins"]) == 0
    out = capsys.readouterr().out
    assert {line.split(" ")[0] for line in out.splitlines() if not line.startswith(" ")} == {
        "adakv", "pyramidkv", "headroles", "headkv", "cake"}


@pytest.mark.parametrize("cls, rule", [
    ("OneTooFew", "contract: total"),
    ("NoFloor", "contract: floor"),
    ("IgnoresCandidates", "contract: candidates"),  # and the order: the newest go, whatever their priority
    ("Restless", "determinism: two runs, identical victims"),
    ("Lax", "refusals: bad parameters and budgets raise ValueError naming them"),
])
def test_kvviz_check_fails_a_broken_allocator_file_on_its_rule(tmp_path, capsys, cls, rule):
    from kvviz.__main__ import main

    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    assert main(["check", f"{path}:{cls}"]) == 1
    out = capsys.readouterr().out
    assert f"{path}:{cls} (" in out and "): FAIL" in out
    failed = [line.strip()[len("FAIL  "):].split(" -- ")[0] for line in out.splitlines()
              if line.strip().startswith("FAIL")]
    also = ["order: each victim is the lowest-priority candidate it may take (shared)"] \
        if cls == "IgnoresCandidates" else []
    assert failed == [rule] + also


def test_kvviz_check_takes_a_reference_for_an_allocator(capsys):
    from kvviz.__main__ import main

    assert main(["check", "adakv", "--reference", "kvviz.core.reference_alloc:RefAdaKV",
                 "--examples", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("  PASS  differential: identical victims and held sets per head to the reference "
                       "at every step -- 20 random scenarios")
