"""window-vote: an example kvviz plugin with a choice parameter.

Each slot keeps its weights over the last `window` observed steps (a float32 ring, as
SnapKV does); the score reduces the ring by `reduce`: its mean, or its max (a slot that
was once the step's focus is kept for a window). The lowest score outside the
`recent_window` newest slots goes.

    kvviz bench --plugin examples/plugins/window_vote.py --policies snapkv,window-vote
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.reference import RefPolicy
from kvviz.policies import Policy, Rank, check_recent, param


class RefWindowVote(RefPolicy):
    """The slow reference: a list ring per slot, reduced in a loop."""

    name = "window-vote"

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.window = self.params["window"]
        self.protect_recent = self.params["recent_window"]
        self.slot = 0

    def observe(self, weights):
        for i, w in enumerate(weights):
            self.state[i][self.slot] = w
        self.slot = (self.slot + 1) % self.window

    def new_record(self):
        return [0.0] * self.window

    def rank(self, i):
        ring = self.state[i]
        if self.params["reduce"] == "max":
            return max(ring)
        total = 0.0
        for w in ring:  # ring slot 0 upward
            total += w
        return total / self.window


@dataclass
class WindowVote(Policy):
    window: int = param(8, label="window", min=1, max=64, help="observed steps each slot remembers",
                        source="an example value: half of SnapKV's obsWindow")
    reduce: str = param("mean", label="reduce", choices=("mean", "max"),
                        help="how a slot's remembered weights become its score",
                        source="mean is SnapKV's window sum without pooling; max is the example's")
    recent_window: int = param(8, label="recentWindow", min=0, max=1024,
                               help="newest positions never evicted",
                               source="an example value, a quarter of H2O's 32")

    name = "window-vote"
    label = "window vote"
    rank = Rank("score", "window score", "lowest window score goes first")
    reference = RefWindowVote

    def check_params(self):
        check_recent(self)

    def columns(self):
        return {"ring": (np.float32, (self.window,), 0.0)}

    def reset_state(self):
        super().reset_state()
        self.slot = 0

    def observe(self, attn):
        self.col("ring")[self.slot] = attn
        self.slot = (self.slot + 1) % self.window

    def protected_tail(self):
        return self.recent_window

    def score(self):
        ring = self.col("ring")
        if self.reduce == "max":
            return ring.max(axis=0).astype(np.float64)
        return ring.sum(axis=0, dtype=np.float64) / self.window  # slot 0 upward, as SnapKV

    def priority(self):
        return self.score()

    def scores(self):
        return {"score": self.score(), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + 4 * self.window + 8 + 1  # position, the ring, score, eviction scratch
