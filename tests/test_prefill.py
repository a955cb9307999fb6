"""A prompt read in one pass (kvviz.core.harness.prefill): each policy's declared shortcut
(TOVA's last row, SnapKV's and Scissorhands' rings, H2O's sum) against the plain rule,
feeding every row in order and stepping the last, bit for bit, with rows arriving in
chunks of any size."""
import numpy as np
import pytest

from kvviz.core import harness
from kvviz.core.policies import POLICIES, Policy, make_policy
from kvviz.core.policies.tova import Tova

CASES = [("tova", {}), ("h2o", {"recent_window": 3}), ("snapkv", {"obs_window": 4, "recent_window": 2}),
         ("snapkv", {"obs_window": 40, "recent_window": 2, "pooling": "avg"}),
         ("scissorhands", {"history_window": 5, "recent_window": 2}), ("streaming-llm", {"sinks": 2}),
         ("knorm", {}), ("random", {})]


def rows_for(T, seed, ties=False):
    """(T, T) float32: row t a causal attention row over 0..t-1 (its own weight dropped),
    scaled unevenly so the harness's renormalisation matters; `ties`: coarse values."""
    rng = np.random.default_rng(seed)
    raw = rng.random((T, T)) ** 3
    if ties:
        raw = np.round(raw * 4) / 4
    raw[np.triu_indices(T)] = 0
    return (raw * rng.uniform(0.2, 1.0, (T, 1))).astype(np.float32)


def streamed(policy, raw, budget, norms):
    T = len(raw)
    for t in range(T - 1):
        harness.feed(policy, t, raw[t, :t], norms[t])
    return harness.step(policy, T - 1, raw[T - 1, :T - 1], budget, norms[T - 1])


def shortcut(policy, raw, budget, norms, chunk):
    T = len(raw)
    tail, sums, stream = harness.prefill_needs(policy, T)
    rows = harness.PromptRows(T, tail, sums, [policy] if stream else [])
    for a in range(0, T, chunk):
        rows.add(a, raw[a:a + chunk], norms)
    return harness.prefill(policy, rows, T, budget, norms)


def same_state(a, b):
    assert a.kept.tolist() == b.kept.tolist()
    sa, sb = a.scores(), b.scores()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert np.array_equal(sa[k], sb[k], equal_nan=True), k


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("T,budget", [(1, 4), (2, 1), (9, 4), (37, 12), (64, 20)])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_prefill_shortcut_equals_streaming_every_row(name, params, T, budget, chunk):
    floor = max(params.get("sinks", 0), params.get("recent_window", 0)) + 1
    budget = max(budget, floor)  # each policy's own rule: a window below the budget
    for seed, ties in ((0, False), (1, True)):
        raw = rows_for(T, seed, ties)
        norms = np.random.default_rng(seed + 5).random(T).astype(np.float32)
        a = make_policy(name, budget=budget, rng=np.random.default_rng(3), **params)
        b = make_policy(name, budget=budget, rng=np.random.default_rng(3), **params)
        want = streamed(a, raw, budget, norms)
        got = shortcut(b, raw, budget, norms, chunk or T)
        assert got.tolist() == want.tolist(), (seed, ties)
        same_state(a, b)


def test_each_attention_policy_declares_how_much_of_the_prompt_it_reads():
    T = 100
    need = {name: harness.prefill_needs(make_policy(name, budget=64), T) for name in POLICIES}
    assert need["tova"] == (1, False, False)  # the last row only
    assert need["h2o"] == (1, True, False)  # the sum, then the last row
    assert need["snapkv"] == (16, False, False)  # its obsWindow
    assert need["scissorhands"] == (32, False, False)  # its historyWindow
    for name in ("streaming-llm", "knorm", "random"):
        assert need[name] == (0, False, False)  # no attention at all


class EveryRow(Tova):
    """TOVA without its shortcut declaration: a plugin that keeps the default."""

    name = "every-row"

    def prefill_rows(self, prompt_len):
        return Policy.prefill_rows(self, prompt_len)


def test_a_policy_without_a_shortcut_streams_every_row_and_agrees():
    raw = rows_for(30, 4)
    norms = np.ones(30, np.float32)
    plain, short = Tova(budget=10), EveryRow(budget=10)
    assert harness.prefill_needs(short, 30) == (1, False, True)
    assert shortcut(short, raw, 10, norms, 7).tolist() == streamed(plain, raw, 10, norms).tolist()
    same_state(plain, short)


def test_prefill_refuses_what_it_cannot_do_exactly():
    raw = rows_for(10, 0)
    rows = harness.PromptRows(10, 1, True)  # a sum needs every row
    rows.add(0, raw[:4])
    with pytest.raises(ValueError, match="prompt rows must arrive in order: expected row 4, got 5"):
        rows.add(5, raw[5:])
    tail = harness.PromptRows(10, 3, False)  # the last 3 rows only: earlier ones may be left out
    assert not tail.wants(0, 7) and tail.wants(0, 8)
    tail.add(6, raw[6:])
    assert tail.next == 10 and np.array_equal(tail.row(9), raw[9, :9])
    with pytest.raises(ValueError, match="4 of 10 prompt rows arrived"):
        harness.prefill(Tova(budget=3), rows, 10, 3)
    rows.add(4, raw[4:])
    with pytest.raises(ValueError, match="needs the prompt.s last 4 rows"):
        harness.prefill(make_policy("snapkv", budget=3, recent_window=1, obs_window=4), rows, 10, 3)
    with pytest.raises(ValueError, match="and their sum"):
        harness.prefill(make_policy("h2o", budget=3, recent_window=1), tail, 10, 3)
    with pytest.raises(ValueError, match="streams every row: give it to PromptRows"):
        harness.prefill(EveryRow(budget=3), rows, 10, 3)
