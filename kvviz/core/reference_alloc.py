"""The built-in allocators' rules as plain loops: slow, obviously right, the oracle that
`kvviz check NAME --reference` compares each allocator with, step by step.

A reference allocator is built as `Ref(budget, rng, **params)`, where `params` are the
allocator's (its own and its scorer's, as `Allocator.params` lists them: `scorer` names
the scorer). `ref.group(layer, layers, heads, depth=, depths=)` gives one layer's
reference: `heads` (one reference scorer per KV head, kvviz.core.reference's, each with
`kept`, `held()` and the harness's `advance`), `calibrate(rows)` for an allocator that reads
calibration rows (rows[g][t]: head g's row t, full cache), and `evict()`, the victims'
positions per head after every head has admitted its position. Nothing here calls the fast
allocators' code: budgets, floors and roles are worked out again from each rule as its
docstring states it, with Python ints, Fractions and lists.
"""
from __future__ import annotations

import json
import math
from fractions import Fraction

from kvviz.core.reference import make_reference, shared_choice

__all__ = ["RefAdaKV", "RefCAKE", "RefHeadKV", "RefHeadRoles", "RefPyramidKV", "RefAllocator"]


def _split(params: dict, own: tuple) -> tuple[dict, str, dict]:
    """(the allocator's own parameters, its scorer's name, the scorer's parameters)."""
    mine = {k: v for k, v in params.items() if k in own}
    scorer = params.get("scorer", "tova")
    rest = {k: v for k, v in params.items() if k not in own and k != "scorer"}
    return mine, scorer, rest


def _decimal(x: float) -> Fraction:
    """A float as its decimal spelling: 0.29 is 29/100, not the binary double's value."""
    return Fraction(repr(float(x)))


class RefLayer:
    """One layer's reference heads; `rule` chooses the victims' indices per head."""

    def __init__(self, heads: list, b: int, rule):
        self.heads, self.b, self.rule = heads, b, rule
        self.state = None

    def calibrate(self, rows) -> None:
        """Take the calibration rows (rows[g][t]) before the first step; keep what the rule
        makes of them."""
        self.state = self.rule.calibrate(self, rows)

    def evict(self) -> list:
        """Drop each head's victims (after every head admitted its position); their
        positions per head."""
        chosen = self.rule.choose(self)
        return [ref.drop(sorted(c)) for ref, c in zip(self.heads, chosen)]


class RefAllocator:
    """What every reference allocator shares: each head's reference scorer at the layer's
    per-head budget, and (by default) each head down to that budget by its own rule."""

    own: tuple = ()

    def __init__(self, budget, rng=None, **params):
        self.budget = int(budget)
        self.params, self.scorer, self.scorer_params = _split(params, self.own)

    def layer_budget(self, depth: int, depths: int) -> int:
        """The per-head budget of layer `depth` of `depths`: by default the budget."""
        return self.budget

    def group(self, layer, layers, heads, *, depth=None, depths=None) -> RefLayer:
        """One layer's reference: a reference scorer per KV head at the layer's budget."""
        depth = layer if depth is None else depth
        depths = layers if depths is None else depths
        if depth is None or depths is None:
            depth, depths = 0, 1
        b = self.layer_budget(int(depth), int(depths))
        refs = [make_reference(self.scorer, b, **self.scorer_params) for _ in range(heads)]
        return RefLayer(refs, b, self)

    def calibrate(self, layer: RefLayer, rows):
        """The layer's state from its calibration rows: by default none."""
        return None

    def choose(self, layer: RefLayer) -> list:
        """Each head over the layer's budget loses its own lowest-ranked candidates."""
        return [_lowest(ref, len(ref.keep) - layer.b) for ref in layer.heads]


def _lowest(ref, count: int) -> list:
    """The indices of `ref`'s `count` lowest-ranked candidates (ties: the lower position),
    its own evict rule written out; [] for none."""
    if count <= 0:
        return []
    ref.prepare()
    ranked = sorted((ref.rank(i), ref.keep[i], i) for i in range(len(ref.keep)) if ref.is_candidate(i))
    if len(ranked) < count:
        raise ValueError(f"evict needs {count} victims but only {len(ranked)} slots are candidates")
    return [i for _, _, i in ranked[:count]]


class RefAdaKV(RefAllocator):
    """AdaKV: while the layer's heads hold more than heads x budget, the candidate with the
    lowest rank across all heads goes (ties: the lower head, then the lower position),
    skipping a head that holds floor(alpha x budget) or fewer. Ranks are read once per step,
    before any victim goes."""

    own = ("alpha",)

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.alpha = self.params.get("alpha", 0.2)

    def choose(self, layer):
        floor = math.floor(_decimal(self.alpha) * layer.b)
        return shared_choice(layer.heads, len(layer.heads) * layer.b, floor)


class RefPyramidKV(RefAllocator):
    """PyramidKV: with B the budget, w the scorer's recent window (the newest positions it
    never evicts; 0 for none) and L the layers sharing the budget, layer d (0 the first) holds
    w plus its share of B - w per head: the shares run evenly from 2(B - w) - (B - w)/beta
    down to (B - w)/beta, each rounded down, then the slots left over one each to the layers
    with the largest fractional part (ties: the shallower). Each head holds its layer's
    budget by its scorer alone."""

    own = ("beta",)

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.beta = self.params.get("beta", 20)
        # the newest slots the scorer's reference never offers (its protect_recent)
        self.window = make_reference(self.scorer, self.budget, **self.scorer_params).protect_recent

    def layer_budget(self, depth, depths):
        """The window plus layer `depth`'s share of the pyramid over budget - window."""
        pool = self.budget - self.window
        if depths == 1:
            return self.budget
        shares = []
        for d in range(depths):
            top = 2 * Fraction(pool) - Fraction(pool, self.beta)
            bottom = Fraction(pool, self.beta)
            shares.append(top - (top - bottom) * d / (depths - 1))
        whole = [math.floor(s) for s in shares]
        left = depths * pool - sum(whole)
        order = sorted(range(depths), key=lambda k: (-(shares[k] - whole[k]), k))
        for k in order[:left]:
            whole[k] += 1
        return self.window + whole[depth]


class RefHeadRoles(RefAllocator):
    """Head roles: before the first step each head's proxy is the mean, over its calibration
    rows with any mass, of the share of the row's mass outside its first `stream_sinks` and
    its `stream_recent` newest positions; the ceil(share x heads) heads (at least one) with
    the largest proxy (ties: the lower head) retrieve, the rest stream: StreamingLLM with
    stream_sinks sinks at sinks + recent slots. The retrieval heads share what the streaming
    heads leave of heads x budget: floor(that / r) each, one more to the first (that mod r)
    in proxy order. While the layer is over heads x budget, one slot at a time goes from the
    head furthest over its own budget (ties: a streaming head first, then the lower head),
    each head's slots its own policy's choice."""

    own = ("share", "stream_sinks", "stream_recent", "calibration", "role_table")

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        p = self.params
        self.share = p.get("share", 0.5)
        self.sinks, self.recent = p.get("stream_sinks", 4), p.get("stream_recent", 28)
        self.rows = p.get("calibration", 256)

    def calibrate(self, layer, rows):
        """(each head's budget, whether it retrieves); streaming heads become StreamingLLM."""
        heads = len(layer.heads)
        proxy = []
        for g in range(heads):
            shares = []
            for row in list(rows[g])[: self.rows]:
                row = [float(x) for x in row]
                mass = sum(row)
                outside = row[self.sinks: len(row) - self.recent]
                if len(row) - self.recent <= self.sinks or not mass > 0:
                    continue
                shares.append(sum(outside) / mass)
            proxy.append(sum(shares) / len(shares) if shares else 0.0)
        r = max(1, min(heads, math.ceil(_decimal(self.share) * heads)))
        by_proxy = sorted(range(heads), key=lambda g: (-proxy[g], g))
        streaming = self.sinks + self.recent
        pool = heads * layer.b - (heads - r) * streaming
        budgets, retrieval = [streaming] * heads, [False] * heads
        for k, g in enumerate(by_proxy[:r]):
            retrieval[g] = True
            budgets[g] = pool // r + (1 if k < pool % r else 0)
        for g in range(heads):
            if not retrieval[g]:
                layer.heads[g] = make_reference("streaming-llm", streaming, sinks=self.sinks)
        return budgets, retrieval

    def choose(self, layer):
        budgets, retrieval = layer.state
        heads = len(layer.heads)
        over = [len(ref.keep) - budgets[g] for g, ref in enumerate(layer.heads)]
        excess = sum(len(ref.keep) for ref in layer.heads) - heads * layer.b
        take = [0] * heads
        for _ in range(max(excess, 0)):
            g = max(range(heads), key=lambda h: (over[h], not retrieval[h], -h))
            over[g] -= 1
            take[g] += 1
        return [_lowest(ref, k) for ref, k in zip(layer.heads, take)]



class RefHeadKV(RefAllocator):
    """HeadKV: layer `layer`'s scores s_g come from the table file (its layer; as many as the
    layer's heads, else refused). With w the scorer's recent window and B' = b - w (b the
    per-head budget; B' < 1: every head keeps b), each head keeps B' - floor(B' / beta) and
    gives floor(B' / beta) to the layer's pool P; head g's share is P x s_g^temp / sum of
    s^temp, rounded down, the slots left over one each to the largest fractional parts (ties:
    the lower head). Head g holds w + base + share, by its own scorer."""

    own = ("scores", "beta", "temp", "window")

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.path = self.params["scores"]
        self.beta = self.params.get("beta", 1.005)
        self.temp = self.params.get("temp", 1.0)
        if "recent_window" in self.scorer_params:  # HeadKV's window is the scorer's recent window
            self.scorer_params["recent_window"] = self.params.get("window", 32)
        self.window = make_reference(self.scorer, self.budget, **self.scorer_params).protect_recent

    def budgets(self, layer, b, heads):
        """Each head's budget in `layer` (per-head mean `b`), from the score table by hand."""
        with open(self.path) as f:
            table = json.load(f)["layers"]
        scores = table.get(str(layer))
        if scores is None or len(scores) != heads:
            raise ValueError(f"the table gives layer {layer} no scores for {heads} heads")
        rest = b - self.window
        if rest < 1:
            return [b] * heads
        give = math.floor(Fraction(rest) / _decimal(self.beta))
        base = rest - give
        pool = heads * give
        weights = [Fraction(float(s) ** float(self.temp)) for s in scores]
        total = sum(weights)
        shares = [pool * w / total for w in weights]
        whole = [math.floor(x) for x in shares]
        order = sorted(range(heads), key=lambda g: (-(shares[g] - whole[g]), g))
        for g in order[: pool - sum(whole)]:
            whole[g] += 1
        return [self.window + base + k for k in whole]

    def group(self, layer, layers, heads, *, depth=None, depths=None):
        where = layer if layer is not None else (depth or 0)
        layer_ref = super().group(layer, layers, heads, depth=depth, depths=depths)
        budgets = self.budgets(where, layer_ref.b, heads)
        layer_ref.heads = [make_reference(self.scorer, k, **self.scorer_params) for k in budgets]
        layer_ref.state = budgets
        return layer_ref

    def choose(self, layer):
        return [_lowest(ref, len(ref.keep) - k) for ref, k in zip(layer.heads, layer.state)]


class RefCAKE(RefAllocator):
    """CAKE. Layer budgets: from each layer's calibration rows (rows[g][t], the first
    `calibration`), the window is the last `window` rows and the prefix the positions before
    the window's first row; spread H = -sum a log(a + 1e-10) and shift V = sum of the
    unbiased variance over the window's rows, over heads and prefix positions; P = H^(1/tau1)
    x V^(1/tau2). With w the scorer's recent window (at most budget - 1) and
    S = L x (budget - w - 1), layer l holds w + 1 + floor(P_l / sum P x S), the slots left
    over one each from the shallowest layer (equal shares first when more than L are left). No prefix or no
    preference: every layer keeps the budget. Within a layer, each head over the layer's
    budget loses its candidates with the lowest indicator: over the scorer's ring of
    observed weights (ring slot 0 upward), mean + gamma x unbiased variance, averaged over
    the kept neighbours within 2 slots; ties to the lower position."""

    own = ("tau1", "tau2", "gamma", "window", "calibration")

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        p = self.params
        self.tau1, self.tau2 = p.get("tau1", 1.0), p.get("tau2", 1.0)
        self.gamma, self.window = p.get("gamma", 200.0), p.get("window", 32)
        self.rows = p.get("calibration", 64)
        if self.scorer != "snapkv" or self.window >= self.rows:
            raise ValueError("cake needs the snapkv scorer and a window below calibration")
        # the window is the scorer's recent window and its ring
        self.scorer_params.update(recent_window=self.window, obs_window=self.window)
        self.tail = make_reference(self.scorer, self.budget, **self.scorer_params).protect_recent

    def plan_layers(self, rows_by_layer):
        """Every layer's per-head budget, or None to keep the budget everywhere."""
        prefs = []
        for rows in rows_by_layer:
            n = min(len(r) for r in rows)
            prefix = n - self.window
            if prefix < 1:
                return None
            spread, shift = 0.0, 0.0
            for head in rows:
                for j in range(prefix):
                    column = [float(head[t][j]) for t in range(prefix, n)]
                    for a in column:
                        spread -= a * math.log(a + 1e-10)
                    if self.window > 1:
                        mean = sum(column) / len(column)
                        shift += sum((a - mean) * (a - mean) for a in column) / (len(column) - 1)
            prefs.append(0.0 if spread <= 0 or shift <= 0 else
                         spread ** (1.0 / self.tau1) * shift ** (1.0 / self.tau2))
        if not sum(prefs) > 0:
            return None
        L = len(prefs)
        tail = min(self.tail, self.budget - 1)
        pool = L * (self.budget - tail) - L  # after one slot beyond the window each
        shares = [math.floor(p / sum(prefs) * pool) for p in prefs]
        left = pool - sum(shares)
        for d in range(L):
            shares[d] += left // L + (1 if d < left % L else 0)
        return [tail + 1 + s for s in shares]

    def group(self, layer, layers, heads, *, depth=None, depths=None, budget=None):
        layer_ref = super().group(layer, layers, heads, depth=depth, depths=depths)
        if budget is not None:
            layer_ref.b = int(budget)
            layer_ref.heads = [make_reference(self.scorer, int(budget), **self.scorer_params)
                               for _ in range(heads)]
        return layer_ref

    def indicator(self, ref) -> list:
        """Per held slot, the pooled mean + gamma x variance of its ring."""
        raw = []
        for ring in ref.state:
            values = [float(x) for x in ring]
            total = 0.0
            for x in values:
                total += x
            mean = total / len(values)
            sq = 0.0
            for x in values:
                sq += (x - mean) * (x - mean)
            var = sq / (len(values) - 1) if len(values) > 1 else sq
            raw.append(mean + self.gamma * var)
        out = []
        for i in range(len(raw)):
            lo, hi = max(0, i - 2), min(len(raw) - 1, i + 2)
            total = 0.0
            for j in range(lo, hi + 1):
                total += raw[j]
            out.append(total / (hi - lo + 1))
        return out

    def choose(self, layer):
        chosen = []
        for ref in layer.heads:
            excess = len(ref.keep) - layer.b
            if excess <= 0:
                chosen.append([])
                continue
            score = self.indicator(ref)
            ranked = sorted((score[i], ref.keep[i], i) for i in range(len(ref.keep)) if ref.is_candidate(i))
            if len(ranked) < excess:
                raise ValueError("evict needs more victims than the head has candidates")
            chosen.append([i for _, _, i in ranked[:excess]])
        return chosen
