"""kvviz.app.figures.room.for_room: each view's figure, built from a real trace, comes back with
every text at least FLOOR px, larger marks, and the input untouched."""
import copy

import numpy as np
import plotly.graph_objects as go
import pytest
from apphelp import REPO

from kvviz.app import figures as V
from kvviz.app.figures import compare as C
from kvviz.app.figures.cache import at_step, cache_heatmap
from kvviz.app.figures.room import FLOOR, PLOTLY_FONT, WRAP, for_room
from kvviz.app.figures.toy import labelled_heatmap
from kvviz.core.replay import run_policy
from kvviz.core.trace import canonical, load_trace


def font_sizes(spec: dict) -> list:
    """Every (where, size) a text takes, with plotly.js's inheritance written out: a font with
    no size takes the layout font's (12 px when that is unset too)."""
    lay = spec["layout"]
    base = (lay.get("font") or {}).get("size", PLOTLY_FONT)
    out = [("layout.font", base)]

    def size(font):
        return (font or {}).get("size", base)

    def title(t):
        return size(t.get("font")) if isinstance(t, dict) else base

    if lay.get("title"):
        out.append(("title", title(lay["title"])))
    for k, ax in lay.items():
        if k.startswith(("xaxis", "yaxis")):
            out.append((k + ".tickfont", size(ax.get("tickfont"))))
            if ax.get("title"):
                out.append((k + ".title", title(ax["title"])))
    out.append(("legend", size((lay.get("legend") or {}).get("font"))))
    out.append(("hoverlabel", (lay.get("hoverlabel") or {}).get("font", {}).get("size", 13)))
    for i, a in enumerate(lay.get("annotations") or ()):
        out.append((f"annotations[{i}]", size(a.get("font"))))
    for i, t in enumerate(spec["data"]):
        if "text" in t or "texttemplate" in t or "textfont" in t:
            out.append((f"data[{i}].textfont", size(t.get("textfont"))))
        cb = t.get("colorbar") or (t.get("marker") or {}).get("colorbar")
        if cb:
            out.append((f"data[{i}].colorbar", size(cb.get("tickfont"))))
    return out


@pytest.fixture(scope="module")
def figures():
    trace = canonical(steps=320)
    a, b = run_policy(trace, "tova", 64), run_policy(trace, "snapkv", 64)
    ea, eb = a.evicted_at, b.evicted_at
    s = 200
    toy = load_trace(REPO / "traces" / "toy.npz")
    ta, tb = run_policy(toy, "tova", 4), run_policy(toy, "snapkv", 4, recent_window=1, obs_window=2, pool_kernel=3)
    panels = [dict(label=n, evicted_at=e, shares=C.held_shares(e)) for n, e in
              (("tova", ea), ("snapkv", eb))]
    return {
        "cache": at_step(cache_heatmap(ea, eb, s, label_a="tova", label_b="snapkv").to_dict(), s),
        "toy": labelled_heatmap(toy, ta.evicted_at, tb.evicted_at, 5),
        "divergence": V.divergence_figure(ea, eb, s),
        "survival": V.survival_figure(ea, eb, s),
        "compare": C.small_multiples(panels, s),
        "compare_survival": C.survival_compare(panels, s),
    }


def test_every_text_reaches_the_floor(figures):
    for name, fig in figures.items():
        before = font_sizes(fig.to_dict() if hasattr(fig, "to_dict") else fig)
        after = font_sizes(for_room(fig))
        small = [(w, v) for w, v in after if v < FLOOR]
        assert not small, (name, small)
        assert len(after) == len(before), name  # every text found again
        # and none came out smaller than the view had it
        for (w0, v0), (w1, v1) in zip(before, after):
            assert w0 == w1 and v1 >= v0, (name, w0, v0, v1)
        assert any(v < FLOOR for _, v in before), name  # the views are not room-sized already


def test_marks_grow_and_the_input_is_untouched(figures):
    for name, fig in figures.items():
        spec = fig.to_dict() if hasattr(fig, "to_dict") else fig
        kept = copy.deepcopy(spec)
        out = for_room(fig)
        np.testing.assert_equal(spec, kept)  # the cached figure is not modified
        for t0, t1 in zip(spec["data"], out["data"]):
            for part in ("marker", "line"):
                v0 = (t0.get(part) or {}).get("size" if part == "marker" else "width")
                if isinstance(v0, (int, float)) and v0 > 0:
                    v1 = t1[part]["size" if part == "marker" else "width"]
                    assert v1 > v0, (name, part, v0, v1)
        for s0, s1 in zip(spec["layout"].get("shapes") or (), out["layout"].get("shapes") or ()):
            if (s0.get("line") or {}).get("width"):
                assert s1["line"]["width"] > s0["line"]["width"], name
        go.Figure(out)  # still a valid plotly figure
        # a finished dict's data arrays are shared, not copied (the whole-run heatmap)
        if isinstance(fig, go.Figure) and type(fig) is go.Figure:
            continue
        for t0, t1 in zip(spec["data"], out["data"]):
            for k in ("z", "source", "x", "y"):
                if k in t0:
                    assert t1[k] is t0[k], (name, k)


def test_a_figure_with_no_sizes_at_all():
    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 0], mode="markers+text", text=["a", "b"],
                               marker=dict(size=[4, 8])))
    fig.update_layout(title="t", xaxis_title="x")
    out = for_room(fig)
    assert all(v >= FLOOR for _, v in font_sizes(out))
    assert out["data"][0]["marker"]["size"] == pytest.approx([5.6, 11.2])
    with pytest.raises(TypeError, match="for_room"):
        for_room([1, 2])


def test_a_long_title_is_wrapped_and_the_margin_holds_it():
    words = [f"w{i}" * (i % 5 + 1) for i in range(40)]
    fig = go.Figure(go.Bar(x=[1], y=[1]))
    fig.update_layout(title=" ".join(words), height=400, margin=dict(t=70, b=50))
    out = for_room(fig)
    lines = out["layout"]["title"]["text"].split("<br>")
    assert len(lines) > 1 and all(len(x) <= WRAP for x in lines)
    assert " ".join(lines).split(" ") == words  # every word kept, in order
    size = out["layout"]["title"]["font"]["size"]
    assert out["layout"]["margin"]["t"] >= 70 * 1.4 + (len(lines) - 1) * size
    # one plot: the plot area's height stays what the view chose
    m = out["layout"]["margin"]
    assert out["layout"]["height"] - m["t"] - m["b"] == 400 - 70 - 50
