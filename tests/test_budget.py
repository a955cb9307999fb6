"""Ratio budgets (kvviz.core.budget): parsing, the resolution rule, and every built-in policy
replayed at a ratio against a slow reference written from the rule."""
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest

from kvviz.core import harness
from kvviz.core.budget import Ratio, parse_budget, resolve
from kvviz.core.check import check_policy, truncated
from kvviz.core.policies import POLICIES, make_policy
from kvviz.core.policies.base import BudgetError
from kvviz.core.policies.tova import Tova
from kvviz.core.policies.vectors import use_rope_theta
from kvviz.core.reference import make_reference
from kvviz.core.replay import NEVER, Replay, run_policy
from kvviz.core.trace import canonical
from kvviz.studies.bench import parse_budgets, table


@pytest.mark.parametrize("given, want", [
    (64, 64), ("64", 64), (" 7 ", 7), (np.int64(3), 3),
    ("0.25x", Fraction(1, 4)), (".5x", Fraction(1, 2)), ("1x", Fraction(1)), ("0.1X", Fraction(1, 10)),
])
def test_parse_accepts_counts_and_ratios(given, want):
    got = parse_budget(given)
    assert (got.value if isinstance(got, Ratio) else got) == want
    assert type(got) is (Ratio if isinstance(want, Fraction) else int)


@pytest.mark.parametrize("given", [0, -1, True, 0.25, "0.25", "0x", "1.5x", "abc", "", None, "-0.25x", "64x"])
def test_parse_refuses_naming_budget_and_rule(given):
    with pytest.raises(ValueError, match=r"^budget must be a positive integer .* or a ratio .* \(0, 1\]"):
        parse_budget(given)


def test_a_ratio_keeps_its_text_and_a_named_parameter():
    assert str(parse_budget("0.25x")) == "0.25x"
    with pytest.raises(ValueError, match="^--budgets must be"):
        parse_budgets("64,quarter")
    assert parse_budgets("64, 0.5x") == [64, parse_budget("0.5x")]


def test_resolve_rounds_down_exactly_never_below_the_floor():
    quarter = parse_budget("0.25x")
    # floor(seen / 4), at least 1: worked by hand
    assert [resolve(quarter, s) for s in range(1, 13)] == [1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert [resolve(quarter.with_floor(5), s) for s in (1, 20, 23, 24)] == [5, 5, 5, 6]
    # 0.1 x 30 is 3.0000000000000004 in floats; the rule is exact
    assert resolve(parse_budget("0.1x"), 30) == 3 and resolve(parse_budget("0.3x"), 10) == 3
    assert resolve(parse_budget("1x"), 17) == 17 and resolve(64, 10) == 64


def _smallest_accepted(name: str) -> int:
    """The floor, by a plain scan: the first budget the policy constructs at."""
    for b in range(1, 4096):
        try:
            make_policy(name, b)
            return b
        except ValueError:
            continue
    raise AssertionError(f"{name} constructs at no budget below 4096")


def _reference_run(trace, name: str, num: int, den: int):
    """The rule, from scratch: at step t (t + 1 positions seen) the slow reference policy is
    fed row t renormalised over what it holds, then evicts to max(floor, (t + 1) * num // den)."""
    floor = _smallest_accepted(name)
    ref = make_reference(name, budget=floor)
    use_rope_theta(ref, trace.meta.get("rope_theta"), "the trace")  # as a replay does
    evicted_at, held = np.full(trace.steps, NEVER), []
    for t in range(trace.steps):
        w = trace.row(t)[ref.kept].astype(np.float64)
        if w.sum() > 0:
            w = w / w.sum()
        vectors = {}
        if ref.reads_keys:  # the keys at the positions it holds and the admitted one, in slot order
            vectors["keys"] = trace.keys[np.append(np.asarray(ref.kept, np.int64), t)].astype(np.float32)
        if ref.reads_queries:
            vectors["query"] = trace.queries[:, t].astype(np.float32)
        ref.on_decode_step(t, w.astype(np.float32), trace.key_norm(t), trace.value_norm(t), **vectors)
        budget = max(floor, (t + 1) * num // den)
        evicted_at[ref.evict(budget)] = t
        held.append(len(ref.keep))
        assert held[-1] == min(t + 1, budget)
    return evicted_at, np.array(held), floor


@pytest.mark.parametrize("name", [n for n in POLICIES if POLICIES[n].reference is not None])
def test_a_ratio_replay_is_the_rule_step_by_step(name):
    trace = truncated(canonical(), 200)  # key and value norms too, for those that read them
    want_evicted, want_held, floor = _reference_run(trace, name, 3, 10)
    run = run_policy(trace, name, "0.3x")
    assert str(run.budget) == "0.3x" and run.budget.floor == floor
    np.testing.assert_array_equal(run.held, want_held)
    np.testing.assert_array_equal(run.evicted_at, want_evicted)
    assert want_held[-1] == max(floor, 60) and run.peak_held == want_held.max()


def test_the_whole_ratio_never_evicts():
    run = run_policy(canonical(120), "tova", "1x")
    assert (run.evicted_at == NEVER).all() and run.held.tolist() == list(range(1, 121))


def test_the_harness_checks_the_resolved_budget():
    class KeepsAll(Tova):
        def evict(self, budget):
            return np.empty(0, np.int64)
    policy = KeepsAll(budget=1)
    harness.step(policy, 0, np.ones(0, np.float32), parse_budget("0.5x"))  # 1 held, 1 allowed
    harness.step(policy, 1, np.ones(1, np.float32), parse_budget("1x"))  # 2 held, 2 allowed
    with pytest.raises(BudgetError, match=r"held 3 slots after step 2, over its budget of 1:"):
        harness.step(policy, 2, np.ones(2, np.float32), parse_budget("0.5x"))  # floor(3 / 2) = 1


def test_refusals_name_what_is_wrong():
    with pytest.raises(ValueError, match="recent_window must be >= 0"):
        make_policy("snapkv", "0.25x", recent_window=-3)
    with pytest.raises(ValueError, match="has no parameter"):
        make_policy("tova", "0.25x", nope=1)
    with pytest.raises(ValueError, match="^budget: cake sets its heads' or layers' budgets once"):
        make_policy("cake", "0.25x")


@dataclass
class IgnoresLargerBudgets(Tova):
    """Evicts down to the budget it was built with whatever larger count it is asked for:
    invisible at a fixed budget, wrong at a ratio."""

    def evict(self, budget):
        return super().evict(min(budget, self.budget))


def test_check_fails_a_policy_that_ignores_the_resolved_budget_and_only_that():
    results = check_policy(IgnoresLargerBudgets, steps=160, speed=False)
    assert {r.rule for r in results if not r.passed} == {"ratio"}, [r.line() for r in results]
    bad = next(r for r in results if r.rule == "ratio")
    assert "step 7: held 1, want 2 (floor 1)" in bad.detail


def test_bench_records_the_budget_as_given_and_the_held_count():
    trace = canonical(400)
    out = table(trace, [64, parse_budget("0.25x")], ["streaming-llm"])
    got = {r["budget"]: r for r in out.records()}
    assert set(got) == {64, "0.25x"}
    assert got[64]["held"] == 64 and got["0.25x"]["held"] == 100  # 400 // 4
    per_slot = make_policy("streaming-llm", 64).bytes_per_slot
    assert got["0.25x"]["memory_bytes"] == 100 * per_slot and got[64]["memory_bytes"] == 64 * per_slot
    assert got["0.25x"]["evicts"] is True
    replayed = Replay(trace, make_policy("streaming-llm", "0.25x")).run()
    assert replayed.held.tolist() == [min(t + 1, max(5, (t + 1) // 4)) for t in range(400)]


def test_a_sweep_cell_takes_a_ratio_and_records_it_as_given(tmp_path):
    from kvviz import evaluate
    from kvviz.studies.sweep.run import run_sweep

    df = run_sweep({"traces": ["canonical"], "budgets": [64, "0.25x"], "policies": [{"name": "tova"}]},
                   tmp_path / "out", progress=False)
    assert df["budget"].tolist() == ["64", "0.25x"] and (df["status"] == "ok").all()
    want = evaluate(canonical(), "tova", "0.25x")
    got = df[df["budget"] == "0.25x"].iloc[0]
    assert got["retained_mass"] == want["retained_mass"] and got["memory_bytes"] == want["memory_bytes"]
    assert want["budget"] == "0.25x"


@pytest.mark.parametrize("budgets, policy, said", [
    (["1.5x"], "tova", r"budgets = \['1.5x'\]: budget must be .*outside \(0, 1\]"),
    (["0.25x"], "cake", r"policies\[0\] \(cake\) at budget 0.25x: budget: cake sets its heads' or layers'"),
])
def test_a_sweep_refuses_a_bad_ratio_before_running(tmp_path, budgets, policy, said):
    from kvviz.studies.sweep.rules import SpecError
    from kvviz.studies.sweep.spec import load

    spec = {"traces": ["canonical"], "budgets": budgets, "policies": [{"name": policy}]}
    with pytest.raises(SpecError, match=said):
        load(spec)


# -- in the model loop and inside Hugging Face generate (a tiny random-weight Llama) -------

TEXT = "The committee met at noon; the minutes record that the motion passed on a bright day."


def test_in_the_loop_a_ratio_is_the_rule_on_the_models_rows(tiny_llama, torch_stack):
    from kvviz.model.loop import LoopConfig, run_loop

    cfg = LoopConfig("tova", {}, "0.5x")
    res = run_loop(TEXT, [LoopConfig("full"), cfg], max_tokens=64, model=tiny_llama, granularity="kv-head")
    T, checked = len(res.tokens), False
    assert T > 8
    assert res.configs[1].label == "tova@0.5x" and res.configs[1].to_dict()["budget"] == "0.5x"
    for layer in res.rows_layers:
        for h in range(len(res.heads)):
            ev, tr = res.evicted_at[1, layer, h], res.trace(1, layer, h)
            ref, want = make_reference("tova", budget=1), np.full(T, NEVER)
            for t in range(T):  # floor(seen / 2), at least the floor 1
                w = tr.row(t)[ref.kept].astype(np.float64)
                ref.on_decode_step(t, (w / w.sum() if w.sum() > 0 else w).astype(np.float32))
                want[ref.evict(max(1, (t + 1) // 2))] = t
            np.testing.assert_array_equal(ev, want, err_msg=f"layer {layer} head {h}")
            assert (ev == NEVER).sum() == T // 2
            checked = True
    assert checked


def test_inside_hf_generate_a_ratio_is_kvviz_generate_in_prefill_mode(tiny_llama, torch_stack):
    import torch

    import kvviz.hf
    from kvviz.model.loop import LoopConfig, generate

    tok, mdl = tiny_llama
    prompt, n = TEXT[:40], 6
    gen = generate(prompt, [LoopConfig("streaming-llm", {"sinks": 2}, "0.5x")], n, granularity="kv-head",
                   prompt_mode="prefill", model=tiny_llama)
    c = 1 - gen.full_index
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    t0 = gen.prompt_len
    with kvviz.hf.evicting(mdl, policy="streaming-llm", budget="0.5x", granularity="kv-head", sinks=2) as log:
        out = mdl.generate(ids, max_new_tokens=n, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == gen.generated(c).tolist()
    np.testing.assert_array_equal(log.evicted_at, gen.evicted_at[c, :, :, : t0 + n - 1])
    for t in (t0 - 1, t0 + n - 2):  # the prompt evicted at once, then one step at a time
        assert (log.held(t).sum(axis=-1) == max(3, (t + 1) // 2)).all()
    with pytest.raises(ValueError, match="budget 0.5x with eviction freed: a ratio of the tokens seen"):
        with kvviz.hf.evicting(mdl, policy="tova", budget="0.5x", eviction="freed"):
            pass


@pytest.mark.parametrize("args, said", [
    (["loop", "--policy", "tova", "--budget", "1.5x"], "argument --budget: budget must be .* outside (0, 1]"),
    (["loop", "--policy", "tova", "--budget", "0.5x", "--eviction", "freed"],
     "--budget 0.5x with eviction freed: a ratio of the tokens seen grows with them"),
    (["generate", "--policy", "tova", "--budget", "0.5x", "--eviction", "freed"],
     "--budget 0.5x with eviction freed"),
    (["needle", "--policies", "tova", "--budgets", "64,0.25x", "--eviction", "freed"],
     "--budgets 0.25x with eviction freed"),
    (["needle", "--policies", "cake", "--budgets", "0.25x"], "cake sets its heads' or layers' budgets once"),
])
def test_the_model_commands_take_ratios_and_refuse_what_cannot_run_before_loading(tmp_path, monkeypatch, capsys,
                                                                                   args, said):
    import re
    import sys

    from kvviz.__main__ import main

    src = tmp_path / "t.txt"
    src.write_text("hello world, a short text.", encoding="utf-8")
    where = {"loop": ["--text", str(src)], "generate": ["--prompt", "hello world", "--max-new-tokens", "4"],
             "needle": ["--out", str(tmp_path / "out")]}[args[0]]
    monkeypatch.setitem(sys.modules, "torch", None)  # a refusal comes before torch is imported
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit) as stop:
        sys.exit(main([args[0], *where, *args[1:]]))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and re.search(re.escape(said).replace(r"\.\*", ".*"), err), err


# -- the page ---------------------------------------------------------------------------

def test_the_page_runs_a_ratio_budget_and_says_what_it_resolves_to(apptest):
    import apphelp
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(apphelp.APP, default_timeout=180)
    for k, v in {"a": "tova", "b": "streaming-llm", "budget": "64", "step": "300", "view": "cache"}.items():
        at.query_params[k] = v
    at.session_state["budget_share.kept"] = (True, "0.25")
    at.run()
    apphelp.ok(at)
    assert at.selectbox(key="budget_share.value").value == "0.25"
    said = " ".join(c.value for c in at.caption)
    # 301 positions seen: floor(301 / 4) = 75 for both (StreamingLLM's floor is 5)
    assert "budget 0.25x of the 301 positions seen at step 300: **A** 75 slots · **B** 75 slots" in said
    status = " ".join(m.value for m in at.markdown)
    assert "holds **75**" in status and "holds **64**" not in status


# -- allocators: the layer's budget resolved at every step ---------------------------------

def test_adakv_at_a_ratio_is_its_shared_choice_at_the_resolved_budget():
    from kvviz.core.layers import load_layers, replay_layers
    from kvviz.core.reference import shared_choice

    grid = load_layers("traces/code-kv.npz", [14])
    run = replay_layers(grid, make_policy("adakv", "0.25x"))
    heads = grid[0]
    refs = [make_reference("tova", budget=1) for _ in heads]
    want = np.full((len(heads), heads[0].steps), NEVER)
    for t in range(heads[0].steps):
        for ref, tr in zip(refs, heads):
            w = tr.row(t)[ref.kept].astype(np.float64)
            ref.on_decode_step(t, (w / w.sum() if w.sum() > 0 else w).astype(np.float32))
        b = max(1, (t + 1) // 4)  # the mean per head; no head below floor(0.2 x b)
        chosen = shared_choice(refs, len(heads) * b, b // 5)
        for g, (ref, c) in enumerate(zip(refs, chosen)):
            want[g, ref.drop(sorted(c))] = t
        assert sum(len(r.keep) for r in refs) == len(heads) * min(t + 1, b)
    for g in range(len(heads)):
        np.testing.assert_array_equal(run.runs[0][g].evicted_at, want[g], err_msg=f"head {g}")


def test_pyramidkv_at_a_ratio_resolves_each_layers_pyramid_and_holds_under_it():
    from kvviz.core.layers import load_layers, replay_layers
    from kvviz.core.policies.pyramidkv import pyramid

    grid = load_layers("traces/code-kv.npz")
    run = replay_layers(grid, make_policy("pyramidkv", "0.25x"))  # scorer tova: no window
    T, L = grid[0][0].steps, len(grid)
    first = next(m for m in range(1, 64) if min(pyramid(m, L, 20)) >= 1)  # the smallest mean it takes
    for t in (0, 9, 100, T - 2, T - 1):
        layer_b = pyramid(max(first, (t + 1) // 4), L, 20)
        for d in range(L):
            held = run.held[d, :, t]
            assert (held <= layer_b[d]).all() and (held >= min(t + 1, layer_b[d]) - 1).all(), (t, d)
    assert run.budgets == pyramid(T // 4, L, 20)


def test_an_allocator_that_fixes_its_budgets_once_refuses_a_ratio():
    for name, how in (("cake", "plan_layers"), ("headkv", "group"), ("headroles", "group, calibrate")):
        with pytest.raises(ValueError, match=rf"^budget: {name} sets .* once \({how}\), so it takes a fixed"):
            make_policy(name, "0.25x")


def test_budgets_as_given_sort_counts_then_ratios():
    from kvviz.core.budget import budget_order

    assert sorted([64, "0.5x", 8, "0.25x", "128"], key=budget_order) == [8, 64, "128", "0.25x", "0.5x"]
