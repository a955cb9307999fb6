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


def allocator_runs(grid, allocator: str, scorer: str, budget: int) -> dict:
    """An allocator over a trace captured per KV head (`grid`, kvviz.core.layers.load_layers)
    beside its scorer alone on each head at the same budget: the Heads picture's data.

    {"held": int (layers, heads, T) under the allocator, "plain": the same alone,
    "layers": model layer numbers, "budgets": each layer's per-head budget, "roles": a
    tuple of one bool per head per layer or None (True: a retrieval head), "runs": the
    allocator's Run per (layer, head), "alone": the scorer's}. ValueError if refused."""
    from kvviz.core.layers import replay_layers
    from kvviz.core.replay import run_policy

    found = replay_layers(grid, make_policy(allocator, budget, scorer=scorer))
    alone = [[run_policy(tr, scorer, budget) for tr in row] for row in grid]
    plain = np.array([[r.held for r in row] for row in alone])
    roles = [getattr(s, "retrieval", None) for s in (found.states or [None] * len(grid))]
    return dict(held=found.held, plain=plain, layers=found.layer_numbers, budgets=found.budgets,
                roles=roles, runs=found.runs, alone=alone)
