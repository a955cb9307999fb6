"""One colour per policy: every view's plotly traces against the registry's colours.

A trace that names a policy (or a side, A or B, whose policy the page shows) is drawn in
that policy's declared colour; no trace shows a policy's colour for anything else;
categories (right/wrong, a defended slot, a guess) use colours no policy has."""
import json
import re

import pytest
from apphelp import app, ok
from figurehelp import png_colours, trace_colours

from kvviz.app.figures import common as C
from kvviz.app.figures.loop import perplexity_figure
from kvviz.app.figures.needle import ACCURACY_SCALE
from kvviz.core.policies import ALLOCATORS, POLICIES

# two policies neither of which is a default side, so a view that fell back on the
# default pair's colours (TOVA's orange, SnapKV's blue) shows a colour it may not
A, B = "h2o", "streaming-llm"


def registry() -> dict:
    """policy -> its colour, as the registry declares it (plugins and allocators: their own
    assigned one)."""
    return {n: C.policy_colour(n).upper() for n in [*POLICIES, *ALLOCATORS]}


def test_every_policy_has_its_own_colour_and_categories_have_none_of_them():
    reg = registry()
    for name, cls in POLICIES.items():
        if cls.colour:
            assert reg[name] == cls.colour.upper()
    assert len(set(reg.values())) == len(reg), reg  # no two policies share one
    assert not set(reg.values()) & {c.upper() for c in C.CATEGORY}
    assert not set(reg.values()) & {c.upper() for _, c in ACCURACY_SCALE}
    assert C.RIGHT_COLOUR != C.WRONG_COLOUR


def test_categories_in_other_views_take_no_policys_colour():
    from kvviz.app.figures.heads import HEAD_COLOURS
    from kvviz.app.figures.loop import FULL_COLOUR
    from kvviz.app.figures.votes import ANSWER_COLOUR, GUESS_COLOUR

    reg = set(registry().values())
    for c in (*HEAD_COLOURS, FULL_COLOUR, ANSWER_COLOUR, GUESS_COLOUR, C.KEY_COLOUR):
        assert c.upper() not in reg, c


def test_a_plugin_without_a_colour_gets_the_same_free_one_every_time():
    from kvviz.core.policies import register_policy, unregister_policy
    from kvviz.core.policies.tova import Tova

    class Mine(Tova):
        name = "mine-colourless"
        label = "Mine"
        colour = None

    register_policy(Mine)
    try:
        first = C.policy_colour("mine-colourless")
        assert first == C.policy_colour("mine-colourless")
        assert first in C.PALETTE
        others = {C.policy_colour(n) for n in [*POLICIES, *ALLOCATORS] if n != "mine-colourless"}
        assert first not in others
    finally:
        unregister_policy("mine-colourless")


def test_a_and_b_running_one_policy_keep_its_hue_apart():
    ca, cb = C.pair_colours("snapkv (poolKernel=1)", "snapkv")
    assert ca == C.policy_colour("snapkv") and cb != ca
    assert cb == C.lighter(ca)


def _side(name: str, sides: dict) -> str | None:
    """The policy a trace's name stands for: a registered name in it, else the side it
    names (A or B)."""
    named = [n for n in registry() if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", name)]
    if len(named) == 1:
        return named[0]
    m = re.search(r"(?:^|only |: |tracked \d+: |victim of )(A|B)\b", name)
    return sides[m.group(1)] if m else None


def check_figure(fig: dict, sides: dict) -> int:
    """Every trace of `fig` against the registry; returns how many traces stood for a
    policy (so a check that saw none can fail)."""
    reg = registry()
    owner = {c: n for n, c in reg.items()}
    title = str(((fig.get("layout") or {}).get("title") or {}).get("text") or "")
    m = re.search(r"A = ([\w-]+).*B = ([\w-]+)", title)
    if m:  # the figure says which policies its sides are
        sides = {"A": m.group(1), "B": m.group(2)}
    pair = {C.policy_colour(sides["A"]).upper(), C.policy_colour(sides["B"]).upper()}
    if sides["A"] == sides["B"]:
        pair.add(C.lighter(C.policy_colour(sides["B"])).upper())
    stood = 0
    for t in fig["data"]:
        name = str(t.get("name") or "")
        cols = trace_colours(t)
        who = _side(name, sides)
        policy_cols = {c for c in cols if c in owner}
        if who is not None and who in reg:
            stood += 1
            assert policy_cols <= {reg[who]}, (name, policy_cols)
            assert reg[who] in cols or (sides["A"] == sides["B"]), (name, cols)
        else:  # a state heatmap or a category: only the page's two policies' colours
            assert policy_cols <= pair, (name, policy_cols, sides)
    return stood


def charts(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


TOY = dict(trace="file:toy.npz", layer=0, budget=4, a=A, b=B, step=10, track=5,
           a__recentWindow=1, b__sinks=1)


@pytest.mark.parametrize("view", ["cache", "scores", "divergence", "survival", "tokens",
                                  "compare"])
def test_every_trace_view_draws_each_policy_in_its_colour(view, apptest):
    at = app(**TOY, view=view)
    ok(at)
    figs = charts(at)
    assert figs, view
    for f in figs:
        check_figure(f, {"A": A, "B": B})
    shown = set().union(*(trace_colours(t) for f in figs for t in f["data"]))
    assert {C.policy_colour(A), C.policy_colour(B)} <= shown, (view, shown)
    # the status line's squares too
    line = next(m.value for m in at.markdown if "holds" in m.value and "■" in m.value)
    assert f"color:{C.policy_colour(A)}'>■</span> **A**" in line
    assert f"color:{C.policy_colour(B)}'>■</span> **B**" in line


def test_the_cache_heatmaps_pixels_take_the_pairs_colours(apptest):
    at = app(trace="canonical", budget=512, a=A, b=B, step=1300, view="cache")
    ok(at)
    heat = next(f for f in charts(at) if f["data"] and f["data"][0].get("type") == "image")
    cols = png_colours(heat["data"][0]["source"])
    reg = set(registry().values())
    assert cols & reg == {C.policy_colour(A), C.policy_colour(B)}


def test_the_loop_chart_draws_each_policy_in_its_colour():
    rows = [dict(policy="full", params={}, budget=None, perplexity=10.0)]
    rows += [dict(policy=p, params={}, budget=b, perplexity=11.0 + i + b / 100)
             for i, p in enumerate(["h2o", "random", "tova", "snapkv"]) for b in (64, 128)]
    fig = perplexity_figure(rows).to_dict()
    seen = {t["name"]: t["line"]["color"] for t in fig["data"]}
    for p in ("h2o", "random", "tova", "snapkv"):
        assert seen[p] == C.policy_colour(p), (p, seen)
    assert check_figure(fig, {"A": "tova", "B": "snapkv"}) == 4


def test_two_settings_of_one_policy_differ_and_keep_its_hue():
    """The loop's chart: "snapkv" in SnapKV's colour, "snapkv (poolKernel=1)" in a shade of
    it, another colour, of the same hue."""
    import colorsys

    rows = [dict(policy="snapkv", params=p, budget=b, perplexity=11.0 + b / 100 + len(p))
            for p in ({}, {"poolKernel": 1}) for b in (64, 128)]
    fig = perplexity_figure(rows).to_dict()
    seen = {t["name"]: t["line"]["color"] for t in fig["data"]}
    base, other = seen["snapkv"], seen["snapkv (poolKernel=1)"]
    assert base == C.policy_colour("snapkv") and other.upper() != base.upper()

    def hue(c):
        return colorsys.rgb_to_hls(*(int(c.lstrip("#")[i:i + 2], 16) / 255 for i in (0, 2, 4)))[0]

    assert abs(hue(base) - hue(other)) < 0.02
    assert len({C.setting_colour("snapkv", n).upper() for n in range(5)}) == 5


def test_the_loop_view_and_the_forgetting_view_follow_the_registry(apptest):
    at = app(view="loop", loop="prose-layer", loop__policy="tova", loop__budget=64)
    ok(at)
    for f in charts(at):
        check_figure(f, {"A": "tova", "B": "tova"})
    # scene 12's pair: A = snapkv, B = tova; each keeps its own colour (prefill: what each
    # kept after the prompt's one eviction)
    at = app(view="needle", nbudget=128, nmode="prefill", ngran="layer", nlen=512, ndepth=10,
             nseed=0, npol="snapkv", nvs="tova")
    ok(at)
    figs = charts(at)
    kept = next(f for f in figs if f["layout"]["title"]["text"].startswith("What each kept"))
    assert check_figure(kept, {"A": "snapkv", "B": "tova"}) == 2
    legend = {t["name"]: trace_colours(t) for t in kept["data"] if t.get("name")}
    assert legend["held by A: snapkv"] == {C.policy_colour("snapkv").upper()}
    assert legend["held by B: tova"] == {C.policy_colour("tova").upper()}
    # decode: the cache heatmap over the steps, its sides in their policies' colours
    dec = app(view="needle", nbudget=128, nmode="decode", ngran="layer", npol="tova", nvs="h2o")
    ok(dec)
    heat = next(f for f in charts(dec) if f["layout"]["title"]["text"].startswith("Cache contents"))
    check_figure(heat, {"A": "tova", "B": "h2o"})
    legend = {t["name"]: trace_colours(t) for t in heat["data"] if t.get("name")}
    assert C.policy_colour("tova").upper() in legend["only A (tova)"]
    assert C.policy_colour("h2o").upper() in legend["only B (h2o)"]
    figs += charts(dec)
    grids = [f for f in figs if f["layout"]["title"]["text"].startswith("Pass-key accuracy")]
    assert grids
    scales = [t["colorscale"] for f in grids for t in f["data"] if t.get("colorscale")]
    assert scales  # the right/wrong grid: right and wrong in category colours only
    for scale in scales:
        cols = {c.upper() for _, c in scale if c.startswith("#")}
        assert {C.RIGHT_COLOUR, C.WRONG_COLOUR} <= cols, cols
        assert not cols & set(registry().values()), cols
