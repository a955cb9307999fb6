"""Guided experiments: one click sets the controls to reproduce a documented fact.

Each experiment is data (the state it sets) plus a short explanation; `quiet-hh` also
finds its position from the runs themselves. Nothing here decides what the policies do:
the views then show what the policy core actually computed.
"""
from __future__ import annotations

EXPERIMENTS = {
    "pooling-off": dict(
        title="Pooling off = TOVA",
        state=dict(trace="canonical", budget=512, a="tova", b="snapkv", pa={},
                   pb={"pool_kernel": 1}, step=2048, view="metrics", focus=-1, why=-1),
        text=(
            "SnapKV with **poolKernel = 1** has no max-pool left: it ranks each slot on the "
            "sum of its last obsWindow weights. The canonical trace is stationary inside each "
            "512-step epoch, so that sum orders the slots the same way as the latest weight "
            "alone, which is TOVA's score. Look at the **retained mass** of A and B (below, from "
            "the runs). The caches are not identical, though (Divergence view, then "
            "*jump to next divergence*): for a few dozen steps after each epoch boundary, "
            "SnapKV's window still remembers the old heavy hitters and keeps them a little "
            "longer, where TOVA drops them at once. Once quiet, every position in this trace "
            "receives exactly the same background weight, so holding one quiet position "
            "instead of another changes the retained mass by exactly nothing; heavy-hitter "
            "recall, which counts the past, does move slightly.")),
    "obswindow": dict(
        title="obsWindow changes nothing",
        state=dict(trace="canonical", budget=512, a="snapkv", b="snapkv", pa={"obs_window": 1},
                   pb={"obs_window": 64}, step=2048, view="metrics", focus=-1, why=-1),
        text=(
            "Both sides are SnapKV; A sums the last **1** step, B the last **64**. Inside an "
            "epoch the trace does not change, so a longer window multiplies every slot's score "
            "by about the same factor and the ranking stays put: compare the retained mass "
            "below. The two caches do part ways for a while after each epoch boundary "
            "(the longer window remembers old heavy hitters longer), but only over quiet "
            "positions that all carry the same weight. What B does pay for is memory: the "
            "window is stored per slot (see memory bytes). Try *sweep obsWindow* below.")),
    "budget-256": dict(
        title="Budget 256: TOVA keeps sinks and recents",
        state=dict(trace="canonical", budget=256, a="tova", b="h2o", pa={}, pb={},
                   step=4095, view="survival", focus=-1, why=-1),
        text=(
            "TOVA has no rule protecting the first tokens (attention sinks) or the newest ones. "
            "It keeps them anyway, because they are what the model keeps looking at: see what "
            "TOVA (orange) holds at the last step, below. H2O (blue) keeps the sinks too (they "
            "accumulate the most attention) but protects only a fixed 32 newest positions; the "
            "33rd to 64th newest must compete on *accumulated* score against old heavy "
            "hitters.")),
    "quiet-hh": dict(
        title="The quiet former heavy hitter",
        state=dict(trace="canonical", budget=512, a="tova", b="h2o", pa={}, pb={},
                   view="divergence"),
        text=(
            "A position that was a heavy hitter during the first epoch goes quiet when the "
            "heavy hitters are redrawn at step 512. **TOVA** scores only the current step, so "
            "one quiet step is enough: it evicts the position at the step shown. **H2O** "
            "scores accumulated attention, which this position banked earlier, so H2O keeps "
            "it. The 'why' chart shows the two scores side by side at that step. Neither is "
            "simply right: TOVA wins retained mass here, H2O wins heavy-hitter recall.")),
}


POOLING_TRACE = "prose.npz"  # a real trace shipped in traces/ (SmolLM2, Python docs prose)
EXPERIMENTS["pool-defends"] = dict(
    title="Pooling defends a neighbour",
    state=dict(trace=f"file:{POOLING_TRACE}", layer=0, budget=128, a="tova", b="snapkv", pa={},
               pb={}, view="scores", why=-1, zoom=0),
    text=("SnapKV max-pools each slot's window sum over its poolKernel nearest held slots "
          "before choosing the victim, so a strong slot defends its weak neighbours: the "
          "phrase stays whole. On real text ({trace}, first stored layer, budget 128):"),
)


TOY_TRACE = "toy.npz"  # kvviz/app/toy.py's 16 tokens, shipped in traces/
TOY_PARAMS = {"obs_window": 4, "pool_kernel": 3, "recent_window": 1}  # SnapKV that fits budget 4
EXPERIMENTS = {"toy": dict(
    title="Start here: 16 tokens, budget 4",
    state=dict(trace=f"file:{TOY_TRACE}", layer=0, budget=4, a="tova", b="snapkv", pa={},
               pb=TOY_PARAMS, view="cache", why=-1, zoom=0),
    text=("Sixteen tokens and a cache of **4** slots, every number on the chart: each row is "
          "a step, each cell the attention that step's query paid a position, its colour "
          "who still holds the position. Step with **prev/next** (keys J/K). A is TOVA (the "
          "current step's weight decides), B is SnapKV (the last 4 steps' weights summed, "
          "then max-pooled over 3 neighbouring slots; the newest slot is protected). "
          "The Scores view shows the same numbers as bars.")), **EXPERIMENTS}


def pooling_example(trace, budget: int, params: dict, start: int | None = None):
    """The first step at or after `start` (default: half-way) where SnapKV's max-pool
    defends a slot that the next held slot lifts, while the victim's own window sum is
    higher than the defended slot's, found by replaying the policy and reading its own
    `scores()` before each eviction. Returns (step, `kvviz.app.explain.Pooling` facts) or None."""
    from kvviz.app.explain import defended, pooling_facts
    from kvviz.core.policies import make_policy
    from kvviz.core.replay import Replay

    rp = Replay(trace, make_policy("snapkv", budget=budget, **params))
    start = trace.steps // 2 if start is None else start
    rp.seek(start - 1)
    for t in range(start, trace.steps):
        kept, scores = rp.peek(t)
        victims = rp.step()
        for d in defended(kept, scores, victims):
            f = pooling_facts(kept, scores, victims, int(d), rp.policy, t)
            if (f.defended.distance == 1 and f.victim is not None
                    and f.victim.own > f.defended.own):
                return t, f
    return None


def quiet_heavy_hitter(trace, ev_tova, ev_h2o):
    """(position, step): a heavy hitter of epoch 0 that is not one in epoch 1, evicted by
    TOVA while H2O still holds it; the earliest such TOVA eviction. None if none exists
    (or the trace does not expose its heavy hitters)."""
    if not hasattr(trace, "heavy_hitters"):
        return None
    hh0 = set(int(p) for p in trace.heavy_hitters(0)[0])
    hh1 = set(int(p) for p in trace.heavy_hitters(1)[0]) if trace.steps > 512 else set()
    best = None
    for p in sorted(hh0 - hh1):
        ea, eb = int(ev_tova[p]), int(ev_h2o[p])
        if ea >= 0 and (eb == -1 or eb > ea):
            if best is None or ea < best[1]:
                best = (p, ea)
    return best
