"""A replay with checkpoints, so the app can peek at any step in milliseconds.

`Replay.peek(step)` re-runs the policy from the start (O(step)); scrubbing a slider over a
4,096-step trace would cost ~1 s per policy per move. `Engine` runs the policy once through
`Replay`, keeping deep copies of the replay every `every` steps; `peek(step)` resumes the
nearest earlier copy and steps it forward with the harness's own `Replay.step`, recording
the policy's `kept` and `scores()` just before its eviction at `step`. Only public API is
used: the policy's `evict` is wrapped on a private copy. A test pins equality with
`Replay.peek` on every policy.
"""
from __future__ import annotations

import copy

import numpy as np

from kvviz.policies import make_policy
from kvviz.replay import Replay, Run
from kvviz.trace import Trace


class Engine:
    def __init__(self, trace: Trace, name: str, budget: int, params: dict | None = None,
                 every: int = 256):
        self.trace = trace
        self.name = name
        self.budget = int(budget)
        self.params = dict(params or {})
        self.policy = make_policy(name, budget=self.budget, **self.params)  # ValueError if refused
        self.every = max(1, int(every))
        replay = Replay(trace, copy.deepcopy(self.policy))
        self._checkpoints: dict[int, Replay] = {}
        for t in range(0, trace.steps, self.every):
            replay.seek(t - 1)
            self._checkpoints[t] = self._copy(replay)
        self.run: Run = replay.run()

    def _copy(self, replay: Replay) -> Replay:
        return copy.deepcopy(replay, memo={id(self.trace): self.trace})

    @property
    def bytes_per_slot(self) -> int:
        return self.policy.bytes_per_slot

    def victims(self, step: int) -> np.ndarray:
        return np.flatnonzero(self.run.evicted_at == int(step)).astype(np.int64)

    def peek(self, step: int):
        """(kept, scores) at `step` after admission and before eviction; same as Replay.peek."""
        step = int(step)
        if not 0 <= step < self.trace.steps:
            raise ValueError(f"peek: step must be in 0..{self.trace.steps - 1}, got {step}")
        start = (step // self.every) * self.every
        probe = self._copy(self._checkpoints[start])
        probe.seek(step - 1)
        policy = probe.policy
        seen = {}
        real_evict = policy.evict

        def spy(budget):
            seen["kept"] = policy.kept.copy()
            seen["scores"] = {k: np.array(v, copy=True) for k, v in policy.scores().items()}
            return real_evict(budget)

        policy.evict = spy
        probe.step()
        return seen["kept"], seen["scores"]
