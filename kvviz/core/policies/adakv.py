"""AdaKV (Feng et al. 2024, arXiv:2407.11550), decode-time: the KV heads of a layer share
heads x budget slots.

At each step every head admits its new position; while the layer holds more than
heads x budget, the candidate with the lowest scorer priority across all heads goes,
except that no head drops below floor(alpha x budget) (kvpress's `alpha_safeguard`). Ties
go to the lower head, then the lower position. Victims come only from each head's own
candidates (its scorer's `candidates()`), ranked by its scorer's `priority()` as is: the
priorities of different heads are compared directly, as kvpress compares the scores of
different heads, so a scorer whose scale differs from head to head shifts slots toward the
heads it scores low.
"""
from dataclasses import dataclass

from kvviz.core.policies.alloc import Allocator, alpha_floor, shared_victims
from kvviz.core.policies.base import Policy, param


@dataclass
class AdaKV(Allocator):
    alpha: float = param(
        0.20, label="alpha", min=0.0, max=1.0, step=0.05,
        help="no head drops below floor(alpha x budget) slots",
        source="kvpress's AdaKVPress alpha_safeguard default 0.20 (Feng et al. 2024)")

    name = "adakv"
    label = "AdaKV"
    victim_order = "shared"  # the lowest priority across the layer's heads goes
    reference = "kvviz.core.reference_alloc:RefAdaKV"

    def check_params(self):
        if self.factory is None:  # built by hand: its scorer is not known yet
            return
        cls = type(self.factory(self.scorer, budget=self.budget, **self.scorer_params))
        if cls.priority is Policy.priority:
            raise ValueError(f"scorer must rank its slots (define priority) to share a layer's "
                             f"budget across heads; {self.scorer} chooses victims without one")

    def floor(self, b):
        return alpha_floor(self.alpha, b)

    def cap(self, b, heads):
        # the others each keep their floor, so one head holds at most the rest
        return heads * b - (heads - 1) * self.floor(b)

    def choose_layer(self, policies, b):
        return shared_victims(policies, len(policies) * b, self.floor(b))
