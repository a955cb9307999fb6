"""The tracked position drawn on other views' output (a column on the heatmap, its token
outlined in the strip). Pure: figure dicts and HTML in, new ones out."""
from __future__ import annotations

from kvviz.app.figures.cache import Prebuilt
from kvviz.app.figures.common import pair_colours
from kvviz.core.replay import NEVER

TRACK_COLOUR = "#CC0000"


def heatmap_with_track(figure, position: int, ev_a, ev_b, steps: int,
                       label_a: str = "A", label_b: str = "B",
                       hide_from: int | None = None) -> Prebuilt:
    """The cache heatmap (a Prebuilt or its dict) with the tracked position's column
    outlined from its creation and a marker where each policy evicts it. `hide_from`: the
    page hides that step and later ones (logs cut there): a policy that has not evicted the
    position before it gets no marker. Not modified."""
    spec = figure.to_dict() if hasattr(figure, "to_dict") else figure
    lay = dict(spec["layout"])
    p = int(position)
    lay["shapes"] = list(lay.get("shapes", ())) + [dict(
        type="rect", x0=p - 0.5, x1=p + 0.5, y0=p - 0.5, y1=steps - 0.5, name="track",
        line=dict(color=TRACK_COLOUR, width=1.5, dash="dot"))]
    data = list(spec["data"])
    ca, cb = pair_colours(label_a, label_b)
    for who, label, ev, colour in (("A", label_a, ev_a, ca), ("B", label_b, ev_b, cb)):
        e = int(ev[p])
        if hide_from is not None and (e == NEVER or e >= hide_from):
            continue
        text = (f"tracked position {p}: {who} ({label}) "
                + ("holds it to the end" if e == NEVER else f"evicts it at step {e}"))
        data.append(dict(type="scatter", x=[p], y=[steps - 1 if e == NEVER else e],
                         mode="markers", name=f"tracked {p}: {who} "
                         + ("holds it" if e == NEVER else f"evicts at {e}"),
                         marker=dict(symbol="circle" if e == NEVER else "x", size=14,
                                     color=colour, line=dict(color="black", width=1.5)),
                         hovertemplate=text + "<extra></extra>"))
    return Prebuilt({"data": data, "layout": lay})


def heatmap_with_divergence(figure, position: int, step: int) -> Prebuilt:
    """The cache heatmap (a Prebuilt or its dict) with the next-divergence jump's position
    marked where it diverged: a ringed cell at (position, step). Not modified."""
    spec = figure.to_dict() if hasattr(figure, "to_dict") else figure
    p, s = int(position), int(step)
    mark = dict(type="scatter", x=[p], y=[s], mode="markers+text",
                text=[f"position {p}"], textposition="middle right",
                textfont=dict(color=TRACK_COLOUR, size=13), cliponaxis=False,
                name=f"next divergence: position {p} at step {s}",
                marker=dict(symbol="circle-open", size=22, color=TRACK_COLOUR,
                            line=dict(color=TRACK_COLOUR, width=3)),
                hovertemplate=f"diverged here: position {p}, step {s}<extra></extra>")
    return Prebuilt({"data": list(spec["data"]) + [mark], "layout": dict(spec["layout"])})


def strip_track_css(position: int) -> str:
    """A style that outlines the tracked token in `token_strip_html` (its spans are titled
    'position N: ...')."""
    return (f"<style>.kv-tok[title^='position {int(position)}:']"
            f"{{outline:3px solid {TRACK_COLOUR};outline-offset:1px}}</style>")
