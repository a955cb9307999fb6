"""The harness and the metrics, checked on tiny traces worked out by hand."""
import numpy as np
import pytest

from kvviz.core.metrics import hh_recall, retained_mass, summary
from kvviz.core.policies import make_policy
from kvviz.core.replay import NEVER, Replay, run_policy
from kvviz.core.trace import ArrayTrace, canonical, pack_rows


def tiny():
    """Row 1 = [1], row 2 = [.25, .75], row 3 = [.5, .25, .25]."""
    m = np.zeros((4, 4), np.float32)
    m[1, 0] = 1
    m[2, :2] = [0.25, 0.75]
    m[3, :3] = [0.5, 0.25, 0.25]
    return ArrayTrace(pack_rows(m), 4, name="tiny")


def test_tova_on_the_tiny_trace():
    # step 1: 0 observed at 1.0, 1 unobserved -> 0 goes; step 2: 1 goes; step 3: 2 goes
    run = run_policy(tiny(), "tova", 1)
    assert run.evicted_at.tolist() == [1, 2, 3, NEVER]
    assert run.first_eviction == 1
    assert retained_mass(run) == pytest.approx((0.75 + 0.25) / 2)  # row 2 on {1}, row 3 on {2}
    # at t=3 the top-1 by attention received (rows 1-2) is position 0 (1.25): not held
    assert hh_recall(tiny(), run) == 0.0


def test_h2o_on_the_tiny_trace():
    # position 0 accumulates; every newcomer scores 0 and is dropped at once
    run = run_policy(tiny(), "h2o", 1, recent_window=0)
    assert run.evicted_at.tolist() == [NEVER, 1, 2, 3]
    assert retained_mass(run) == pytest.approx((0.25 + 0.5) / 2)
    assert hh_recall(tiny(), run) == 1.0
    assert summary(tiny(), run)["attention_loss"] == pytest.approx(1 - 0.375)
    assert summary(tiny(), run)["memory_bytes"] == 13


def test_harness_feeds_renormalised_held_rows():
    """Replay against a hand-driven policy fed row[kept] / row[kept].sum()."""
    trace = canonical(700)
    replay = Replay(trace, make_policy("h2o", 64))
    manual = make_policy("h2o", 64)
    for t in range(700):
        held = trace.row(t)[manual.kept].astype(np.float64)
        manual.on_decode_step(t, (held / held.sum()).astype(np.float32) if t else held)
        assert replay.step().tolist() == manual.evict(64).tolist()
    assert np.array_equal(manual.scores()["cumulative"], replay.policy.scores()["cumulative"])


@pytest.mark.parametrize("name", ["tova", "snapkv", "streaming-llm", "random"])
def test_log_gives_the_held_set_at_every_step(name):
    trace = canonical(300)
    replay = Replay(trace, make_policy(name, 40))
    run = None
    for t in range(300):
        replay.step()
        held = replay.policy.kept.tolist()
        assert len(held) == min(t + 1, 40)
        snapshot = held
        if t == 150:
            mid = snapshot
    run = replay.run()
    assert run.held_at(150).tolist() == mid
    assert run.held_at(299).tolist() == snapshot


def test_seek_back_and_forth_matches_a_fresh_run():
    trace = canonical(400)
    fresh = run_policy(trace, "snapkv", 48)
    replay = Replay(trace, make_policy("snapkv", 48))
    replay.seek(300)
    kept_300 = replay.policy.kept.tolist()
    replay.seek(100)
    assert replay.t == 101
    assert replay.policy.kept.tolist() == fresh.held_at(100).tolist()
    replay.seek(300)
    assert replay.policy.kept.tolist() == kept_300 == fresh.held_at(300).tolist()
    assert np.array_equal(replay.run().evicted_at, fresh.evicted_at)
    with pytest.raises(ValueError, match="step"):
        replay.seek(400)


def test_peek_shows_the_ranking_before_the_eviction_and_changes_nothing():
    trace = canonical(300)
    replay = Replay(trace, make_policy("tova", 32))
    replay.seek(200)
    kept, scores = replay.peek(150)
    assert len(kept) == 33 and kept[-1] == 150  # admitted, not yet evicted
    assert np.isnan(scores["last"][-1]) and not scores["candidate"][-1]
    run = run_policy(trace, "tova", 32)
    victim = kept[int(np.nanargmin(scores["last"]))]
    assert run.evicted_at[victim] == 150
    assert replay.t == 201


def test_retained_shares_match_brute_force():
    trace = canonical(260)
    run = run_policy(trace, "h2o", 50)
    for t in (51, 120, 259):
        held = [p for p in range(t) if run.evicted_at[p] == NEVER or run.evicted_at[p] >= t]
        row = trace.row(t).astype(np.float64)
        assert run.retained[t] == pytest.approx(row[held].sum() / row.sum(), rel=1e-12)


def test_runs_are_bit_identical():
    trace = canonical(500)
    for name in ("snapkv", "random", "scissorhands"):
        a, b = run_policy(trace, name, 64), run_policy(trace, name, 64)
        assert np.array_equal(a.evicted_at, b.evicted_at)
        assert np.array_equal(a.retained, b.retained, equal_nan=True)


@pytest.mark.parametrize("name", ["snapkv", "random", "h2o"])
def test_checkpoints_change_nothing_but_speed(name):
    trace = canonical(600)
    fresh = run_policy(trace, name, 48)
    plain = Replay(trace, make_policy(name, 48))
    replay = Replay(trace, make_policy(name, 48), checkpoint_every=64)
    replay.seek(599)
    for back in (450, 128, 127, 0, 300):
        replay.seek(back)
        assert replay.t == back + 1
        assert replay.policy.kept.tolist() == fresh.held_at(back).tolist()
        kept, scores = replay.peek(back + 37)
        kept_plain, scores_plain = plain.peek(back + 37)
        assert kept.tolist() == kept_plain.tolist()
        for key in scores:
            assert np.array_equal(scores[key], scores_plain[key], equal_nan=True), key
    assert np.array_equal(replay.run().evicted_at, fresh.evicted_at)
    with pytest.raises(ValueError, match="checkpoint_every"):
        Replay(trace, make_policy(name, 48), checkpoint_every=0)


class BrokenTrace(canonical(50).__class__):
    """A custom Trace whose row 30 carries a bad weight: the harness must refuse it."""

    def __init__(self, bad):
        super().__init__(steps=50)
        self.bad = bad

    def row(self, i):
        row = super().row(i)
        if i == 30:
            row[5] = self.bad
        return row


@pytest.mark.parametrize("bad", [np.nan, np.inf, -0.5])
def test_harness_refuses_bad_rows_from_custom_traces(bad):
    with pytest.raises(ValueError, match="row 30"):
        run_policy(BrokenTrace(bad), "tova", 64)


@pytest.mark.parametrize("name, params", [("h2o", {"recent_window": 8}), ("snapkv", {}),
                                          ("knorm", {}), ("vatp", {})])
def test_the_replay_steps_one_stream_group_as_the_harness_steps_the_policy(name, params):
    """The replay goes through the eviction protocol (a OnePolicy stream group) and logs
    what stepping the policy by kvviz.core.harness.step directly evicts, key and value
    norms fed to the policies that read them."""
    from kvviz.core import harness
    from kvviz.core.groups import OnePolicy, StreamGroup

    base, m = canonical(300), np.zeros((300, 300), np.float32)
    for t in range(300):
        m[t, :t] = base.row(t)
    rng = np.random.default_rng(3)
    trace = ArrayTrace(pack_rows(m), 300, name="normed", key_norms=rng.uniform(0.5, 4, 300),
                       value_norms=rng.uniform(0.5, 4, 300))
    replay = Replay(trace, make_policy(name, 40, **params))
    assert isinstance(replay.group, OnePolicy) and isinstance(replay.group, StreamGroup)
    assert replay.group.size == 1 and replay.group.capacity == 40
    assert replay.group.reads_key_norms == (name == "knorm")
    assert replay.group.reads_value_norms == (name == "vatp")
    run = replay.run()

    policy = make_policy(name, 40, **params)
    want, held = np.full(300, NEVER, np.int64), np.zeros(300, np.int64)
    for t in range(300):
        raw = trace.row(t)[policy.held()] if policy.uses_attention else None
        want[harness.step(policy, t, raw, 40, trace.key_norm(t), value_norm=trace.value_norm(t))] = t
        held[t] = len(policy.held())
    assert (want != NEVER).any()
    assert run.evicted_at.tolist() == want.tolist() and run.held.tolist() == held.tolist()
    assert replay.group.kept(0).tolist() == policy.kept.tolist()
