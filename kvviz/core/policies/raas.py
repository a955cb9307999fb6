"""RaaS (Hu et al., ACL Findings 2025, "Efficient Long-Decoding Inference with Reasoning-Aware
Attention Sparsity", arXiv:2502.11147): milestone tokens are kept until they go stale.

Each kept position carries a timestamp: the step it was admitted at, refreshed to the
current step whenever that step gives it a weight of at least `alpha` x the step's highest
weight ("still in use"). Over budget, the position with the oldest timestamp goes (least
recently used, ties to the lower position). The paper keeps every prefill token (its
"phoenix tokens"); here the first `sinks` positions are never victims.

Simplifications, stated: the paper's implementation works on pages of tokens, each page
scored by a representative (Quest-style) estimate of its attention; kvviz works per token
on the exact weights, so a page of one. A per-stream policy is not told where the prompt
ends, so the paper's "keep all prefill tokens" is `sinks` protected first positions: set
`sinks` to the prompt's length (with a budget above it) to follow the paper exactly.
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, Rank, param
from kvviz.core.policies.vectorised import StreamState, close_gap


class RaaSStreams(StreamState):
    """RaaS over S streams: each slot's timestamp, (S, cap). Streams counts observed steps
    (`t`), one per step as positions are, so the stamps order the slots as positions would."""

    def __init__(self, policy, S: int, cap: int):
        super().__init__(policy, S, cap)
        self.alpha, self.sinks, self.t = policy.alpha, policy.sinks, 0
        self.stamp, self.spare = np.zeros((S, cap), np.int64), np.zeros((S, cap), np.int64)

    def observe(self, t, attn, n):
        self.t = t
        if n:
            weights = attn.astype(np.float64)
            held = self.stamp[:, :n]
            held[weights >= self.alpha * weights.max(axis=1, keepdims=True)] = t  # still in use

    def admit(self, n):
        self.stamp[:, n] = self.t  # a newcomer is stamped with its own step

    def victim(self, attn, n):
        # The oldest stamp after the sinks; argmin takes the first, the lower position.
        return self.stamp[:, self.sinks: n].argmin(axis=1) + self.sinks

    def remove(self, i, stay):
        close_gap(self.spare, self.stamp, stay)
        self.stamp, self.spare = self.spare, self.stamp


@dataclass
class RaaS(Policy):
    alpha: float = param(
        0.5, label="alpha", min=0.0, max=1.0, step=0.05,
        help="a step refreshes a position's timestamp when it gives it at least alpha x the "
             "step's top weight",
        source="Hu et al. 2025, the RaaS design (a timestamp refreshed whenever the attention "
               "score is high): kvviz's threshold is a fraction of the step's top weight, and 0.5 "
               "is kvviz's choice, not a value checked against the paper")
    sinks: int = param(
        4, label="sinks", min=0, ui_max=1024, help="first positions never evicted",
        source="Hu et al. 2025, the RaaS design keeps every prefill token ('phoenix tokens'); "
               "kvviz keeps the first `sinks` positions (four, as StreamingLLM's sinks) since a "
               "stream is not told where the prompt ends")

    name = "raas"
    label = "RaaS"
    colour = "#AA4499"
    # an integer step, drawn on a linear axis (as counts are)
    rank = Rank("stamp", "last step it was in use", "oldest timestamp goes first", count=True)
    reference = "kvviz.core.reference:RefRaaS"
    vectorised = RaaSStreams

    def check_params(self):
        if self.sinks >= self.budget:
            raise ValueError(f"sinks must be smaller than budget: sinks={self.sinks} >= "
                             f"budget={self.budget} leaves no room to evict")

    def columns(self):
        return {"stamp": (np.int64, (), 0)}

    def advance(self, pos, attn, key_norm=None, value_norm=None):
        if attn is not None and len(attn):
            weights = np.asarray(attn, np.float64)  # compared in double, as the reference does
            self.col("stamp")[weights >= self.alpha * weights.max()] = pos  # still in use
        super().advance(pos, None)
        self.col("stamp")[-1] = pos  # a newcomer is stamped with its own step

    def candidates(self):
        cand = np.ones(self._n, bool)
        cand[: self.sinks] = False
        return cand

    def priority(self):
        return self.col("stamp")
