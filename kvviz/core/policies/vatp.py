"""VATP, value-aware token pruning (Guo et al., EMNLP 2024, "Attention Score is not All You
Need for Token Importance Indicator in KV Cache Reduction: Value Also Matters",
arXiv:2406.12335): a position's importance is its attention score times the norm of its
cached value vector.

Score = attention accumulated over every observed step since admission (H2O's score, the
paper's "H2O w/ VATP" variant) x the position's value norm. The lowest score goes; the
first `sinks` positions (the paper keeps the attention sinks, whose value norms are small,
out of pruning) and the `recent_window` newest (as H2O) are never victims.

kvviz uses the value's L2 norm, the norm a trace stores (format version 4) beside the key's;
the paper uses the L1 norm. The two can rank positions differently, so this is VATP's rule
on L2 norms, not a reproduction of the paper's numbers.
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, Rank, check_recent, param


@dataclass
class VATP(Policy):
    recent_window: int = param(
        32, label="recentWindow", min=0, ui_max=1024, help="newest positions never evicted",
        source="H2O's recent window in kvviz (the TOVA card: 'a fixed 32 positions'); VATP "
               "builds on H2O's accumulated attention")
    sinks: int = param(
        4, label="sinks", min=0, ui_max=64, help="first positions never evicted",
        source="Guo et al. 2024 keep the initial attention-sink tokens; four as in "
               "StreamingLLM (Xiao et al. 2024)")

    name = "vatp"
    label = "VATP"
    colour = "#661100"
    rank = Rank("vatp", "accumulated attention x value norm",
                "lowest accumulated attention x value L2 norm goes first")
    score_labels = {"cumulative": "accumulated attention", "value_norm": "value L2 norm"}
    reference = "kvviz.core.reference:RefVATP"
    reads_value_norms = True

    def check_params(self):
        check_recent(self)
        if self.sinks + self.recent_window >= self.budget:
            raise ValueError(f"sinks + recent_window must be smaller than budget: "
                             f"{self.sinks} + {self.recent_window} >= budget={self.budget} "
                             "leaves no room to evict")

    def columns(self):
        return {"cumulative": (np.float64, (), 0.0), "value_norm": (np.float32, (), 0.0)}

    def advance(self, pos, attn, key_norm=None, value_norm=None):
        super().advance(pos, attn)
        self.col("value_norm")[-1] = value_norm  # float32, as the trace and the cache hold it

    def observe(self, attn):
        cumulative = self.col("cumulative")
        cumulative += attn

    def protected_tail(self):
        return self.recent_window

    def candidates(self):
        cand = super().candidates()
        cand[: self.sinks] = False
        return cand

    def priority(self):
        return self.col("cumulative") * self.col("value_norm").astype(np.float64)

    def scores(self):
        return {"vatp": self.priority(), "cumulative": self.col("cumulative").copy(),
                "value_norm": self.col("value_norm").astype(np.float64),
                "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + 8 + 4 + 1  # position, cumulative (double), value norm (float32), scratch
