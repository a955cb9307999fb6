"""View 1: what each policy holds, step by step (the cache-contents heatmap).

Drawn as one PNG image (server-side aggregation to <= 1024 pixels per axis, each pixel the
most frequent state of its block of cells) plus a coarse transparent hover grid whose cells
say their step range, position range and the share of each state. A per-cell `go.Heatmap`
with hover text costs seconds to draw and megabytes to send; the image costs kilobytes.
"""
from __future__ import annotations

import base64
import html
import io

import numpy as np
import plotly.graph_objects as go
from PIL import Image

from kvviz.app.explain import visible_token
from kvviz.app.figures.common import base_layout, range_label
from kvviz.app.figures.states import (
    BOTH,
    NEITHER,
    NOT_YET,
    ONLY_A,
    ONLY_B,
    STATE_COLOURS,
    bin_edges,
    display_state,
    dominant_state,
    state_colours,
    state_counts,
)

DEFAULT_MAX_BINS = 1024
HOVER_BINS = 64
LEGEND_ORDER = (BOTH, ONLY_A, ONLY_B, NEITHER, NOT_YET)


def state_labels(label_a: str, label_b: str) -> dict[int, str]:
    return {NOT_YET: "not yet generated", NEITHER: "evicted by both",
            ONLY_B: f"only B ({label_b})", ONLY_A: f"only A ({label_a})", BOTH: "held by both"}


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    h = hex_colour.lstrip("#")
    return tuple(int(h[i:i + 2], 16) for i in (0, 2, 4))


def palette(colours: dict | None = None) -> np.ndarray:
    """(5, 3) uint8 RGB indexed by state code, for `colours` (states.state_colours)."""
    colours = colours or STATE_COLOURS
    return np.array([_rgb(colours[c]) for c in range(5)], np.uint8)


PALETTE = palette()  # the default pair's (TOVA, SnapKV)


def codes_to_png(codes: np.ndarray, colours: dict | None = None) -> str:
    """State codes (rows, cols) -> 'data:image/png;base64,...' in the states' `colours`
    (default: the default pair's)."""
    img = Image.fromarray(palette(colours)[codes.astype(np.intp)], mode="RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _coarser(edges: np.ndarray, max_bins: int):
    """(coarse edges, their indices into `edges`): every k-th fine edge, <= max_bins bins."""
    n = len(edges) - 1
    k = max(1, -(-n // max(1, int(max_bins))))
    idx = np.arange(0, n, k)
    return np.append(edges[idx], edges[-1]), idx


def heatmap_grid(ev_a, ev_b, max_bins: int = DEFAULT_MAX_BINS, hover_bins: int = HOVER_BINS,
                 label_a: str = "A", label_b: str = "B", steps_range=None, pos_range=None,
                 tokens=None):
    """Everything the figure needs that does not depend on the current step (cacheable).

    Pixels: `states.display_state` (most frequent state, but a disagreement covering a
    full line of the block wins, so one-position differences stay visible); hover: exact
    shares of every state in larger blocks.

    `steps_range` / `pos_range` = (first, end) restrict the grid (a zoomed view); default all.
    `tokens` (optional) adds the text of each hover block's positions to its hover.
    """
    steps = len(ev_a)
    s0, s1 = steps_range or (0, steps)
    p0, p1 = pos_range or (0, steps)
    step_edges = bin_edges(s1, max_bins, s0)
    pos_edges = bin_edges(p1, max_bins, p0)
    counts = state_counts(ev_a, ev_b, step_edges, pos_edges)
    _, shares = dominant_state(counts)
    codes = display_state(counts, step_edges, pos_edges)
    # hover blocks are unions of whole pixel blocks, so their counts are sums of pixel counts
    h_step, si = _coarser(step_edges, hover_bins)
    h_pos, pi = _coarser(pos_edges, hover_bins)
    h_counts = np.add.reduceat(np.add.reduceat(counts, si, axis=1), pi, axis=2)
    return dict(codes=codes, shares=shares, step_edges=step_edges, pos_edges=pos_edges,
                hover_step_edges=h_step, hover_pos_edges=h_pos, hover_counts=h_counts,
                png=codes_to_png(codes, state_colours(label_a, label_b)), labels=(label_a, label_b),
                hover_text=_hover_text(h_counts, h_step, h_pos, state_labels(label_a, label_b),
                                       tokens))


def _snippet(tokens, p0: int, p1: int, limit: int = 12) -> str:
    text = "".join(visible_token(t) for t in tokens[p0:min(p1, p0 + limit)])
    text = html.escape(text[:60]) + ("…" if p1 - p0 > limit or len(text) > 60 else "")
    return f"<br>tokens: <i>{text}</i>"


def _hover_text(counts, step_edges, pos_edges, names, tokens=None) -> list[list[str]]:
    total = counts.sum(axis=0)
    snippets = [_snippet(tokens, a, b) if tokens is not None else ""
                for a, b in zip(pos_edges[:-1], pos_edges[1:])]
    text = []
    for i, (s0, s1) in enumerate(zip(step_edges[:-1], step_edges[1:])):
        row = []
        for j, (p0, p1) in enumerate(zip(pos_edges[:-1], pos_edges[1:])):
            if counts[NOT_YET, i, j] == total[i, j]:  # half the grid; without the ranges
                row.append(names[NOT_YET] + snippets[j])  # the default page is 550 -> 340 KB
                continue
            head = f"steps {range_label(s0, s1)}<br>positions {range_label(p0, p1)}{snippets[j]}"
            parts = []
            for c in LEGEND_ORDER:
                n = counts[c, i, j]
                if n:
                    share = n / total[i, j]
                    parts.append(f"{names[c]}" if share == 1 else f"{names[c]}: {share:.0%}")
            row.append(head + "<br><b>" + "<br>".join(parts) + "</b>")
        text.append(row)
    return text


def cache_heatmap(ev_a, ev_b, step: int, *, label_a: str = "A", label_b: str = "B",
                  max_bins: int = DEFAULT_MAX_BINS, grid: dict | None = None,
                  height: int = 560) -> go.Figure:
    """Step (rows, step 0 at the top) x position (columns), coloured by A/B cache state.

    `grid` may pass a precomputed `heatmap_grid(...)` (it does not depend on `step`).
    """
    g = grid or heatmap_grid(ev_a, ev_b, max_bins)
    names = state_labels(label_a, label_b)
    colours = state_colours(label_a, label_b)
    if g.get("hover_text") is None or g.get("labels") != (label_a, label_b):
        g["hover_text"] = _hover_text(g["hover_counts"], g["hover_step_edges"],
                                      g["hover_pos_edges"], names)
        if g.get("labels") != (label_a, label_b):  # other policies: their colours
            g["png"] = codes_to_png(g["codes"], colours)
        g["labels"] = (label_a, label_b)
    se, pe = g["step_edges"], g["pos_edges"]
    dy, dx = int(se[1] - se[0]), int(pe[1] - pe[0])
    fig = go.Figure()
    fig.add_trace(go.Image(source=g["png"], x0=int(pe[0]) + (dx - 1) / 2, dx=dx,
                           y0=int(se[0]) + (dy - 1) / 2, dy=dy, hoverinfo="skip",
                           name="cache states"))
    hs, hp = g["hover_step_edges"], g["hover_pos_edges"]
    fig.add_trace(go.Heatmap(
        z=np.zeros((len(hs) - 1, len(hp) - 1), np.int8),
        x=((hp[:-1] + hp[1:] - 1) / 2), y=((hs[:-1] + hs[1:] - 1) / 2),
        text=g["hover_text"],
        colorscale=[[0, "rgba(0,0,0,0)"], [1, "rgba(0,0,0,0)"]], showscale=False,
        hovertemplate="%{text}<extra></extra>", name="hover", hoverongaps=False))
    for c in LEGEND_ORDER:  # legend entries (no data)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=names[c],
                                 marker=dict(symbol="square", size=14, color=colours[c],
                                             line=dict(color="#888888", width=1))))
    step = int(np.clip(step, 0, len(ev_a) - 1))
    fig.add_hline(y=step, line=dict(color="#CC0000", width=2), name="step")
    fig.add_annotation(x=0, xref="paper", xanchor="left", y=step, yanchor="bottom", name="step",
                       text=f"step {step}", showarrow=False,
                       font=dict(color="#CC0000", size=13), bgcolor="rgba(255,255,255,0.85)")
    base_layout(fig, f"Cache contents over time: A = {label_a}, B = {label_b}", height)
    fig.update_xaxes(title="position", range=[pe[0] - 0.5, pe[-1] - 0.5], showgrid=False,
                     zeroline=False)
    fig.update_yaxes(title="step", range=[se[-1] - 0.5, se[0] - 0.5], showgrid=False, zeroline=False,
                     scaleanchor=False, constrain="range")
    # the legend pinned to the figure's bottom edge, under the "position" axis title (a
    # legend hung from the plot, y=-0.12, sat on that title)
    fig.update_layout(legend=dict(orientation="h", yref="container", y=0.005, yanchor="bottom",
                                  x=0, xanchor="left"), margin=dict(b=110))
    return fig


class Prebuilt(go.Figure):
    """A finished figure dict that `st.plotly_chart` sends as it is.

    Handed a Figure, `st.plotly_chart` deep-copies it (`to_dict`: every hover string, ~9 ms
    for the whole-run heatmap); handed a dict, it re-validates it (slower still). This Figure
    is only a wrapper around a dict that was validated when it was built: `to_dict` returns
    it, so nothing is copied or checked again. Read-only: nothing may modify the dict.
    """

    def __init__(self, spec: dict):  # no super().__init__: that is the copy being avoided
        object.__setattr__(self, "_spec", spec)

    def to_dict(self) -> dict:
        return self._spec

    def to_plotly_json(self) -> dict:
        return self._spec

    def __repr__(self) -> str:
        return f"Prebuilt({len(self._spec.get('data', ()))} traces)"


def _moved(shape: dict, step: int) -> dict:
    """A "step" line at `step`: a vertical one (spanning its y axis's domain, as `add_vline`
    draws it) along x, a horizontal one along y."""
    if str(shape.get("yref", "")).endswith("domain"):
        return dict(shape, x0=step, x1=step)
    return dict(shape, y0=step, y1=step)


def at_step(figure: dict, step: int) -> Prebuilt:
    """`figure` (a `cache_heatmap(...).to_dict()`, or any figure whose step marks are shapes
    and annotations named "step") with its step lines and label moved to `step`.

    Everything else in the figure is independent of the step, so the app builds it once per
    configuration (server-wide) and moves the marker per session and rerun, sharing the data
    (hover strings, image) with the cached figure instead of copying it; a notebook's widget
    sends the moved marks for each step of its window. `figure` is not modified.
    """
    lay = dict(figure["layout"])
    lay["shapes"] = [_moved(sh, step) if sh.get("name") == "step" else sh
                     for sh in lay.get("shapes", ())]
    lay["annotations"] = [dict(an, y=step, text=f"step {step}") if an.get("name") == "step"
                          else an for an in lay.get("annotations", ())]
    return Prebuilt({"data": figure["data"], "layout": lay})


def without_hover(figure: Prebuilt) -> Prebuilt:
    """`figure` without its hover layer (the invisible per-block heatmap named "hover" that
    carries the exact shares, two thirds of the figure's bytes). Shares the rest."""
    spec = figure.to_dict()
    return Prebuilt({**spec, "data": [t for t in spec["data"] if t.get("name") != "hover"]})
