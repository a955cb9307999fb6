"""The policy API a plugin author writes against: `candidates()` is enforced (by the base
class's choice and by `kvviz check`), a subclass that adds no fields needs no @dataclass,
and a policy that stores its ranked score gets `scores()` and `bytes_per_slot` for free."""
import textwrap
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvviz.core import harness, plugins
from kvviz.core.check import CONTRACT, check_policy
from kvviz.core.policies import POLICIES, make_policy, register_policy, unregister_policy
from kvviz.core.policies.h2o import H2O
from kvviz.core.policies.tova import Tova
from kvviz.core.replay import Replay
from kvviz.core.trace import canonical
from kvviz.policies.base import Policy, Rank, param

SINKS = 4
STEPS = 160  # as test_check: the contract run at budget 64, evictions at budgets 16 and 64
CANDIDATES_RULE = f"contract: {CONTRACT['candidates']}"


def failing(results):
    return {f"{r.rule}: {r.name}" for r in results if not r.passed}


# -- candidates() is enforced -------------------------------------------------------------------
@dataclass
class SinkSum(Policy):
    """Accumulated attention with four attention sinks. `candidates()` protects the sinks;
    `priority()` is the plain sum and does not give them +inf (the trap under test)."""

    name = "sink-sum"
    label = "accumulated attention + sinks"
    rank = Rank("total", "accumulated attention", "lowest accumulated attention goes first")

    def check_params(self):
        if self.budget <= SINKS:
            raise ValueError(f"budget must exceed the {SINKS} sinks, got {self.budget}")

    def columns(self):
        return {"total": (np.float64, (), 0.0)}

    def observe(self, attn):
        total = self.col("total")
        total += attn

    def candidates(self):
        cand = super().candidates()
        cand[:SINKS] = False
        return cand

    def priority(self):
        return self.col("total")


@dataclass
class SinkSumBypass(SinkSum):
    """Ranks every slot by its score itself, skipping the base class's candidate mask."""

    def choose(self, count):
        return np.sort(np.argsort(self.priority(), kind="stable")[:count])


def sink_starved_row(n, rng, sink_share):
    """A row on n kept slots where the slots at the four lowest indices (the sinks, once
    admitted) get `sink_share` times a random weight, so a score ranks them lowest."""
    row = rng.random(n).astype(np.float32) + np.float32(0.01)
    row[:SINKS] *= np.float32(sink_share)
    return row


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(budget=st.integers(SINKS + 1, 12), steps=st.integers(SINKS + 1, 60),
       sink_share=st.sampled_from([0.0, 1e-6, 0.5, 1.0]), seed=st.integers(0, 2**32 - 1),
       every=st.integers(1, 4))
def test_the_base_class_never_evicts_a_slot_candidates_excluded(budget, steps, sink_share, seed,
                                                                every):
    """Over any run, with sinks starved of attention or not, and one victim at a time or
    several (evicting only every `every` steps), positions 0-3 stay and the budget holds."""
    policy = SinkSum(budget=budget)
    rng = np.random.default_rng(seed)
    for pos in range(steps):
        policy.on_decode_step(pos, sink_starved_row(len(policy.kept), rng, sink_share))
        if pos % every == 0 or pos == steps - 1:
            victims = policy.evict(budget)
            assert not np.isin(victims, np.arange(SINKS)).any(), (pos, victims)
            assert len(policy.kept) == min(budget, pos + 1)
    assert list(policy.kept[:SINKS]) == list(range(SINKS))


def test_the_same_run_without_the_mask_evicts_a_sink():
    """The scenario above is a real trap: ranking by the score alone takes a starved sink."""
    budget, rng = 8, np.random.default_rng(0)
    masked, bypass = SinkSum(budget=budget), SinkSumBypass(budget=budget)
    gone = {"masked": [], "bypass": []}
    for pos in range(40):
        row = sink_starved_row(len(masked.kept), rng, 0.0)
        for key, policy in (("masked", masked), ("bypass", bypass)):
            gone[key] += harness.step(policy, pos, row, budget).tolist()
    assert not set(gone["masked"]) & set(range(SINKS))
    assert set(gone["bypass"]) & set(range(SINKS))


def test_fewer_candidates_than_victims_is_refused_not_filled_from_the_protected():
    """With too few candidates the protected slots are not taken instead: a ValueError
    saying so, for one victim (which used to take the lowest-scoring sink) and for several."""
    policy = SinkSum(budget=5)
    for pos in range(SINKS):
        policy.on_decode_step(pos, np.zeros(len(policy.kept), np.float32))
    with pytest.raises(ValueError, match="needs 1 victims but only 0 slots are candidates"):
        policy.evict(SINKS - 1)
    policy.on_decode_step(SINKS, np.ones(SINKS, np.float32))
    with pytest.raises(ValueError, match="needs 2 victims but only 1 slots are candidates"):
        policy.evict(SINKS - 1)
    assert list(policy.kept) == list(range(SINKS + 1))  # a refusal evicts nothing
    assert list(policy.evict(SINKS)) == [SINKS]


def test_kvviz_check_passes_the_masked_policy_and_fails_the_bypass_on_that_rule_only():
    assert failing(check_policy(SinkSum, steps=STEPS, speed=False)) == set()
    results = check_policy(SinkSumBypass, steps=STEPS, speed=False)
    assert failing(results) == {CANDIDATES_RULE}
    detail = next(r.detail for r in results if f"{r.rule}: {r.name}" == CANDIDATES_RULE)
    victims = detail.split("victims [")[1].split("]")[0]
    assert "step" in detail and set(map(int, victims.split(", "))) <= set(range(SINKS)), detail


def test_the_command_exits_1_and_prints_the_failed_rule(tmp_path, capsys):
    from kvviz.core.check import main

    path = tmp_path / "bypass.py"
    path.write_text(textwrap.dedent('''
        from dataclasses import dataclass

        import numpy as np
        from kvviz.core.policies.h2o import H2O

        @dataclass
        class Greedy(H2O):
            """H2O that ranks its protected recent window too."""
            name = "greedy"
            label = "greedy"

            def choose(self, count):
                return np.sort(np.argsort(self.priority(), kind="stable")[:count])
        '''))
    assert main([f"{path}:Greedy", "--steps", str(STEPS)]) == 1
    fails = [line.strip() for line in capsys.readouterr().out.splitlines() if "FAIL" in line]
    assert fails[0].endswith(": FAIL")  # the policy's line, then its one failed rule
    assert len(fails) == 2 and fails[1].startswith(f"FAIL  {CANDIDATES_RULE} -- step"), fails


# -- a subclass that adds no fields needs no decorator ------------------------------------------
@pytest.fixture
def registry():
    """Names registered in a test are removed after it, so later files count the built-ins."""
    before = set(POLICIES)
    yield
    for name in set(POLICIES) - before:
        unregister_policy(name)


def test_a_field_less_subclass_registers_and_runs_as_its_parent(registry):
    class Mine(Tova):
        name = "mine"
        label = "TOVA under another name"
        colour: ClassVar[str] = "#123456"  # a ClassVar annotation is not a field

    assert register_policy(Mine) is Mine
    rng = np.random.default_rng(3)
    mine, tova = make_policy("mine", budget=6), make_policy("tova", budget=6)
    for pos in range(30):
        row = rng.random(len(tova.kept)).astype(np.float32)
        assert list(harness.step(mine, pos, row, 6)) == list(harness.step(tova, pos, row, 6))
    assert Mine.colour == "#123456" and repr(Mine(budget=6)).endswith(".Mine(budget=6)")


def test_a_field_less_subclass_keeps_its_parents_parameters_and_their_rules(registry):
    class Short(H2O):
        name = "short-h2o"
        label = "H2O, registered again"

    register_policy(Short)
    assert [s.name for s in Short.specs] == ["recent_window"]
    with pytest.raises(ValueError, match="recent_window must be >= 0"):
        make_policy("short-h2o", budget=16, recent_window=-1)
    with pytest.raises(ValueError, match="has no parameter"):
        make_policy("short-h2o", budget=16, window=3)
    policy = make_policy("short-h2o", budget=8, recent_window=3)
    for pos in range(20):
        victims = harness.step(policy, pos, np.ones(len(policy.kept), np.float32), 8)
        assert not np.isin(victims, np.arange(pos - 2, pos + 1)).any()  # the 3 newest stay


def test_an_undecorated_subclass_that_adds_fields_is_still_refused(registry):
    class Extra(H2O):
        name = "extra"
        label = "H2O with one more knob"
        boost: float = param(1.0, label="boost", min=0.0, max=4.0, help="h", source="s")

    with pytest.raises(ValueError, match="Extra must be decorated with @dataclass"):
        register_policy(Extra)

    @dataclass
    class Decorated(H2O):
        name = "decorated"
        label = "H2O with one more knob"
        boost: float = param(1.0, label="boost", min=0.0, max=4.0, help="h", source="s")

    register_policy(Decorated)
    assert make_policy("decorated", budget=64, boost=2).boost == 2.0


def test_a_plugin_file_without_the_decorator_loads(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent('''
        from kvviz.core.policies.tova import Tova

        class Mine(Tova):
            name = "mine"
            label = "TOVA, renamed"
        '''))
    try:
        assert plugins.load_plugins([str(path)]) == []
        assert POLICIES["mine"].label == "TOVA, renamed"
    finally:
        plugins.forget()
    assert "mine" not in POLICIES


# -- scores() and bytes_per_slot from the declared rank and columns -----------------------------
class Minimal(Policy):
    """Only a name, a label, a rank, and columns / observe / priority: no decorator either."""

    name = "minimal"
    label = "accumulated attention, minimal"
    rank = Rank("total", "accumulated attention", "lowest accumulated attention goes first")

    def columns(self):
        return {"total": (np.float64, (), 0.0)}

    def observe(self, attn):
        total = self.col("total")
        total += attn

    def priority(self):
        return self.col("total")


def test_a_minimal_policy_passes_kvviz_check():
    assert failing(check_policy(Minimal, steps=STEPS, speed=False)) == set()


def test_a_minimal_policys_scores_are_its_rank_column():
    policy = Minimal(budget=64)
    rng = np.random.default_rng(1)
    rows = []
    for pos in range(5):
        rows.append(rng.random(len(policy.kept)).astype(np.float32))
        policy.on_decode_step(pos, rows[-1])
    expected = [sum(float(r[i]) for r in rows[i + 1:]) for i in range(5)]  # rows after admission
    scores = policy.scores()
    assert set(scores) == {"total", "candidate"}
    assert scores["total"] == pytest.approx(expected)
    assert scores["candidate"].dtype == bool and scores["candidate"].all()
    scores["total"][:] = -1.0  # a copy: the view cannot edit the policy's state
    assert policy.scores()["total"] == pytest.approx(expected)


def test_a_minimal_policy_replays_reports_memory_and_is_explained(registry):
    from kvviz.app.explain import eviction_order

    register_policy(Minimal)
    trace = canonical(96)
    replay = Replay(trace, make_policy("minimal", budget=32))
    run = replay.run()
    assert run.bytes_per_slot == 4 + 8 + 1  # position, one double, eviction scratch
    kept, scores = replay.peek(80)
    order = eviction_order("minimal", kept, scores)
    assert np.all(np.diff(scores["total"][order]) >= 0)  # the documented order: lowest first


def test_no_default_score_without_a_rank_or_for_a_derived_one():
    """Without a rank, or when the rank names no stored per-slot column, only the mask."""
    class Unranked(Minimal):
        rank = None

    class Derived(Minimal):
        rank = Rank("pooled", "pooled", "lowest pooled goes first")

    for cls in (Unranked, Derived):
        policy = cls(budget=8)
        policy.on_decode_step(0, None)
        assert set(policy.scores()) == {"candidate"}
