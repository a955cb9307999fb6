"""PyramidKV (Cai et al. 2024, arXiv:2406.02069): per-layer budgets fixed in advance,
decreasing linearly with depth, their mean equal to the budget.

With B the budget and L the layers that share it, the first layer's per-head budget is
2B - B/beta and the last's B/beta, evenly spaced between (kvpress's PyramidKVPress
schedule, its window left out: decoding has none); their mean is B exactly. Rounding keeps
the total L x B exactly: every layer takes the floor of its share, and the slots left over
go one each to the layers with the largest fractional parts, ties to the shallower layer.
Within a layer every KV head holds its layer's budget and evicts by its scorer alone.
"""
from dataclasses import dataclass
from fractions import Fraction

from kvviz.core.policies.alloc import Allocator
from kvviz.core.policies.base import param


def pyramid(budget: int, layers: int, beta: int) -> list[int]:
    """Per-layer budgets (first layer first), summing to layers x budget exactly."""
    if layers == 1:
        return [budget]
    low = Fraction(budget, beta)
    high = 2 * budget - low
    step = (high - low) / (layers - 1)
    shares = [high - d * step for d in range(layers)]  # exact: their sum is layers x budget
    out = [s.numerator // s.denominator for s in shares]
    left = layers * budget - sum(out)
    by_fraction = sorted(range(layers), key=lambda d: (-(shares[d] - out[d]), d))
    for d in by_fraction[:left]:
        out[d] += 1
    return out


@dataclass
class PyramidKV(Allocator):
    beta: int = param(
        20, label="beta", min=1, ui_max=100,
        help="the pyramid's steepness: the last layer keeps budget / beta per head",
        source="kvpress's PyramidKVPress beta default 20 (Cai et al. 2024)")

    name = "pyramidkv"
    label = "PyramidKV"

    def layer_budgets(self, depths):
        budgets = pyramid(self.budget, depths, self.beta)
        if min(budgets) < 1:
            raise ValueError(f"beta={self.beta} at budget {self.budget} over {depths} layers leaves "
                             f"the last layer {min(budgets)} slots: each layer needs at least 1 "
                             "(lower beta or raise the budget)")
        return budgets

    def layer_budget(self, depth, depths):
        return self.layer_budgets(depths)[depth]
