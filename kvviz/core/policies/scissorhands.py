"""Scissorhands (Liu et al., NeurIPS 2023, arXiv:2305.17118): persistence of importance.

Following the paper's compression step: over a history window of observed steps, count
how often each slot's attention fell below the uniform share 1/len(kept) ("unimportant
at that step"); evict the slots unimportant most often, never the `recent_window`
newest. The flags live in a ring of bits (bit k = ring slot k of one uint64), so the
count covers exactly the last `history_window` observed steps and is a popcount.

Ties. Most slots share a count (a key the model reads only now and then is below the
uniform share on most steps, as is most filler, so their counts saturate at the window
together). The registry's rule (`tie_break="position"`, the default) sends the lower
position first among equal counts, as every kvviz policy does; with saturated counts that
turns the policy into a sliding window that drops the oldest slots. `tie_break="attention"`
breaks those ties by the attention each slot has accumulated over every step the policy
observed since its admission (H2O's score; a prompt read in one pass gives it the last
`history_window` rows, the ones the policy reads), the lowest first; equal sums still go
to the lower position. The paper does not say how ties break.

On the shipped decode runs at budget 192 the registry's rule leaves about 93 % of what it
holds at the end in the newest 192 positions, so a key early in a long prompt is lost this
way; docs/policies.md, "Scissorhands' ties", gives the measurements.
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
    tie_break: str = param(
        "position", label="tieBreak", choices=("position", "attention"),
        help="among equal low-attention counts, which slot goes first: the lower position, or the "
             "lower attention accumulated since admission",
        source="kvviz's choice: the paper leaves ties open; position is every kvviz policy's rule")

    name = "scissorhands"
    label = "Scissorhands"
    rank = Rank("low_count", "steps below uniform share",
                "most often below the uniform share goes first", descending=True, count=True)
    colour = "#56B4E9"
    reference = "kvviz.core.reference:RefScissorhands"

    def check_params(self):
        check_recent(self)

    def columns(self):
        cols = {"low": (np.uint64, (), 0)}
        if self.tie_break == "attention":
            cols["acc"] = (np.float64, (), 0.0)  # attention accumulated since admission
        return cols

    def reset_state(self):
        super().reset_state()
        self.slot = 0

    def observe(self, attn):
        if len(attn):
            flags = self.col("low")
            flags &= CLEAR[self.slot]  # forget what this ring slot said a full window ago
            flags += (attn < np.float32(1.0 / len(attn))) * BITS[self.slot]
            if self.tie_break == "attention":
                acc = self.col("acc")
                acc += attn
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
        first = 64 - self.low_count()  # most often unimportant goes first (uint8, no wrap)
        if self.tie_break == "position":
            return first
        # then the lowest accumulated attention: the sums' dense ranks (equal sums share a
        # rank, so the stable sort still sends the lower position first), exact in int64
        _, rank = np.unique(self.col("acc"), return_inverse=True)
        return first.astype(np.int64) * (self._n + 1) + rank.reshape(-1)

    def scores(self):
        out = {"low_count": self.low_count(), "candidate": self.candidates()}
        if self.tie_break == "attention":
            out["accumulated"] = self.col("acc").copy()
        return out

    @property
    def bytes_per_slot(self):
        # position, 64 flag bits, eviction scratch (and the accumulated sum, float64)
        return 4 + 8 + 1 + (8 if self.tie_break == "attention" else 0)
