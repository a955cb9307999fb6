"""Budgets: a fixed count of slots, or a ratio of the tokens seen so far.

A budget is either a positive integer (hold at most that many slots, whatever the length)
or a ratio written `0.25x`: hold a quarter of the positions seen so far, re-resolved at
every step (kvpress's `compression_ratio` is the share removed, 1 - R; a ratio here is the
share kept). `parse_budget` reads either from a number or a CLI/URL/form text; `resolve`
turns it into the count a harness evicts down to at a step.

The rule at a step that has seen `seen` positions (the admitted one included):

    resolve(R, seen) = max(floor, floor(R x seen))     (exact: R is a fraction, no float)

rounded down as kvpress rounds its kept count (`int(k_len * (1 - compression_ratio))`), and
never below `floor`. The floor is the smallest budget the policy accepts with its
parameters (`Ratio.floor`, found by `smallest_budget` when the registry builds the policy,
1 for a policy with no protected slots): a policy's protected sinks and recent window are
kept whole, so while R x seen is below them the budget is clamped up to them rather than
the run refused. So the count held after a step is min(seen, resolve(R, seen)): every
position until the floor is reached, then the larger of the floor and R x seen. Since
floor(R x seen) grows by at most one per step, a step under a ratio budget evicts at most
one position, the one the policy would evict at that step under the fixed budget
resolve(R, seen).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

__all__ = ["RULE", "Ratio", "as_given", "at_ratio", "budget_label", "budget_order", "is_ratio",
           "parse_budget", "resolve", "smallest_budget"]

RULE = ("a positive integer (slots held) or a ratio of the tokens seen written Rx, "
        "R a decimal in (0, 1] (e.g. 0.25x)")
_RATIO = re.compile(r"(\d+(?:\.\d*)?|\.\d+)[xX]")


@dataclass(frozen=True)
class Ratio:
    """A budget of `value` (a Fraction in (0, 1]) of the positions seen, never below
    `floor` slots. `str()` is the budget as given ("0.25x")."""

    value: Fraction
    text: str
    floor: int = 1

    def resolve(self, seen: int) -> int:
        """max(floor, floor(value x seen)), in exact integer arithmetic."""
        seen = int(seen)
        return max(self.floor, seen * self.value.numerator // self.value.denominator)

    def with_floor(self, floor: int) -> "Ratio":
        """The same ratio, clamped to at least `floor` slots."""
        return replace(self, floor=max(1, int(floor)))

    def __str__(self) -> str:
        return self.text


def parse_budget(value, name: str = "budget"):
    """`value` as a budget: an int >= 1, or a Ratio from text like '0.25x' (or a Ratio).

    Accepts ints (numpy's too), integral text ('64') and ratio text; refuses anything else
    with a ValueError naming `name` and the rule."""
    if isinstance(value, Ratio):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        if value >= 1:
            return int(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.isdigit() and int(text) >= 1:
            return int(text)
        found = _RATIO.fullmatch(text)
        if found:
            r = Fraction(found.group(1))
            if 0 < r <= 1:
                return Ratio(r, f"{found.group(1)}x")
            raise ValueError(f"{name} must be {RULE}: the ratio {text!r} is outside (0, 1]")
    raise ValueError(f"{name} must be {RULE}, got {value!r}")


def is_ratio(budget) -> bool:
    """Whether `budget` is a ratio budget (a Ratio)."""
    return isinstance(budget, Ratio)


def resolve(budget, seen: int) -> int:
    """The slots a harness evicts down to after a step that has seen `seen` positions:
    a fixed budget as it is, a Ratio by its rule (see the module docstring)."""
    if isinstance(budget, Ratio):
        return budget.resolve(seen)
    return int(budget)


def budget_order(budget):
    """A sort key for budgets as given (counts, ratios, their text): the counts first,
    ascending, then the ratios, ascending."""
    b = parse_budget(budget)
    return (1, b.value) if isinstance(b, Ratio) else (0, b)


def budget_label(budget) -> str:
    """A budget as given: '64', '0.25x'."""
    return str(budget)


def as_given(budget):
    """A budget as a table records it: a count as an int, a ratio as its text ('0.25x')."""
    return str(budget) if isinstance(budget, Ratio) else int(budget)


def smallest_budget(accepts, limit: int = 1 << 24) -> int:
    """The smallest budget b >= 1 for which `accepts(b)` is True (a policy constructs at b),
    assuming every larger budget is accepted too (a protected window must fit below it);
    ValueError when none up to `limit` is."""
    if accepts(1):
        return 1
    hi = 2
    while not accepts(hi):
        if hi >= limit:
            raise ValueError(f"budget: no budget up to {limit} is accepted")
        hi *= 2
    lo = hi // 2  # refused
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if accepts(mid):
            hi = mid
        else:
            lo = mid
    return hi


def at_ratio(build, ratio: Ratio, limit: int = 1 << 20):
    """A policy at a ratio budget: `build(b)` (a policy constructed at budget b, raising
    ValueError where it refuses b) called at the smallest budget it accepts, which becomes
    the ratio's floor, set as `policy.ratio`. A refusal that does not depend on the budget
    (an unknown parameter, a value outside its rule) is raised as `build(limit)` raises it."""
    build(limit)

    def accepts(b: int) -> bool:
        try:
            build(b)
        except ValueError:
            return False
        return True
    floor = smallest_budget(accepts, limit)
    policy = build(floor)
    policy.ratio = ratio.with_floor(floor)
    return policy
