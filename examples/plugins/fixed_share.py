"""fixed-share: an example kvviz allocator plugin.

Each layer's heads x budget slots are split into fixed shares by head: head g's share is
`decay` times head g-1's (decay 1: equal shares), rounded so the shares sum to the layer's
total exactly (largest remainders, ties to the lower head). While the layer holds more than
its total, exactly the excess goes, one slot at a time from the head furthest over its
share (ties to the lower head), each head's victims chosen by its scorer.

    kvviz bench --plugin examples/plugins/fixed_share.py --trace traces/code-kv.npz --layer 14 \
        --policies fixed-share --budgets 64
"""
from dataclasses import dataclass

import numpy as np

from kvviz.policies import Allocator, param


@dataclass
class FixedShare(Allocator):
    decay: float = param(0.5, label="decay", min=0.1, max=1.0, step=0.05,
                         help="each head's share of the layer over the previous head's",
                         source="an example: a fixed, uneven split by head index")

    name = "fixed-share"
    label = "Fixed shares"

    def shares(self, heads: int, b: int) -> list[int]:
        """Each head's slots, summing to heads x b."""
        weights = [self.decay ** g for g in range(heads)]
        exact = [heads * b * w / sum(weights) for w in weights]
        out = [int(x) for x in exact]
        for g in sorted(range(heads), key=lambda g: (-(exact[g] - out[g]), g))[: heads * b - sum(out)]:
            out[g] += 1
        return out

    def floor(self, b):
        return 0  # the last head's share may round to nothing

    def cap(self, b, heads):
        return heads * b  # a head may borrow what the others have not filled yet

    def choose_layer(self, policies, b):
        counts = [len(p.held()) for p in policies]
        over = [n - s for n, s in zip(counts, self.shares(len(policies), b))]
        take = [0] * len(policies)
        for _ in range(sum(counts) - len(policies) * b):  # nothing when the layer is within its total
            g = max(range(len(policies)), key=lambda h: (over[h], -h))
            over[g] -= 1
            take[g] += 1
        return [p.choose(k) if k else np.empty(0, np.int64) for p, k in zip(policies, take)]
