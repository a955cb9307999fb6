"""PyramidKV (Cai et al. 2024, arXiv:2406.02069): per-layer budgets fixed in advance,
decreasing linearly with depth, their mean equal to the budget.

With B the budget and L the layers that share it, the first layer's per-head budget is
2B - B/beta and the last's B/beta, evenly spaced between (kvpress's PyramidKVPress
schedule, its window left out: decoding has none); their mean is B exactly. Rounding keeps
the total L x B exactly: every layer takes the floor of its share, and the slots left over
go one each to the layers with the largest fractional parts, ties to the shallower layer.
Within a layer every KV head holds its layer's budget and evicts by its scorer alone.

A scorer that never evicts its newest w positions (SnapKV's and H2O's `recentWindow`: its
`protected_tail()`) keeps that window in every layer, and the pyramid shares out the rest:
layer d holds w + pyramid(B - w)[d] per head, so the total is still L x B and every layer
holds more than its window. This is the paper's code (KVCache-Factory's PyramidKVCluster:
each layer keeps `window_size` recent positions plus its pyramid share of
`max_capacity_prompt - window_size`) and kvpress's PyramidKVPress.get_layer_budget, which
builds the pyramid from `max_capacity_prompt - window_size` the same way. Where even the
last layer's share of B - w is no slot, the refusal names that layer, its share and the
options that fix it.
"""
from dataclasses import dataclass
from fractions import Fraction

from kvviz.core.policies.alloc import Allocator
from kvviz.core.policies.base import Place, param


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

    # PyramidKV shares out the budget per layer, each head then evicting by its scorer
    victim_order = "per_head"
    reference = "kvviz.core.reference_alloc:RefPyramidKV"

    def check_params(self):
        # the scorer's recent window, read once from a scorer built at the budget (none
        # without a scorer factory: then no scorer is built either)
        self._window = 0 if self.factory is None else int(
            self.build_policy(self.scorer, self.budget, Place(), **self.scorer_params).protected_tail())

    def window(self) -> int:
        """The newest positions the scorer never evicts (its protected tail)."""
        return self._window

    def layer_budgets(self, depths):
        w = self.window()
        shares = pyramid(self.budget - w, depths, self.beta)
        if min(shares) < 1:
            d = shares.index(min(shares))
            where = f"layer {d}" + (f" (the last of the {depths} that share it, counted from 0)"
                                    if d == depths - 1 else f" of the {depths} that share it")
            if w:
                raise ValueError(
                    f"beta={self.beta} at budget {self.budget} over {depths} layers leaves {where} "
                    f"{w + shares[d]} slots per head, only the scorer's recent window of {w}: its "
                    f"share of budget - recentWindow = {self.budget - w} is {shares[d]}, and each "
                    "layer needs at least 1 slot beyond the window (lower beta, raise the budget or "
                    "lower the scorer's recentWindow)")
            raise ValueError(f"beta={self.beta} at budget {self.budget} over {depths} layers leaves "
                             f"{where} {shares[d]} slots per head (its share of the budget): each "
                             "layer needs at least 1 (lower beta or raise the budget)")
        return [w + s for s in shares]

    def layer_budget(self, depth, depths):
        return self.layer_budgets(depths)[depth]
