"""Scissorhands (Liu et al., NeurIPS 2023, arXiv:2305.17118): persistence of importance.

Following the paper's compression step: over a history window of observed steps, count
how often each slot's attention fell below the uniform share 1/len(kept) ("unimportant
at that step"); evict the slots unimportant most often, never the `recent_window`
newest. The flags live in a ring of bits (bit k = ring slot k of one uint64), so the
count covers exactly the last `history_window` observed steps and is a popcount.

Ties: the uniform share is a row's mean, and attention is heavy-tailed, so most positions
are below it on most steps and their count saturates at `history_window`. Among equal counts
the shared rule evicts the lower position, so with most candidates saturated this policy
evicts the oldest first, like a sliding window (on the shipped decode runs at budget 192, about
93 % of what it holds at the end lies in the newest 192 positions). A key early in a long
prompt is lost this way. docs/policies.md, "Scissorhands' ties", gives the measurements.
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, Rank, check_recent, param

BITS = [np.uint64(1 << k) for k in range(64)]
CLEAR = [~bit for bit in BITS]


@dataclass
class Scissorhands(Policy):
    history_window: int = param(
        32, label="historyWindow", min=1, max=64,  # one bit per step in a uint64
        help="observed steps over which low-attention counts are kept",
        source="kvviz's choice, twice SnapKV's obsWindow: the Scissorhands paper "
               "(Liu et al. 2023) tunes the window per workload")
    recent_window: int = param(
        32, label="recentWindow", min=0, ui_max=1024, help="newest positions never evicted",
        source="kvviz's choice, the same as H2O's so the two compare directly")

    name = "scissorhands"
    label = "Scissorhands"
    rank = Rank("low_count", "steps below uniform share",
                "most often below the uniform share goes first", descending=True, count=True)
    colour = "#56B4E9"
    reference = "kvviz.core.reference:RefScissorhands"

    def check_params(self):
        check_recent(self)

    def columns(self):
        return {"low": (np.uint64, (), 0)}

    def reset_state(self):
        super().reset_state()
        self.slot = 0

    def observe(self, attn):
        if len(attn):
            flags = self.col("low")
            flags &= CLEAR[self.slot]  # forget what this ring slot said a full window ago
            flags += (attn < np.float32(1.0 / len(attn))) * BITS[self.slot]
        self.slot = (self.slot + 1) % self.history_window

    def prefill_rows(self, prompt_len):
        return min(self.history_window, prompt_len)  # the ring holds the last history_window rows

    def skip_rows(self, count):
        self.slot = (self.slot + count) % self.history_window

    def protected_tail(self):
        return self.recent_window

    def low_count(self):
        """Per slot, how many of the last `history_window` observed steps gave it less than the
        average share: one popcount of its flag ring."""
        return np.bitwise_count(self.col("low"))

    def priority(self):
        return 64 - self.low_count()  # most often unimportant goes first (uint8, no wrap)

    def scores(self):
        return {"low_count": self.low_count(), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + 8 + 1  # position, 64 flag bits, eviction scratch
