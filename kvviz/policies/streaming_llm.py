"""StreamingLLM (Xiao et al., ICLR 2024, arXiv:2309.17453): attention sinks + a recent window.

Keeps the first `sinks` positions and the most recent rest; reads no attention at all,
so it is the floor any attention-aware policy has to beat cheaply.
"""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import ParamSpec, Policy, need_candidates


@dataclass
class StreamingLLM(Policy):
    sinks: int = 4

    name = "streaming-llm"
    uses_attention = False
    specs: ClassVar = (
        ParamSpec("sinks", "sinks", 4, 0, 64, help="first positions always kept",
                  source="Xiao et al. 2024: four initial tokens as attention sinks"),
    )

    def check_params(self):
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
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
