"""RaaS: timestamps refreshed by high attention, the stalest position goes. The expected
victims are worked by hand from the rule; the model test runs it on a tiny random-weight
model and replays the rows the model recorded through the reference.
(Its Hypothesis differential against RefRaaS is tests/test_policies.py's, with every policy's.)"""
from __future__ import annotations

import numpy as np
import pytest

from kvviz.core.policies import POLICIES, make_policy
from kvviz.core.reference import RefRaaS

# 8 steps, budget 3, sinks 1, alpha 0.5. Each row is the step's weights over the kept
# positions, before the step's own position is admitted (None: a step without attention).
# Dyadic weights, so alpha x top is exact in float32 and float64 alike.
ROWS = [
    [],                         # t0: nothing held
    [1.0],                      # t1: over [0]
    [0.5, 0.5],                 # t2: over [0, 1]
    [0.25, 0.5, 0.25],          # t3: over [0, 1, 2]
    [0.125, 0.75, 0.125],       # t4: over [0, 2, 3]
    None,                       # t5: over [0, 2, 4], no attention
    [0.5, 0.0625, 0.4375],      # t6: over [0, 4, 5]
    [0.0625, 0.125, 0.8125],    # t7: over [0, 5, 6]
]
# The hand computation (stamps listed in kept order after the newcomer is admitted):
# t0: admit 0 (stamp 0). kept [0].
# t1: top 1, threshold 0.5: pos 0 -> 1. admit 1 (1). kept [0, 1] stamps [1, 1].
# t2: top 0.5, threshold 0.25: both -> 2. admit 2 (2). kept [0, 1, 2], at budget: no victim.
# t3: top 0.5, threshold 0.25: 0.25 >= 0.25, so all three -> 3. admit 3 (3).
#     stamps [3, 3, 3, 3]; pos 0 is a sink; 1, 2, 3 tie at 3 -> the lower position: pos 1.
#     (A strict ">" would leave pos 2 at stamp 2 and evict it instead.)
# t4: top 0.75, threshold 0.375: only pos 2 -> 4; pos 0 and pos 3 stay at 3. admit 4 (4).
#     stamps [3, 4, 3, 4] for [0, 2, 3, 4] -> pos 3 (stamp 3) goes, though pos 2 is older:
#     recency of use, not of admission.
# t5: no attention, nothing refreshed. admit 5 (5). stamps [3, 4, 4, 5] for [0, 2, 4, 5]:
#     pos 2 and pos 4 tie at 4 -> pos 2.
# t6: top 0.5, threshold 0.25: pos 0 -> 6, pos 5 (0.4375) -> 6, pos 4 (0.0625) stays 4.
#     admit 6 (6). stamps [6, 4, 6, 6] for [0, 4, 5, 6] -> pos 4.
# t7: top 0.8125, threshold 0.40625: only pos 6 -> 7. admit 7 (7). stamps [6, 6, 7, 7] for
#     [0, 5, 6, 7]: pos 0 ties pos 5 at 6 and is lower, but it is a sink -> pos 5.
VICTIMS = [[], [], [], [1], [3], [2], [4], [5]]
KEPT_AFTER = [[0], [0, 1], [0, 1, 2], [0, 2, 3], [0, 2, 4], [0, 4, 5], [0, 5, 6], [0, 6, 7]]


def _run(policy, rows=ROWS, budget=3):
    victims, kept = [], []
    for t, row in enumerate(rows):
        policy.on_decode_step(t, row)
        victims.append(policy.evict(budget).tolist())
        kept.append(policy.kept.tolist())
    return victims, kept


@pytest.mark.parametrize("build", [make_policy, RefRaaS], ids=["fast", "reference"])
def test_victims_worked_by_hand(build):
    victims, kept = _run(build("raas", 3, sinks=1, alpha=0.5) if build is make_policy
                         else build(3, None, sinks=1, alpha=0.5))
    assert victims == VICTIMS
    assert kept == KEPT_AFTER


def test_the_timestamps_it_shows_are_the_hand_computed_ones():
    p = make_policy("raas", 3, sinks=1, alpha=0.5)
    for t, row in enumerate(ROWS[:7]):
        p.on_decode_step(t, row)
        p.evict(3)
    p.on_decode_step(7, ROWS[7])  # before t7's eviction: stamps [6, 6, 7, 7] for [0, 5, 6, 7]
    s = p.scores()
    assert p.kept.tolist() == [0, 5, 6, 7] and s["stamp"].tolist() == [6, 6, 7, 7]
    assert s["candidate"].tolist() == [False, True, True, True]


def test_without_the_sink_the_oldest_stamp_goes_and_alpha_one_refreshes_only_the_top():
    # sinks 0: at t3 all four stamps are 3 and pos 0, no longer protected, is the lowest
    p = make_policy("raas", 3, sinks=0, alpha=0.5)
    victims, _ = _run(p, ROWS[:4])
    assert victims[3] == [0]
    # alpha 1: only a step's top weight refreshes. t3 refreshes only pos 1 (0.5):
    # stamps [2, 3, 2, 3] for [0, 1, 2, 3] -> sink 0 stays, pos 2 (stamp 2) goes
    p = make_policy("raas", 3, sinks=1, alpha=1.0)
    victims, _ = _run(p, ROWS[:4])
    assert victims[3] == [2]


def test_two_victims_at_once_are_the_two_stalest():
    # Same rows to t4 without evicting: stamps after t4's refresh and admission are
    # pos 0: 3 (t3), 1: 3 (t3), 2: 4, 3: 3, 4: 4. Budget 3 from 5 slots, sink 0 kept:
    # the two lowest of {1: 3, 2: 4, 3: 3, 4: 4} are pos 1 and pos 3 (stamp 3, lower first).
    p = make_policy("raas", 8, sinks=1, alpha=0.5)
    rows = [[], [1.0], [0.5, 0.5], [0.25, 0.5, 0.25], [0.125, 0.125, 0.75, 0.0]]
    for t, row in enumerate(rows):
        p.on_decode_step(t, row)
    assert p.evict(3).tolist() == [1, 3]


def test_declared_and_refused():
    cls = POLICIES["raas"]
    specs = {s.name: s for s in cls.specs}
    assert set(specs) == {"alpha", "sinks"}
    assert all("Hu et al. 2025" in s.source for s in specs.values())
    assert make_policy("raas", 8).bytes_per_slot == 13  # position, int64 stamp, scratch
    with pytest.raises(ValueError, match="sinks must be smaller than budget"):
        make_policy("raas", 4, sinks=4)
    with pytest.raises(ValueError, match=r"alpha must be in 0.0..1.0, got 1.5"):
        make_policy("raas", 8, alpha=1.5)
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        make_policy("raas", 8, sinks=-1)


# -- the vectorised form (kvviz.core.streams), several streams at once ---------------------

def _trace(rows, name):
    from kvviz.core.trace import ArrayTrace, pack_rows

    T = len(rows)
    m = np.zeros((T, T), np.float32)
    for t, row in enumerate(rows):
        m[t, : len(row)] = row
    return ArrayTrace(pack_rows(m), T, name=name)


def test_streams_give_the_hand_victims():
    from kvviz.core.streams import run_streams

    # ROWS t0..t4 as full rows: a weight per position, 0 where the position has gone
    # (t4: pos 1 left at t3). evicted_at[pos] = the step it left, -1 if never.
    full = [[], [1.0], [0.5, 0.5], [0.25, 0.5, 0.25], [0.125, 0.0, 0.75, 0.125]]
    trace = _trace(full, "hand")
    # sinks 1, alpha 0.5: as worked above, pos 1 at t3, pos 3 at t4
    assert run_streams([trace], "raas", 3, sinks=1, alpha=0.5)[0].evicted_at.tolist() == [-1, 3, -1, 4, -1]
    # sinks 0: pos 0 at t3 (all stamps 3, the lowest position); t4 refreshes pos 2 only,
    # stamps [3, 4, 3, 4] for [1, 2, 3, 4] -> pos 1
    assert run_streams([trace], "raas", 3, sinks=0, alpha=0.5)[0].evicted_at.tolist() == [3, 4, -1, -1, -1]
    # alpha 1: pos 2 at t3 (stamps [2, 3, 2, 3]); t4 over [0, 1, 3] gives pos 0 and pos 3 the
    # top weight (0.125 each), stamps [4, 3, 4, 4] for [0, 1, 3, 4] -> pos 1
    assert run_streams([trace], "raas", 3, sinks=1, alpha=1.0)[0].evicted_at.tolist() == [-1, 4, 3, -1, -1]


@pytest.mark.parametrize("sinks, alpha", [(0, 0.5), (2, 1.0), (1, 0.25)])
def test_streams_equal_one_policy_per_stream_where_ties_are_common(sinks, alpha):
    from kvviz.core.replay import run_policy
    from kvviz.core.streams import run_streams

    rng = np.random.default_rng(sinks)
    traces = []
    for s in range(3):  # integer levels 0..3, normalised: exact ties at the threshold (2w = top) and between stamps
        rows = [rng.integers(0, 4, t).astype(np.float32) for t in range(60)]
        traces.append(_trace([r / r.sum() if r.sum() else r for r in rows], f"ties{s}"))
    for trace, run in zip(traces, run_streams(traces, "raas", 8, sinks=sinks, alpha=alpha)):
        want = run_policy(trace, "raas", 8, sinks=sinks, alpha=alpha).evicted_at
        assert run.evicted_at.tolist() == want.tolist()


# -- in the model loop, on a tiny random-weight model --------------------------------------

TEXT = "The committee met at noon; the minutes record that the motion passed on a bright day."
T, B = 16, 6


def test_in_the_loop_its_victims_are_the_references_on_the_models_rows(tiny_llama, torch_stack):
    from kvviz.core import harness
    from kvviz.model.loop import LoopConfig, run_loop

    cfg = LoopConfig("raas", {"sinks": 2, "alpha": 0.5}, B)
    res = run_loop(TEXT, [LoopConfig("full"), cfg], max_tokens=T, model=tiny_llama, granularity="kv-head")
    c = 1
    assert len(res.tokens) == T and res.configs[c].label.startswith("raas")
    checked = 0
    for layer in res.rows_layers:
        for h in range(len(res.heads)):
            ev = res.evicted_at[c, layer, h]
            assert (ev != -1).sum() == T - B  # the budget held at every step
            assert (ev[:2] == -1).all()  # the two sinks stayed
            tr = res.trace(c, layer, h)
            ref = RefRaaS(B, None, sinks=2, alpha=0.5)
            want = np.full(T, -1)
            for t in range(T):
                harness.feed(ref, t, tr.row(t)[ref.held()], None)
                want[ref.evict(B)] = t
            np.testing.assert_array_equal(ev, want, err_msg=f"layer {layer} head {h}")
            checked += 1
    assert checked >= 2


def test_inside_hf_generate_it_is_kvviz_generate_in_prefill_mode(tiny_llama, torch_stack):
    import torch

    import kvviz.hf
    from kvviz.model.loop import LoopConfig, generate

    tok, mdl = tiny_llama
    prompt, n, params = TEXT[:40], 6, {"sinks": 2, "alpha": 0.5}
    gen = generate(prompt, [LoopConfig("raas", params, B)], n, granularity="kv-head",
                   prompt_mode="prefill", model=tiny_llama)
    c = 1 - gen.full_index
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    assert ids.shape[1] == gen.prompt_len > B  # the prompt alone is over budget
    with kvviz.hf.evicting(mdl, policy="raas", budget=B, granularity="kv-head", **params) as log:
        out = mdl.generate(ids, max_new_tokens=n, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == gen.generated(c).tolist()
    t0 = gen.prompt_len
    np.testing.assert_array_equal(log.evicted_at, gen.evicted_at[c, :, :, : t0 + n - 1])
    assert (log.held(t0 + n - 2).sum(axis=-1) == B).all()
    assert (log.evicted_at[..., :2] == -1).all()  # the sinks stayed in every layer and head


# -- in the page --------------------------------------------------------------------------

def test_the_page_lists_it_runs_it_and_draws_its_timestamps(apptest):
    import json

    import apphelp

    from kvviz.core import harness
    from kvviz.core.trace import canonical

    at = apphelp.app(timeout=180, a="raas", a__alpha=0.25, b="tova", budget=64, step=300,
                     view="scores")
    apphelp.ok(at)
    picker = at.selectbox(key="w.a")
    assert "raas" in picker.options and picker.value == "raas"  # the picker lists the registry
    assert at.slider(key="w.pa.alpha").value == 0.25 and at.slider(key="w.pa.sinks").value == 4
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    bars = next(t for t in spec["data"] if t["type"] == "bar" and t.get("xaxis", "x") == "x")
    assert bars["name"] == "last step it was in use"
    assert "(log)" not in spec["layout"]["yaxis"]["title"]["text"]  # steps on a linear axis
    # The stamps drawn are the reference's at step 300 (observed and admitted, before its
    # eviction), replayed here outside the page.
    trace, ref = canonical(), RefRaaS(64, None, alpha=0.25)
    for t in range(301):
        harness.feed(ref, t, trace.row(t)[ref.held()], None)
        if t < 300:
            ref.evict(64)
    stamp = dict(zip(ref.keep, ref.state))
    drawn = dict(zip(apphelp.arr(bars["x"]).astype(int).tolist(), apphelp.arr(bars["y"]).astype(int).tolist()))
    assert len(drawn) >= 8 and drawn == {pos: stamp[pos] for pos in drawn}
