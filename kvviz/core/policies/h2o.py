"""H2O (Zhang et al., NeurIPS 2023, arXiv:2306.14048): keep the heavy hitters.

Score = attention accumulated over every observed step since admission. The
`recent_window` newest positions are protected, since a new token has had no time to
accumulate anything.
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, Rank, check_recent, param
from kvviz.core.policies.vectorised import StreamState, close_gap


class H2OStreams(StreamState):
    """H2O over S streams: each slot's cumulative weight, (S, cap)."""

    def __init__(self, policy, S: int, cap: int):
        super().__init__(policy, S, cap)
        self.recent = policy.recent_window
        self.cumulative, self.spare = np.zeros((S, cap)), np.zeros((S, cap))

    def observe(self, t, attn, n):
        self.cumulative[:, :n] += attn  # accumulate every observed step

    def admit(self, n):
        self.cumulative[:, n] = 0.0  # a newcomer has accumulated nothing

    def victim(self, attn, n):
        # The lowest cumulative outside the `recent_window` newest slots.
        return self.cumulative[:, : n - self.recent].argmin(axis=1)

    def remove(self, i, stay):
        close_gap(self.spare, self.cumulative, stay)
        self.cumulative, self.spare = self.spare, self.cumulative


@dataclass
class H2O(Policy):
    recent_window: int = param(
        32, label="recentWindow", min=0, ui_max=1024, help="newest positions never evicted",
        source="the TOVA card (Oren et al. 2024): H2O's recent window is 'a fixed 32 positions'")

    name = "h2o"
    label = "H2O"
    rank = Rank("cumulative", "accumulated attention", "lowest accumulated attention goes first")
    colour = "#009E73"
    reference = "kvviz.core.reference:RefH2O"
    vectorised = H2OStreams
    summable = True  # cumulative += each row: a prefill may add the rows' float64 sum once

    def check_params(self):
        check_recent(self)

    def columns(self):
        return {"cumulative": (np.float64, (), 0.0)}

    def observe(self, attn):
        cumulative = self.col("cumulative")
        cumulative += attn

    def protected_tail(self):
        return self.recent_window

    def priority(self):
        return self.col("cumulative")

    def scores(self):
        return {"cumulative": self.col("cumulative").copy(), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + 8 + 1  # position, cumulative (double), eviction scratch
