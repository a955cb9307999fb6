"""H2O (Zhang et al., NeurIPS 2023, arXiv:2306.14048): keep the heavy hitters.

Score = attention accumulated over every observed step since admission. The
`recent_window` newest positions are protected, since a new token has had no time to
accumulate anything.
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, Rank, check_recent, param


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
