"""kvviz.core.streams against the harness: every stream's Run equals run_policy's, bit for bit."""
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvviz.core.policies import register_policy, unregister_policy
from kvviz.core.policies.base import Policy
from kvviz.core.policies.vectorised import StreamState, close_gap
from kvviz.core.replay import run_policy
from kvviz.core.streams import replay_streams, run_streams, vectorised_names
from kvviz.core.trace import ArrayTrace, Trace, canonical, load_trace, pack_rows
from kvviz.studies.streams_bench import check_lean

TRACES = sorted((Path(__file__).resolve().parent.parent / "traces").glob("*.npz"))
TIE_WEIGHTS = np.array([0.0, 0.0625, 0.125, 0.25, 0.5, 1.0], np.float32)


def assert_same_runs(runs, traces, name, budget, rng_seed=None, **params):
    assert len(runs) == len(traces)
    for trace, run in zip(traces, runs):
        rng = None if rng_seed is None else np.random.default_rng(rng_seed)
        ref = run_policy(trace, name, budget, rng=rng, **params)
        assert (run.policy, run.params, run.budget, run.steps, run.bytes_per_slot, run.trace_name) == \
            (ref.policy, ref.params, ref.budget, ref.steps, ref.bytes_per_slot, ref.trace_name)
        assert run.evicted_at.dtype == np.int64 and run.retained.dtype == np.float64
        assert run.evicted_at.tolist() == ref.evicted_at.tolist()
        assert run.retained.tobytes() == ref.retained.tobytes()  # bitwise, NaN at step 0 included


class RowTrace(Trace):
    """A trace that only has row(t): run_streams' path for traces not stored packed."""

    def __init__(self, matrix, name="rows"):
        self.matrix, self.steps, self.name = matrix, len(matrix), name

    def row(self, i):
        return self.matrix[self._check_step(i), :i].copy()


def matrices(S, T, seed, dtype):
    """S random (T, T) attention matrices: rows of tied weights, random, tiny, or all zero."""
    rng = np.random.default_rng(seed)
    out = np.zeros((S, T, T), np.float32)
    for s in range(S):
        for t in range(1, T):
            kind = rng.integers(0, 5)
            if kind == 0:
                out[s, t, :t] = rng.choice(TIE_WEIGHTS, size=t)
            elif kind == 1:
                out[s, t, :t] = rng.random(t, dtype=np.float32)
            elif kind == 2:  # near-equal and subnormal-sized weights: rounding and ties
                out[s, t, :t] = (1 + rng.integers(0, 3, t) * 2.0 ** -23) * 10.0 ** rng.integers(-40, 0)
            elif kind == 3:
                out[s, t, :t] = rng.random(t, dtype=np.float32) ** 8
            # kind 4: an all-zero row (mass 0: observed as is, not renormalised)
    return out.astype(dtype)


def make_traces(mats, layout):
    S, T = mats.shape[:2]
    if layout == "shared":  # rows of one 2-D array, as the layers of one loaded file
        packed = np.stack([pack_rows(m) for m in mats])
        return [ArrayTrace(packed[s], T, name=f"s{s}") for s in range(S)]
    if layout == "separate":
        return [ArrayTrace(pack_rows(m), T, name=f"s{s}") for s, m in enumerate(mats)]
    return [RowTrace(m.astype(np.float32), name=f"s{s}") for s, m in enumerate(mats)]


@st.composite
def cases(draw, name):
    budget = draw(st.integers(1, 10))
    params = {}
    if name in ("h2o", "snapkv"):
        params["recent_window"] = draw(st.integers(0, budget - 1))
    if name == "snapkv":
        # 1..4 wraps the ring many times in 40 steps; 8..12 crosses numpy's 8-way unrolled sum
        params["obs_window"] = draw(st.one_of(st.integers(1, 4), st.integers(8, 12)))
        params["pool_kernel"] = draw(st.sampled_from([1, 3, 5]))
        params["pooling"] = draw(st.sampled_from(["max", "avg"]))
    S, T = draw(st.integers(1, 4)), draw(st.integers(1, 40))
    mats = matrices(S, T, draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from([np.float16, np.float32])))
    return budget, params, make_traces(mats, draw(st.sampled_from(["shared", "separate", "rows"])))


def check_case(name, case):
    budget, params, traces = case
    assert_same_runs(run_streams(traces, name, budget, **params), traces, name, budget, **params)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases("tova"))
def test_tova_random_streams(case):
    check_case("tova", case)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases("h2o"))
def test_h2o_random_streams(case):
    check_case("h2o", case)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases("snapkv"))
def test_snapkv_random_streams(case):
    check_case("snapkv", case)


REAL_CONFIGS = [("tova", 512, {}), ("tova", 100, {}), ("h2o", 300, {}), ("snapkv", 200, {}),
                ("snapkv", 400, {"pool_kernel": 1, "obs_window": 3, "recent_window": 0}),
                ("snapkv", 200, {"pooling": "avg"})]


@pytest.mark.parametrize("path", [p for p in TRACES if p.stem != "toy"],  # toy: 1 layer, 16 steps
                         ids=lambda p: p.stem)
def test_shipped_traces_every_stored_stream(path):
    """All stored layers (and heads, where stored) of a shipped trace as the streams."""
    with np.load(path, allow_pickle=False) as npz:
        attn = npz["attn"]
    packed = attn.reshape(-1, attn.shape[-1])
    steps = load_trace(path).steps
    traces = [ArrayTrace(packed[s], steps, name=f"{path.stem}/{s}") for s in range(len(packed))]
    assert len(traces) >= 3
    for name, budget, params in REAL_CONFIGS:
        assert_same_runs(run_streams(traces, name, budget, **params), traces, name, budget, **params)


def test_loaded_traces_and_computed_rows():
    """Traces from load_trace (each its own array) and the canonical trace (rows computed)."""
    path = TRACES[0]
    loaded = [load_trace(path), load_trace(path.read_bytes(), name="again")]
    assert_same_runs(run_streams(loaded, "snapkv", 256), loaded, "snapkv", 256)
    computed = [canonical(400, seed=s) for s in range(3)]
    for name in vectorised_names():
        assert_same_runs(run_streams(computed, name, 64), computed, name, 64)


@pytest.mark.parametrize("name, params", [("streaming-llm", {"sinks": 2}), ("scissorhands", {}),
                                          ("random", {})])
def test_other_policies_fall_back_per_stream(name, params):
    traces = [canonical(200, seed=s) for s in range(2)]
    rng = np.random.default_rng(7)
    runs = run_streams(traces, name, 40, rng=rng, **params)
    assert_same_runs(runs, traces, name, 40, rng_seed=7, **params)  # a fresh rng per stream
    assert rng.integers(1 << 30) == np.random.default_rng(7).integers(1 << 30)  # caller's untouched


def test_replay_streams_is_the_log():
    traces = [canonical(300, seed=s) for s in range(2)]
    log = replay_streams(traces, "tova", 50)
    assert log.shape == (2, 300)
    assert [row.tolist() for row in log] == [run_policy(tr, "tova", 50).evicted_at.tolist() for tr in traces]


def test_refusals():
    traces = [canonical(50), canonical(60)]
    with pytest.raises(ValueError, match="at least one trace"):
        run_streams([], "tova", 8)
    with pytest.raises(ValueError, match="equal lengths"):
        run_streams(traces, "tova", 8)
    with pytest.raises(ValueError, match="pool_kernel must be odd"):
        run_streams(traces[:1], "snapkv", 8, pool_kernel=4, recent_window=0)
    with pytest.raises(ValueError, match="policy must be one of"):
        run_streams(traces[:1], "lru", 8)
    with pytest.raises(ValueError, match="vectorises"):
        replay_streams(traces[:1], "random", 8)


@pytest.mark.parametrize("bad", [-0.25, np.nan, np.inf])
def test_bad_weights_on_held_positions_are_refused_like_the_harness(bad):
    m = np.full((2, 6, 6), 0.5, np.float32)
    m[1, 5, 2] = bad  # row 5 of stream 1, a held position at budget 4 under tova
    traces = make_traces(np.tril(m, -1), "separate")
    with pytest.raises(ValueError, match="negative or non-finite"):
        run_policy(traces[1], "tova", 4)
    with pytest.raises(ValueError, match="trace row 5 of stream 1 has negative or non-finite"):
        run_streams(traces, "tova", 4)


def test_lean_baseline_evicts_what_tova_evicts():
    """The benchmark's baseline is only honest if it does the same work with the same result."""
    assert check_lean("tova", budget=512, steps=1500)
    assert check_lean("h2o", budget=64, steps=400)
    assert check_lean("snapkv", budget=64, steps=400)


def test_snapkv_sums_each_ring_from_slot_zero():
    """The card pins the sum's order: ring slot 0 upward. Position 0's ring ends as
    [s, 1, s, s] (s = 2**-53, slot = step mod 4): ((s + 1) + s) + s rounds to exactly 1.0,
    like every other candidate's sum, so the tie goes to the lower position, 0. Any other
    order that adds two of the s first ends above 1.0 and evicts position 1 instead."""
    s = 2.0 ** -53
    m = np.zeros((5, 5), np.float32)
    m[1, :1], m[2, :2], m[3, :3], m[4, :4] = [1], [s, 1], [s, 0, 1], [s, 0, 0, 1]
    other = np.tril(np.random.default_rng(3).random((5, 5), dtype=np.float32), -1)
    traces = make_traces(np.stack([m, other]), "shared")
    params = {"obs_window": 4, "pool_kernel": 1, "recent_window": 1}
    runs = run_streams(traces, "snapkv", 4, **params)
    assert runs[0].evicted_at.tolist() == [4, -1, -1, -1, -1]
    assert_same_runs(runs, traces, "snapkv", 4, **params)


def test_perf_streams_cli_prints_every_way(capsys):
    from kvviz.__main__ import main

    assert main(["perf", "--streams", "1,2", "--steps", "150", "--budget", "40"]) == 0
    out = capsys.readouterr().out
    for way in ("lean loop", "Replay", "run_streams S=2"):
        assert way in out
    assert out.count("victims same") == 12 and "DIFFERENT" not in out  # 3 policies x 4 ways


class PeakStreams(StreamState):
    """`Peak` over S streams, counting its victim calls (so a test sees it was used)."""

    victims = 0

    def __init__(self, policy, S, cap):
        super().__init__(policy, S, cap)
        self.peak, self.spare = np.zeros((S, cap)), np.zeros((S, cap))

    def observe(self, t, attn, n):
        np.maximum(self.peak[:, :n], attn, out=self.peak[:, :n])

    def admit(self, n):
        self.peak[:, n] = 0.0

    def victim(self, attn, n):
        type(self).victims += 1
        return self.peak[:, : n - 1].argmin(axis=1)  # the unobserved newcomer is protected

    def remove(self, i, stay):
        close_gap(self.spare, self.peak, stay)
        self.peak, self.spare = self.spare, self.peak


class Peak(Policy):
    """A plugin policy: the slot whose highest weight so far is lowest goes; the newcomer
    is protected until observed. Declares its vectorised form in its own class."""

    name = "peak-test"
    label = "Peak"
    vectorised = PeakStreams

    def columns(self):
        return {"peak": (np.float64, (), 0.0)}

    def observe(self, attn):
        peak = self.col("peak")
        np.maximum(peak, attn, out=peak)

    def protected_tail(self):
        return 1

    def priority(self):
        return self.col("peak")


class PeakSub(Peak):
    """A subclass that changes the rule: it must not inherit Peak's vectorised form."""

    name = "peak-sub-test"

    def priority(self):
        return -self.col("peak")


def test_a_plugin_policy_declaring_a_vectorised_form_is_stepped_by_it():
    register_policy(Peak)
    register_policy(PeakSub)
    try:
        assert "peak-test" in vectorised_names() and "peak-sub-test" not in vectorised_names()
        mats = matrices(3, 60, 11, np.float32)
        for layout in ("shared", "rows"):
            traces = make_traces(mats, layout)
            PeakStreams.victims = 0
            runs = run_streams(traces, "peak-test", 7)
            assert PeakStreams.victims == 60 - 7  # one batched victim call per evicting step
            assert_same_runs(runs, traces, "peak-test", 7)
            assert replay_streams(traces, "peak-test", 7).tolist() == [r.evicted_at.tolist() for r in runs]
            PeakStreams.victims = 0
            sub = run_streams(traces, "peak-sub-test", 7)  # per-stream replay, its own rule
            assert PeakStreams.victims == 0
            assert_same_runs(sub, traces, "peak-sub-test", 7)
            assert [r.evicted_at.tolist() for r in sub] != [r.evicted_at.tolist() for r in runs]
        with pytest.raises(ValueError, match="declares no vectorised form"):
            replay_streams(traces, "peak-sub-test", 7)
    finally:
        unregister_policy("peak-test")
        unregister_policy("peak-sub-test")


def test_builtins_declare_their_vectorised_form_in_their_own_file():
    from kvviz.core.policies import POLICIES

    for name in vectorised_names():
        cls = POLICIES[name]
        assert cls.vectorised.__module__ == cls.__module__
    assert {"tova", "h2o", "snapkv"} <= set(vectorised_names())


class TraceInputs:
    """Step t of S traces as a StreamGroup's inputs (kvviz.core.groups), stream s = trace s;
    `gather` reads keys laid out as s x T + position (the offsets Streams is built with)."""

    def __init__(self, traces, t):
        self.traces, self.t, self.T = traces, t, traces[0].steps

    def weights(self, s, held):
        return self.traces[s].row(self.t)[held]

    def gather(self, keys):
        return np.stack([self.weights(s, row - s * self.T) for s, row in enumerate(keys)])

    def key_norm(self, s):
        return self.traces[s].key_norm(self.t)

    def value_norm(self, s):
        return self.traces[s].value_norm(self.t)


def group_log(group, traces):
    """evicted_at (S, T) of a StreamGroup stepped through the traces."""
    from kvviz.core.replay import NEVER

    T = traces[0].steps
    log = np.full((len(traces), T), NEVER, np.int64)
    for t in range(T):
        streams, victims = group.step(t, TraceInputs(traces, t))
        assert streams.dtype == victims.dtype == np.int64 and len(streams) == len(victims)
        log[streams, victims] = t
    return log


def test_every_kind_of_stream_group_evicts_what_the_harness_does():
    """One protocol: the vectorised streams, one policy per stream and an allocator's layer
    groups, stepped by StreamGroup.step, give the logs of the harness's own replays."""
    from kvviz.core import harness
    from kvviz.core.groups import AllocatedLayers, PolicyLayers, Unevicted
    from kvviz.core.policies import make_policy
    from kvviz.core.streams import Streams

    traces = [canonical(160, seed=s) for s in range(4)]  # 2 layers x 2 heads
    T, L, G = 160, 2, 2
    want = [run_policy(tr, "h2o", 24, recent_window=4).evicted_at.tolist() for tr in traces]
    vectorised = Streams(make_policy("h2o", 24, recent_window=4), L * G, offsets=np.arange(L * G) * T)
    per_stream = PolicyLayers([[make_policy("h2o", 24, recent_window=4) for _ in range(G)] for _ in range(L)], 24)
    for group in (vectorised, per_stream):
        assert group.size == L * G and group.capacity == 24 and group.uses_attention
        assert group_log(group, traces).tolist() == want
        assert [group.kept(s).tolist() for s in range(L * G)] == \
            [np.flatnonzero(np.array(w) == -1).tolist() for w in want]

    alloc = make_policy("adakv", 24, scorer="snapkv", recent_window=4, obs_window=4)
    expect = [alloc.group(layer, L, G) for layer in range(L)]
    log = np.full((L * G, T), -1, np.int64)
    for t in range(T):
        for layer, group in enumerate(expect):
            rows = [traces[layer * G + g].row(t)[p.held()] for g, p in enumerate(group.policies)]
            for g, v in enumerate(harness.step_layer(group, t, rows)):
                log[layer * G + g, v] = t
    allocated = AllocatedLayers([alloc.group(layer, L, G) for layer in range(L)])
    assert allocated.capacity == max(g.cap for g in expect) and allocated.calibration_rows == 0
    assert group_log(allocated, traces).tolist() == log.tolist()
    assert (log != -1).any()

    full = Unevicted(L * G)
    assert group_log(full, traces).tolist() == [[-1] * T] * (L * G)
    assert full.kept(0).tolist() == list(range(T)) and full.stream_policy(0) is None
