"""`kvviz check` for allocators: the victim order each allocator declares (an inverted AdaKV
fails it), the total (an allocator that leaves its layer over budget fails it), and the
differential check against slow references written from each built-in's rule
(kvviz.core.reference_alloc), which every built-in passes and a subtly wrong copy fails."""
import numpy as np
import pytest

from kvviz.core.check_alloc import check_allocator, check_reference, order_broken
from kvviz.core.policies import BUILTIN_ALLOCATORS, make_policy
from kvviz.core.reference_alloc import RefAdaKV, RefHeadRoles, RefPyramidKV

ORDER_SHARED = "order: each victim is the lowest-priority candidate it may take (shared)"
ORDER_PER_HEAD = "order: each victim is the lowest-priority candidate it may take (per head)"

BROKEN = '''
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.adakv import AdaKV
from kvviz.core.policies.alloc import shared_victims
from kvviz.core.policies.pyramidkv import PyramidKV
from kvviz.policies import Allocator


@dataclass
class InvertedAdaKV(AdaKV):
    """AdaKV's bookkeeping, but the HIGHEST priority across the heads goes."""

    name = "inverted-adakv"

    def choose_layer(self, policies, b):
        counts = [len(p.held()) for p in policies]
        excess = sum(counts) - len(policies) * b
        out = [[] for _ in policies]
        ranked = sorted((-float(p.priority()[i]), g, int(i)) for g, p in enumerate(policies)
                        for i in np.flatnonzero(p.candidates()))
        for _, g, i in ranked:
            if excess <= 0:
                break
            if counts[g] > self.floor(b):
                out[g].append(i)
                counts[g] -= 1
                excess -= 1
        return [np.array(sorted(o), np.int64) for o in out]


@dataclass
class UnderEvicting(AdaKV):
    """Leaves its layer one slot over its total whenever it is two or more over."""

    name = "under-evicting"

    def choose_layer(self, policies, b):
        total = len(policies) * b
        if sum(len(p.held()) for p in policies) - total >= 2:
            total += 1
        return shared_victims(policies, total, self.floor(b))


@dataclass
class HidesAVictim(AdaKV):
    """AdaKV's choice, but the first head's victims are dropped from what the layer reports."""

    name = "hides-a-victim"

    def group(self, *args, **kwargs):
        group = super().group(*args, **kwargs)
        evict = group.evict

        def misreported():
            victims = evict()
            return [np.empty(0, np.int64)] + list(victims[1:]) if len(victims[0]) else victims
        group.evict = misreported
        return group


@dataclass
class OldestPerHead(Allocator):
    """Per head, declared so, but each head's HIGHEST-priority candidates go."""

    name = "oldest-per-head"
    label = "highest per head"

    def choose_layer(self, policies, b):
        out = []
        for p in policies:
            k = len(p.held()) - b
            idx = np.flatnonzero(p.candidates())
            order = np.argsort(-p.priority()[idx], kind="stable")[:max(k, 0)]
            out.append(np.sort(idx[order]))
        return out


@dataclass
class HigherHeadFirst(AdaKV):
    """AdaKV with its ties sent to the higher head, not the lower: the order holds, the rule
    (ties: the lower head) does not."""

    name = "higher-head-first"

    def choose_layer(self, policies, b):
        back = shared_victims(policies[::-1], len(policies) * b, self.floor(b))
        return back[::-1]


@dataclass
class SteeperPyramid(PyramidKV):
    """A pyramid one step steeper than its beta says."""

    name = "steeper"

    def layer_budgets(self, depths):
        from kvviz.core.policies.pyramidkv import pyramid

        return [self.window() + s for s in pyramid(self.budget - self.window(), depths, self.beta + 1)]
'''


@pytest.fixture
def broken(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    return path


def _cls(path, name):
    from kvviz.core.plugins import load_file

    return getattr(load_file(path), name)


def _failed(out: str) -> list[str]:
    return [line.strip()[len("FAIL  "):] for line in out.splitlines() if line.strip().startswith("FAIL")]


def test_an_inverted_adakv_fails_the_order_naming_the_step_and_both_slots(broken, capsys):
    from kvviz.__main__ import main

    assert main(["check", f"{broken}:InvertedAdaKV"]) == 1
    (line,) = _failed(capsys.readouterr().out)  # only the order: totals, floors, candidates hold
    rule, detail = line.split(" -- ")
    assert rule == ORDER_SHARED
    assert detail.startswith("random rows, seed 0: step ")
    assert ", layer 0, head " in detail and "the victim at position" in detail and "stayed" in detail


def test_a_per_head_allocator_taking_each_heads_highest_fails_the_order(broken, capsys):
    from kvviz.__main__ import main

    assert main(["check", f"{broken}:OldestPerHead"]) == 1
    (line,) = _failed(capsys.readouterr().out)
    rule, detail = line.split(" -- ")
    assert rule == ORDER_PER_HEAD and "step " in detail and "its own candidate at position" in detail


def test_an_allocator_that_leaves_its_layer_over_budget_fails_the_total_naming_the_step(broken, capsys):
    from kvviz.__main__ import main

    assert main(["check", f"{broken}:UnderEvicting"]) == 1
    lines = _failed(capsys.readouterr().out)
    rule, detail = lines[0].split(" -- ")
    assert rule == "contract: total"
    assert detail.startswith("random rows, seed 0: step ") and ", layer 0: " in detail
    assert "over its budget of 48" in detail and "all heads (the layer's total)" in detail


def test_an_allocator_that_misreports_its_victims_fails_the_victims_rule(broken, capsys):
    from kvviz.__main__ import main

    assert main(["check", f"{broken}:HidesAVictim"]) == 1
    lines = _failed(capsys.readouterr().out)
    rule, detail = lines[0].split(" -- ")
    assert rule == "contract: victims"
    assert detail.startswith("random rows, seed 0: step ") and "head 0" in detail
    assert "left its held set unreported" in detail


def test_the_order_rule_by_hand():
    kept = np.array([0, 1, 2, 3])
    cand = np.array([True, True, True, False])
    before = [(kept, cand), (kept, cand)]
    prios = [np.array([0.5, 0.1, 0.9, 0.0]), np.array([0.3, 0.05, 0.4, 0.0])]
    counts = np.array([3, 4])
    none = np.array([], np.int64)
    # head 0 loses position 0 (0.5) while its own 0.1 stays: both orders break
    assert order_broken("per_head", before, prios, [np.array([0]), none], counts, 0).startswith(
        "head 0: the victim at position 0 (priority 0.5) went while its own candidate at position 1")
    # head 0 loses its lowest (0.1) while head 1's 0.05 stays: shared breaks, per head not
    lowest = [np.array([1]), none]
    assert order_broken("per_head", before, prios, lowest, counts, 0) == ""
    assert "head 1's candidate at position 1 (priority 0.05) stayed, head 1 holding 4, above its floor 0" \
        in order_broken("shared", before, prios, lowest, counts, 0)
    # ... unless head 1 is at its floor
    assert order_broken("shared", before, prios, lowest, counts, 4) == ""
    # a tie may go either way
    tie = [np.array([0.2, 0.2, 0.9, 0.0]), np.array([0.2, 0.3, 0.4, 0.0])]
    assert order_broken("shared", before, tie, lowest, counts, 0) == ""


@pytest.mark.parametrize("name", [c.name for c in BUILTIN_ALLOCATORS])
def test_every_built_in_allocator_passes_with_its_reference(name, capsys):
    from kvviz.__main__ import main

    assert main(["check", name, "--reference", "--examples", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == ("  PASS  differential: identical victims and held sets per head to the "
                         "reference at every step -- 40 random scenarios")
    from kvviz.core.policies import ALLOCATORS

    # an allocator that orders its victims by its own rule (cake's indicator) declares none
    order = "  info  order: " if ALLOCATORS[name].victim_order is None else "  PASS  order: "
    assert lines[-2].startswith(order)


@pytest.mark.parametrize("cls, ref", [("HigherHeadFirst", RefAdaKV), ("SteeperPyramid", RefPyramidKV)])
def test_the_differential_catches_what_the_properties_cannot(broken, cls, ref):
    cls = _cls(broken, cls)
    props = check_allocator(lambda b: cls(budget=b, factory=make_policy), cls)
    assert all(r.passed for r in props), [r.line() for r in props if not r.passed]
    result = check_reference(cls, ref, scenarios=60)
    assert not result.passed
    assert result.detail.startswith("scenario ")
    assert ": step " in result.detail and "allocator victims" in result.detail and \
        "reference victims" in result.detail or "building its layers, the allocator" in result.detail


def test_the_references_follow_the_rules_not_the_fast_code():
    # pyramid: budget 16 over 3 layers, beta 4: 28, 16, 4 (2B - B/beta, B, B/beta)
    ref = RefPyramidKV(16, None, scorer="tova", beta=4)
    assert [ref.group(d, 3, 2).b for d in range(3)] == [28, 16, 4]
    # with h2o's recent window of 4: the window in every layer, the pyramid over the rest
    ref = RefPyramidKV(16, None, scorer="h2o", beta=4, recent_window=4)
    assert [ref.group(d, 3, 2).b for d in range(3)] == [4 + 21, 4 + 12, 4 + 3]
    # head roles: 4 heads, share 0.5, streaming heads of 2 + 2: heads 1 and 3 look furthest
    roles = RefHeadRoles(8, None, scorer="tova", share=0.5, stream_sinks=2, stream_recent=2, calibration=4)
    layer = roles.group(0, 1, 4)
    far = [0, 0, 1.0, 0, 0, 0]   # all its mass outside the first 2 and the last 2
    near = [1.0, 0, 0, 0, 0, 0]
    layer.calibrate([[near], [far], [near], [far]])
    budgets, retrieval = layer.state
    assert retrieval == [False, True, False, True] and budgets == [4, 12, 4, 12]  # 32 - 2 x 4 = 24


def test_a_bare_reference_for_a_class_that_declares_none_is_refused_in_one_line(capsys):
    from apphelp import REPO

    from kvviz.__main__ import main

    fixed = REPO / "examples" / "plugins" / "fixed_share.py"
    assert main(["check", str(fixed), "--reference"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: FixedShare declares no reference: give one as --reference PATH.py:FUNC "
                   "or MODULE:FUNC")


def test_a_victim_order_outside_the_three_is_refused_at_registration():
    from dataclasses import dataclass

    from kvviz.core.policies import register_allocator
    from kvviz.policies import Allocator

    @dataclass
    class Vague(Allocator):
        name = "vague-order"
        label = "vague"
        victim_order = "lowest"

    with pytest.raises(ValueError, match="vague-order: victim_order must be 'per_head', 'shared' or None"):
        register_allocator(Vague)
