"""VATP: accumulated attention x value L2 norm; value norms through the harness, replay and
layers; refused in one line where a trace has none. Expected victims are worked by hand.
(Its differential run against RefVATP is tests/test_policies.py's, with every policy's.)"""
from __future__ import annotations

import numpy as np
import pytest

from kvviz.core import harness
from kvviz.core.layers import replay_layers
from kvviz.core.policies import make_policy
from kvviz.core.reference import RefVATP
from kvviz.core.replay import Replay, run_policy, runnable
from kvviz.core.trace import ArrayTrace, canonical, pack_rows

ROWS = [[], [1.0], [0.5, 0.5], [0.25, 0.25, 0.5], [0.1, 0.3, 0.0, 0.6]]
VALUES = [0.01, 1.0, 4.0, 1.0, 1.0]


def _fed(name, **params):
    p = make_policy(name, 4, **params)
    for t, (row, v) in enumerate(zip(ROWS, VALUES)):
        p.on_decode_step(t, row, **({"value_norm": v} if name == "vatp" else {}))
    return p


def test_the_value_norm_changes_the_victim_by_hand():
    # accumulated after step 4: pos 0 1.85, pos 1 1.05, pos 2 0.5, pos 3 0.6, pos 4 0
    # x value norms 0.01, 1, 4, 1, 1 -> 0.0185, 1.05, 2.0, 0.6, 0
    # sinks 1 protect pos 0, recent 1 protects pos 4: of 1.05, 2.0, 0.6 the lowest, pos 3, goes
    assert _fed("vatp", sinks=1, recent_window=1).evict(4).tolist() == [3]
    # H2O on the same rows (no value norms) drops the lowest accumulated: pos 2 (0.5)
    assert _fed("h2o", recent_window=1).evict(4).tolist() == [2]
    # without sinks, pos 0's tiny value norm makes it the lowest (0.0185)
    assert _fed("vatp", sinks=0, recent_window=1).evict(4).tolist() == [0]
    # two victims: 0.6 (pos 3), then 1.05 (pos 1)
    assert _fed("vatp", sinks=1, recent_window=1).evict(3).tolist() == [1, 3]


def test_vatp_scores_are_the_product_it_ranks_by():
    s = _fed("vatp", sinks=1, recent_window=1).scores()
    np.testing.assert_allclose(s["cumulative"], [1.85, 1.05, 0.5, 0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(s["vatp"], [0.0185, 1.05, 2.0, 0.6, 0.0], rtol=1e-6)
    assert s["candidate"].tolist() == [False, True, True, True, False]


def test_vatp_refuses_a_missing_norm_and_bad_parameters():
    p = make_policy("vatp", 8, sinks=1, recent_window=1)
    with pytest.raises(ValueError, match="vatp reads value norms, and none was given"):
        p.on_decode_step(0, [])
    with pytest.raises(ValueError, match="value_norm must be a finite non-negative L2 norm"):
        p.on_decode_step(0, [], value_norm=-1.0)
    with pytest.raises(ValueError, match="sinks \\+ recent_window must be smaller than budget"):
        make_policy("vatp", 8, sinks=4, recent_window=4)


def _trace(steps, values=None, head="mean"):
    rng = np.random.default_rng(steps)
    m = np.tril(rng.random((steps, steps)), -1).astype(np.float32)
    tr = ArrayTrace(pack_rows(m), steps, name="hand", value_norms=values)
    tr.head, tr.layer = head, 0
    return tr


def test_replay_passes_value_norms_and_refuses_a_trace_without_them_in_one_line():
    with pytest.raises(ValueError) as exc:
        Replay(canonical(10), make_policy("vatp", 8, sinks=1, recent_window=1))
    assert str(exc.value) == ("vatp reads value norms, and trace 'canonical' has none: pick a trace "
                              "captured with value norms (format version 4, kvviz capture)")
    assert "vatp" not in runnable(canonical(10)) and "tova" in runnable(canonical(10))
    values = np.linspace(2.0, 0.5, 40).astype(np.float32)
    trace = _trace(40, values)
    assert "vatp" in runnable(trace)
    run = run_policy(trace, "vatp", 8, sinks=1, recent_window=2)
    ref = RefVATP(8, None, sinks=1, recent_window=2)
    want = np.full(40, -1)
    for t in range(40):
        harness.feed(ref, t, trace.row(t)[ref.held()], None, float(values[t]))
        want[ref.evict(8)] = t
    assert run.evicted_at.tolist() == want.tolist()


def test_an_allocator_with_a_value_norm_scorer_reads_each_heads_norms():
    with pytest.raises(ValueError, match="vatp reads value norms, and trace 'hand' has none"):
        replay_layers([[_trace(30, head=f"kv{g}") for g in range(2)]],
                      make_policy("adakv", 8, scorer="vatp", sinks=1, recent_window=1))
    values = [np.full(30, 1.0, np.float32), np.full(30, 3.0, np.float32)]
    grid = [[_trace(30, values[g], head=f"kv{g}") for g in range(2)]]
    run = replay_layers(grid, make_policy("adakv", 8, scorer="vatp", sinks=1, recent_window=1))
    assert run.held_at_end()[0].sum() == 16
