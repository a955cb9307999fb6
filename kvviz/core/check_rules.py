"""What `kvviz check` reports and probes, shared by the policy checks (kvviz.core.check)
and the allocator contract (kvviz.core.check_alloc): one rule's verdict, and the values
outside a parameter's declared rule."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BIG_BUDGET = 2 ** 20  # refusal probes: no parameter is refused for being near the budget


@dataclass
class RuleResult:
    """One rule's verdict on one policy: which rule, what it looked at, pass or fail, and the
    failing step and values, so a failure says where to look without re-running anything."""

    rule: str  # contract, determinism, refusals, robustness, differential, speed
    name: str  # what was checked
    passed: bool
    detail: str = ""  # the failing step and values, or what was covered
    info: bool = False  # a figure to read, not a pass/fail rule

    def line(self) -> str:
        """The line `kvviz check` prints: PASS, FAIL or info, the rule, and the detail."""
        mark = "info" if self.info else ("PASS" if self.passed else "FAIL")
        return f"{mark}  {self.rule}: {self.name}" + (f" -- {self.detail}" if self.detail else "")


# What a string, a switch or a value parameter is probed with: the values among these that
# its own declaration refuses (its type, then its validator) must be refused by the class too.
PROBES = (None, 3, -1.5, "", "   ", "no-such-file.json", "nan", "-1", "maybe", (), ("?",))


def bad_values(spec) -> list:
    """Values outside a parameter's rule: below min, above a declared max (a `ui_max` is
    only a control's end, not a rule), or not among its choices; for a string, a switch or a
    value (whose rule is its type and its validator), the probes its own declaration
    refuses (`spec.parse` raises); a validator that raises on every probe is asked no more."""
    choices = getattr(spec, "choices", None)
    if choices:
        return ["<not one of the choices>"]
    if getattr(spec, "kind", "int") in ("str", "bool", "value"):
        out = []
        for value in PROBES:
            try:
                spec.parse(value)
            except ValueError:
                out.append(value)
        return out
    out = []
    for bound, step in ((getattr(spec, "min", None), -1), (getattr(spec, "max", None), 1)):
        if bound is not None and np.isfinite(bound):
            out.append(bound + step)
    return out
