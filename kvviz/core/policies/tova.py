"""TOVA (Oren et al., EMNLP 2024, arXiv:2401.06104): drop what the current step ignores.

Score = the weight a slot received on the latest observed step (assignment, not
accumulation). No recent window: recency is already in the weights. The newest
position has no weight yet, so it is not a candidate until a step observes it.
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, Rank
from kvviz.core.policies.vectorised import StreamState


class TovaStreams(StreamState):
    """TOVA over S streams: it keeps nothing between steps (its score is this step's weight)."""

    def victim(self, attn, n):
        # The lowest weight on the latest step goes. The newcomer (slot n-1) is unobserved,
        # never a candidate; the n-1 >= 1 observed slots are `attn`.
        return attn.argmin(axis=1)


@dataclass
class Tova(Policy):
    name = "tova"
    label = "TOVA"
    rank = Rank("last", "current-step weight", "lowest current-step weight goes first")
    colour = "#E69F00"
    reference = "kvviz.core.reference:RefTova"
    vectorised = TovaStreams

    def columns(self):
        return {"last": (np.float64, (), np.inf)}  # +inf = not yet observed

    def observe(self, attn):
        self.col("last")[:] = attn  # assignment, not accumulation

    def prefill_rows(self, prompt_len):
        return min(1, prompt_len)  # the last row overwrites every slot's weight

    def candidates(self):
        return np.isfinite(self.col("last"))

    def priority(self):
        return self.col("last")

    def scores(self):
        last = self.col("last")
        return {"last": np.where(np.isfinite(last), last, np.nan), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + 8 + 1  # position, last weight (double), eviction scratch
