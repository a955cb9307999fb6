"""kvviz check: the built-ins pass; a policy broken in one way fails that rule and no other."""
from dataclasses import dataclass

import numpy as np
import pytest

from kvviz.core.check import CONTRACT, check_policy, load_target, main
from kvviz.core.policies import POLICIES
from kvviz.core.policies.h2o import H2O
from kvviz.core.policies.random_policy import RandomPolicy
from kvviz.core.policies.tova import Tova
from kvviz.core.reference import RefTova

STEPS = 160  # enough for the contract run at budget 64 and evictions at budgets 16 and 64


def failing(results):
    return {f"{r.rule}: {r.name}" for r in results if not r.passed}


def contract(key):
    return f"contract: {CONTRACT[key]}"


REFUSALS = "refusals: out-of-range parameters and budget < 1 raise ValueError naming them"
NULL_ROWS = "robustness: null attention, all-zero and one-hot rows never raise"
DETERMINISM = "determinism: two runs with the same rng give identical logs"
DIFFERENTIAL = "differential: identical victims to the reference at every step"
RATIO = ("ratio: a ratio budget (0.25x): min(seen, max(floor, floor(seen / 4))) held after every "
         "step, victims the fixed budget's at that count")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_builtin_passes(name):
    results = check_policy(POLICIES[name], speed=False)
    assert failing(results) == set(), [r.line() for r in results]
    assert {r.rule for r in results} == {"contract", "determinism", "refusals", "robustness", "ratio"}


# -- one broken policy per rule ---------------------------------------------------------------
@dataclass
class Unsorted(Tova):
    def evict(self, budget):
        return super().evict(budget)[::-1]


@dataclass
class OneTooMany(Tova):
    def evict(self, budget):
        victims = super().evict(budget)
        if len(victims):
            victims = np.sort(np.concatenate([victims, super().evict(len(self.kept) - 1)]))
        return victims


@dataclass
class NotKept(Tova):
    """Reports the first position it ever evicted in place of a lower real victim."""

    def evict(self, budget):
        victims = super().evict(budget).copy()
        if len(victims):
            self.first = min(getattr(self, "first", victims[0]), victims[0])
            if self.first < victims[0]:
                victims[0] = self.first
        return victims


@dataclass
class EvictsUnderBudget(RandomPolicy):
    def evict(self, budget):
        if 1 < len(self.kept) <= budget:
            return super().evict(len(self.kept) - 1)
        return super().evict(budget)


@dataclass
class Nondeterministic(RandomPolicy):
    def reset_state(self):
        super().reset_state()
        self.rng = np.random.default_rng()  # fresh entropy, not the rng it was given


@dataclass
class NoRangeCheck(H2O):
    """Refuses only a recent window that leaves no room, so -1 (below its minimum) passes."""

    def __post_init__(self):
        self.rng = self.rng or np.random.default_rng(0)
        if self.recent_window >= self.budget:
            raise ValueError(f"recent_window must be smaller than budget, got {self.recent_window}")
        self.reset_state()


@dataclass
class NoBudgetCheck(Tova):
    def __post_init__(self):
        self.rng = self.rng or np.random.default_rng(0)
        self.reset_state()


@dataclass
class RaisesOnNull(Tova):
    def advance(self, pos, attn):
        if attn is None:
            raise RuntimeError("no attention this step")
        super().advance(pos, attn)


class RefTovaEvictsHighest(RefTova):
    def rank(self, i):
        return -self.state[i]


@pytest.mark.parametrize("cls, expected", [
    (Unsorted, {contract("ascending")}),
    # the ratio budget's run is a replay through the harness too: a wrong count fails it
    (OneTooMany, {contract("exact"), RATIO}),
    # the harness checks every step's victims against the held set, so a policy that reports
    # a position it no longer held cannot replay at all: every rule that replays it fails too
    (NotKept, {contract("kept"), DETERMINISM, NULL_ROWS, RATIO,
               "robustness: replays the canonical and every shipped trace at budgets 16, 64, 256"}),
    (EvictsUnderBudget, {contract("under"), RATIO}),
    (Nondeterministic, {DETERMINISM}),
    (NoRangeCheck, {REFUSALS}),
    (NoBudgetCheck, {REFUSALS}),
    (RaisesOnNull, {NULL_ROWS}),
], ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_a_broken_policy_fails_its_rule_only(cls, expected):
    results = check_policy(cls, steps=STEPS, speed=False)
    assert failing(results) == expected, [r.line() for r in results]
    for r in results:
        if not r.passed:
            assert "step" in r.detail or "=" in r.detail, r.detail  # says where and what


def test_refusal_failures_name_the_values():
    detail = next(r.detail for r in check_policy(NoRangeCheck, steps=STEPS, speed=False)
                  if r.rule == "refusals")
    assert detail == "recent_window=-1: accepted"  # budget 0 and -1 are refused, naming budget
    detail = next(r.detail for r in check_policy(NoBudgetCheck, steps=STEPS, speed=False)
                  if r.rule == "refusals")
    assert detail == "budget=0: accepted; budget=-1: accepted"


def test_a_declared_max_is_probed_and_a_control_only_end_is_not():
    """A declared max is a rule (scissorhands' history_window: one bit per step in a uint64),
    so 65 is a refusal probe; SnapKV's obsWindow has only a control end (ui_max 128: the
    card lets the window grow until SnapKV is H2O), so 129 is no probe."""
    from kvviz.core.check import bad_values, check_refusals

    spec = {s.name: s for s in POLICIES["scissorhands"].specs}["history_window"]
    assert 65 in bad_values(spec)
    obs = {s.name: s for s in POLICIES["snapkv"].specs}["obs_window"]
    assert bad_values(obs) == [0]
    assert all(r.passed for r in check_refusals(POLICIES["scissorhands"]))
    assert all(r.passed for r in check_refusals(POLICIES["snapkv"]))


def test_differential_fails_a_disagreeing_reference_and_passes_the_real_one():
    bad = check_policy(Tova, steps=STEPS, speed=False, reference=RefTovaEvictsHighest, examples=30,
                       shrink=False)
    assert failing(bad) == {DIFFERENTIAL}
    assert "reference" in next(r.detail for r in bad if r.rule == "differential")
    good = check_policy(Tova, steps=STEPS, speed=False, reference=RefTova, examples=30)
    assert failing(good) == set()


# -- the command --------------------------------------------------------------------------------
PLUGIN = '''
from dataclasses import dataclass
from kvviz.core.policies.tova import Tova

@dataclass
class Backwards(Tova):
    name = "backwards"

    def evict(self, budget):
        return super().evict(budget)[::-1]

@dataclass
class Fine(Tova):
    name = "fine"
'''


def test_cli_exit_status_and_report(tmp_path, capsys):
    path = tmp_path / "mine.py"
    path.write_text(PLUGIN)
    assert main(["tova", "--steps", str(STEPS)]) == 0
    out = capsys.readouterr().out
    assert "tova (kvviz.core.policies.tova.Tova): PASS" in out and "FAIL" not in out
    assert "tova" in out.splitlines()[-1] and "us/step" in out  # the speed line, beside tova's
    assert main([f"{path}:Backwards", "--steps", str(STEPS)]) == 1
    out = capsys.readouterr().out
    assert f"{path}:Backwards" in out and f"FAIL  {contract('ascending')}" in out
    assert main([f"{path}:Fine", "--steps", str(STEPS),
                 "--reference", "kvviz.core.reference:RefTova", "--examples", "10"]) == 0
    assert "PASS  " + DIFFERENTIAL in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["no-such-policy"], "no-such-policy: not a .py file and failed to import"),
    (["{path}"], "name the class as"),
    (["{path}:Missing"], "no Policy or Allocator subclass named 'Missing'"),
    (["tova", "--reference", "kvviz.core.reference"], "--reference must be PATH.py:FUNC"),
    ([], "name a policy to check"),
])
def test_cli_refuses_in_one_line(tmp_path, capsys, args, needle):
    path = tmp_path / "mine.py"
    path.write_text(PLUGIN)
    assert main([a.format(path=path) for a in args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_load_target_imports_a_file_once(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(PLUGIN)
    label, cls = load_target(f"{path}:Fine")
    assert label.endswith(":Fine") and cls.name == "fine"
    assert load_target(f"{path}:Fine")[1] is cls
    assert load_target("streaming-llm")[1] is POLICIES["streaming-llm"]
