"""One policy configuration replayed once, for the page: its log, its Run, fast peeks.

A thin layer over `kvviz.core.replay.Replay` with checkpoints: the slider can ask for the
scores at any step and get them after replaying at most `every` steps, not the whole
prefix. Cached per configuration with `st.cache_resource` (see compute.py).
"""
from __future__ import annotations

import numpy as np

from kvviz.core.budget import parse_budget
from kvviz.core.policies import make_policy
from kvviz.core.replay import Replay, Run
from kvviz.core.trace import Trace


class Engine:
    def __init__(self, trace: Trace, name: str, budget: int, params: dict | None = None,
                 every: int = 256, policy=None):
        """`policy`: the configuration already built (the page's sidebar builds it to check
        the settings), so a page run builds it once; None builds it here (ValueError if
        refused). The replay drives this one object: `self.policy` is for what the policy
        declares (its parameters, bytes per slot, SnapKV's pooling radius), not its state."""
        self.trace = trace
        self.name = name
        self.budget = parse_budget(budget)  # a count, or a ratio of the tokens seen ('0.25x')
        self.params = dict(params or {})
        if policy is None:
            policy = make_policy(name, budget=self.budget, **self.params)
        built_at = getattr(policy, "ratio", None) or policy.budget
        if policy.name != name or str(built_at) != str(self.budget):
            raise ValueError(f"policy {policy.name} at budget {built_at} is not the "
                             f"configuration asked for, {name} at budget {self.budget}")
        self.policy = policy
        self.every = max(1, int(every))
        self._replay = Replay(trace, policy, checkpoint_every=self.every)
        self._replay.seek(trace.steps - 1)
        self.evicted_at = self._replay.evicted_at.copy()
        self.evicted_at.flags.writeable = False
        self._run: Run | None = None

    @property
    def run(self) -> Run:
        """The harness's Run (its retained-mass pass runs on first use only)."""
        if self._run is None:
            self._run = self._replay.run()
        return self._run

    @property
    def bytes_per_slot(self) -> int:
        return self.policy.bytes_per_slot

    def victims(self, step: int) -> np.ndarray:
        return np.flatnonzero(self.evicted_at == int(step)).astype(np.int64)

    def peek(self, step: int):
        """(kept, scores) at `step` after admission and before eviction (Replay.peek)."""
        return self._replay.peek(step)
