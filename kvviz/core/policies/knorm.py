"""K-norm (Devoto et al., EMNLP 2024, arXiv:2406.11430): keep the keys with the lowest L2 norm.

Attention-free: the score is the norm of the position's cached key (after RoPE, as the
cache holds it), known the moment the position is admitted, so even the newest position
may go at once. The paper finds low-norm keys draw the most attention; kvpress ships it as
KnormPress (score = -norm). The attention-free foil to streaming-llm: it reads the keys
instead of the clock.
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, Rank


@dataclass
class Knorm(Policy):
    name = "knorm"
    label = "K-norm"
    rank = Rank("key_norm", "key L2 norm", "highest key norm goes first", descending=True)
    colour = "#D55E00"
    reference = "kvviz.core.reference:RefKnorm"
    uses_attention = False
    reads_key_norms = True

    def columns(self):
        return {"key_norm": (np.float32, (), 0.0)}

    def advance(self, pos, attn, key_norm=None):
        super().advance(pos, attn)
        self.col("key_norm")[-1] = key_norm  # float32, as the trace and the cache hold it

    def priority(self):
        return -self.col("key_norm")  # lowest priority goes: the highest norm; ties: lower position

    def scores(self):
        return {"key_norm": self.col("key_norm").astype(np.float64), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + 4 + 1  # position, key norm (float32), eviction scratch
