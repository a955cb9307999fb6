"""StreamingLLM (Xiao et al., ICLR 2024, arXiv:2309.17453): attention sinks + a recent window.

Keeps the first `sinks` positions and the most recent rest; reads no attention at all,
so it is the floor any attention-aware policy has to beat cheaply.
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, need_candidates, param


@dataclass
class StreamingLLM(Policy):
    sinks: int = param(4, label="sinks", min=0, ui_max=64, help="first positions always kept",
                       source="Xiao et al. 2024: four initial tokens as attention sinks")

    name = "streaming-llm"
    label = "StreamingLLM"
    colour = "#CC79A7"
    reference = "kvviz.core.reference:RefStreamingLLM"
    uses_attention = False

    def check_params(self):
        if self.sinks >= self.budget:
            raise ValueError(f"sinks must be smaller than budget: sinks={self.sinks} >= "
                             f"budget={self.budget} leaves no room for recent positions")

    def candidates(self):
        cand = np.ones(self._n, bool)
        cand[: self.sinks] = False
        return cand

    def choose(self, count):
        need_candidates(self._n - min(self.sinks, self._n), count)
        return np.arange(self.sinks, self.sinks + count)  # the oldest non-sinks

    @property
    def bytes_per_slot(self):
        return 4  # position only
