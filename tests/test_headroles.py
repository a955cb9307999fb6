"""Head roles: retrieval heads by a calibration proxy, streaming heads at sinks + recent.

Every expected value here is worked out by hand from the rule in the module's docstring.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvviz.core import harness
from kvviz.core.check_alloc import check_allocator
from kvviz.core.layers import load_layers, replay_layers
from kvviz.core.policies import make_policy
from kvviz.core.policies.headroles import outside_share
from kvviz.core.trace import ArrayTrace, pack_rows


def test_the_proxy_is_the_mass_outside_sinks_and_the_recent_window():
    # sinks 1, recent 2: row t (length t) has positions 1..t-3 outside; rows 0..3 have none
    rows = [np.zeros(t) for t in range(4)] + [np.array([0.5, 0.25, 0.0, 0.125, 0.125]),
                                              np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
                                              np.array([1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 1.0])]
    # row 4: outside = position 1 -> 0.25 / 1; row 5 has no mass (skipped);
    # row 6: outside = positions 1..4 -> 2 / 4 = 0.5; mean 0.375
    assert outside_share(rows, 1, 2) == 0.375
    assert outside_share(rows[:4], 1, 2) == 0.0  # nothing outside anywhere


def _layer(patterns, steps):
    """One layer of KV-head traces: head g's row t puts all its mass on pattern(t)."""
    out = []
    for g, pattern in enumerate(patterns):
        m = np.zeros((steps, steps), np.float32)
        for t in range(1, steps):
            m[t, pattern(t)] = 1.0
        out.append(ArrayTrace(pack_rows(m), steps, name="hand"))
        out[-1].head = f"kv{g}"
        out[-1].layer = 0
    return out


def test_a_head_that_looks_far_back_becomes_the_retrieval_head():
    # head 0 looks at the previous position, head 1 at position 2 (outside sinks 1 and
    # recent 2 from row 5 on), head 2 at position 0 (the sink): only head 1 has mass outside
    steps = 24
    grid = [_layer([lambda t: t - 1, lambda t: min(2, t - 1), lambda t: 0], steps)]
    alloc = make_policy("headroles", 8, share=0.2, stream_sinks=1, stream_recent=2,
                        calibration=12)
    run = replay_layers(grid, alloc)
    roles = run.states[0]
    assert roles.retrieval == (False, True, False)
    # rows 4..11 of 12 have a position outside (1..t-3); head 1's mass at 2 is outside from
    # row 5 on, inside row 4's recent window (2, 3): 7 of 8 rows -> 0.875
    assert roles.proxy[1] == 0.875 and roles.proxy[0] == roles.proxy[2] == 0.0
    # ceil(0.2 x 3) = 1 retrieval head; streaming heads hold 1 + 2 = 3 slots each; the
    # retrieval head the rest of 3 x 8 = 24: 24 - 2 x 3 = 18
    assert roles.budgets == (3, 18, 3)
    assert run.held_at_end()[0].tolist() == [3, 18, 3]
    # a streaming head keeps its sink and its two newest positions
    kept = [np.flatnonzero(r.evicted_at == -1).tolist() for r in run.runs[0]]
    assert kept[0] == [0, steps - 2, steps - 1] and kept[2] == [0, steps - 2, steps - 1]
    assert 2 in kept[1]  # the retrieval head's scorer (tova) keeps what it attends to


def test_the_remainder_goes_to_the_retrieval_heads_with_the_largest_proxy():
    alloc = make_policy("headroles", 10, share=0.5, stream_sinks=0, stream_recent=3)
    # 4 heads, ceil(0.5 x 4) = 2 retrieve: heads 3 (0.9) and 1 (0.5); pool 40 - 2 x 3 = 34
    roles = alloc.roles([0.1, 0.5, 0.2, 0.9], 10)
    assert roles.retrieval == (False, True, False, True) and roles.budgets == (3, 17, 3, 17)
    # 3 heads, 2 retrieve: heads 2 and 0 (a tie with head 1 goes to the lower head);
    # pool 30 - 3 = 27: 14 to head 2 (the largest proxy), 13 to head 0
    roles = alloc.roles([0.4, 0.4, 0.7], 10)
    assert roles.retrieval == (True, False, True) and roles.budgets == (13, 3, 14)
    assert alloc.cap(10, 3) == 14 and alloc.floor(10) == 3


def test_nothing_goes_until_the_layer_is_full_then_the_head_furthest_over_first():
    alloc = make_policy("headroles", 4, share=0.5, stream_sinks=1, stream_recent=1)
    group = alloc.group(0, 1, 2)
    # head 1 retrieves (proxy 1 > 0); streaming head 0 holds 2, head 1 holds 8 - 2 = 6
    group.calibrate([[np.zeros(t) for t in range(4)],
                     [np.zeros(0), np.ones(1), np.ones(2), np.array([0, 1, 0])]])
    assert group.state.budgets == (2, 6)
    victims = []
    for t in range(6):
        raws = [np.ones(len(p.held()), np.float32) for p in group.policies]
        victims.append([v.tolist() for v in harness.step_layer(group, t, raws)])
    # steps 0-3: 2 heads x 4 = 8 slots fill, nothing goes; step 4: 10 held, 2 over: head 0
    # is 3 over its 2, head 1 1 under its 6: head 0 gives both (its oldest non-sinks 1, 2);
    # step 5: 4 + 6 = 10 held, 2 over: head 0 is 2 over, head 1 at its 6: head 0 gives 3, 4
    assert victims == [[[], []]] * 4 + [[[1, 2], []], [[3, 4], []]]
    assert group.held_counts().tolist() == [2, 6]


def test_headroles_refuses_bad_parameters_and_an_uncalibrated_layer():
    with pytest.raises(ValueError, match="stream_sinks \\+ stream_recent must be at most the budget"):
        make_policy("headroles", 16)  # 4 + 28 > 16
    with pytest.raises(ValueError, match="share must be above 0"):
        make_policy("headroles", 64, share=0.0)
    with pytest.raises(ValueError, match="share must be in 0.0..1.0"):
        make_policy("headroles", 64, retrievalShare=1.5)
    group = make_policy("headroles", 4, stream_recent=1, stream_sinks=0).group(0, 1, 2)
    for t in range(5):
        for p in group.policies:
            harness.feed(p, t, np.ones(len(p.held()), np.float32))
    with pytest.raises(ValueError, match="headroles decides its heads' roles from calibration rows"):
        group.evict()


@pytest.mark.parametrize("params", [{"stream_recent": 8}, {"stream_recent": 4, "share": 0.3},
                                    {"stream_recent": 6, "scorer": "h2o", "recent_window": 2}])
def test_headroles_passes_the_allocator_contract(params):
    results = check_allocator(lambda b: make_policy("headroles", b, **params))
    assert all(r.passed for r in results), [r.line() for r in results if not r.passed]


def test_headroles_on_the_multi_head_trace_keeps_each_layers_total():
    grid = load_layers("traces/code-kv.npz")
    run = replay_layers(grid, make_policy("headroles", 64, scorer="snapkv"))
    for d, roles in enumerate(run.states):
        assert sum(roles.retrieval) == 2  # ceil(0.5 x 3)
        assert run.held_at_end()[d].sum() == 3 * 64
        assert sorted(run.held_at_end()[d].tolist()) == [32, 80, 80]  # 192 - 32 = 160 for two
