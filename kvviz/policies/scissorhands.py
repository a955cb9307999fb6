"""Scissorhands (Liu et al., NeurIPS 2023, arXiv:2305.17118): persistence of importance.

Following the paper's compression step: over a history window of observed steps, count
how often each slot's attention fell below the uniform share 1/len(kept) ("unimportant
at that step"); evict the slots unimportant most often, never the `recent_window`
newest. The count comes from a ring of flags, so it covers exactly the last
`history_window` observed steps.
"""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import ParamSpec, Policy, check_recent, recent_candidates


@dataclass
class Scissorhands(Policy):
    history_window: int = 32
    recent_window: int = 32

    name = "scissorhands"
    specs: ClassVar = (
        ParamSpec("history_window", "historyWindow", 32, 1, 256,
                  help="observed steps over which low-attention counts are kept",
                  source="kvviz choice (the paper's w is workload-specific); equals snapkv's 2x obsWindow"),
        ParamSpec("recent_window", "recentWindow", 32, 0, 1024, help="newest positions never evicted",
                  source="kvviz choice, same as h2o for comparability"),
    )

    def check_params(self):
        if self.history_window < 1:
            raise ValueError(f"history_window must be >= 1, got {self.history_window}")
        check_recent(self)

    def columns(self):
        # row k of "low" = ring slot k; "count" = its column sums, kept exactly (integers)
        return {"low": (np.bool_, (self.history_window,), False), "count": (np.int32, (), 0)}

    def reset_state(self):
        super().reset_state()
        self.slot = 0

    def observe(self, attn):
        if len(attn):
            ring, count = self.col("low")[self.slot], self.col("count")
            count -= ring
            ring[:] = attn < np.float32(1.0 / len(attn))
            count += ring
        self.slot = (self.slot + 1) % self.history_window

    def candidates(self):
        return recent_candidates(self._n, self.recent_window)

    def low_count(self):
        return self.col("count").copy()

    def priority(self):
        return -self.low_count().astype(np.float64)  # most often unimportant goes first

    def scores(self):
        return {"low_count": self.low_count(), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + self.history_window + 1  # position, one flag byte per step, scratch
