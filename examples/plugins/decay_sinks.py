"""decay-sinks: an example kvviz plugin with a float parameter.

Attention sinks (the first `sinks` positions are never evicted) plus exponentially decayed
accumulated attention: at every observed step a slot's score halves every `half_life`
steps and gains the step's weight; the lowest score goes, never the newest slot.

    kvviz bench --plugin examples/plugins/decay_sinks.py --policies tova,decay-sinks
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.reference import RefPolicy
from kvviz.policies import Policy, Rank, param


class RefDecaySinks(RefPolicy):
    """The slow reference: one Python float per slot, updated in a loop."""

    name = "decay-sinks"
    protect_recent = 1

    def observe(self, weights):
        decay = 0.5 ** (1.0 / self.params["half_life"])
        for i, w in enumerate(weights):
            self.state[i] = self.state[i] * decay + w

    def new_record(self):
        return 0.0

    def is_candidate(self, i):
        return self.params["sinks"] <= i < len(self.keep) - 1

    def rank(self, i):
        return self.state[i]


@dataclass
class DecaySinks(Policy):
    sinks: int = param(4, label="sinks", min=0, max=64, help="first positions always kept",
                       source="StreamingLLM's four attention sinks (Xiao et al. 2024)")
    half_life: float = param(8.0, label="halfLife", min=0.5, max=1024.0, step=0.5,
                             help="observed steps after which a weight counts half",
                             source="an example value: about TOVA's one step and H2O's all")

    name = "decay-sinks"
    label = "decayed attention + sinks"
    rank = Rank("score", "decayed attention", "lowest decayed attention goes first")
    reference = RefDecaySinks

    def check_params(self):
        if self.sinks >= self.budget:
            raise ValueError(f"sinks must be smaller than budget, got sinks={self.sinks} "
                             f">= budget={self.budget}")

    def columns(self):
        return {"score": (np.float64, (), 0.0)}

    def observe(self, attn):
        score = self.col("score")
        score *= 0.5 ** (1.0 / self.half_life)
        score += attn

    def protected_tail(self):
        return 1  # the newest slot has had no step to earn a score

    def priority(self):
        prio = self.col("score").copy()
        prio[: self.sinks] = np.inf  # sinks are never candidates
        return prio

    def candidates(self):
        cand = super().candidates()
        cand[: self.sinks] = False
        return cand

    def scores(self):
        return {"score": self.col("score").copy(), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + 8 + 1  # position, score (double), eviction scratch
