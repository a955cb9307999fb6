"""Small traces with their numbers on the chart (the toy trace: 16 tokens at budget 4).

Up to SMALL steps every cell of the cache heatmap is drawn as its own square, coloured by
the A/B cache state after that step and labelled with the attention weight that step's
query paid the position in the full trace (what the policies were shown, before their own
renormalisation); score bars carry their values.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from kvviz.app.explain import visible_token
from kvviz.app.figures.cache import LEGEND_ORDER, state_labels
from kvviz.app.figures.common import base_layout
from kvviz.app.figures.states import BOTH, NOT_YET, ONLY_B, state_colours, states_at

SMALL = 32  # steps: at most this many, every cell is labelled
_DARK = {BOTH, ONLY_B}  # states whose colour needs white text


def cell_weights(trace) -> np.ndarray:
    """(steps, steps) float64: row t = the full trace's row t at positions 0..t-1, NaN beyond."""
    n = trace.steps
    w = np.full((n, n), np.nan)
    for t in range(1, n):
        w[t, :t] = trace.row(t)
    return w


def labelled_heatmap(trace, ev_a, ev_b, step: int, *, label_a="A", label_b="B",
                     track: int = -1, height: int = 620) -> go.Figure:
    """Every (step, position) cell: its A/B state (colour) and its attention weight (text)."""
    n = trace.steps
    codes = np.stack([states_at(ev_a, ev_b, s) for s in range(n)]).astype(int)
    w = cell_weights(trace)
    names = state_labels(label_a, label_b)
    colours = state_colours(label_a, label_b)
    scale = [[c / 4, colours[c]] for c in range(5)]
    toks = trace.tokens or [""] * n
    xlab = [f"{p} {visible_token(toks[p])}".strip() for p in range(n)]
    hover = [[f"step {s}, position {p}{' ' + repr(toks[p]) if trace.tokens else ''}<br>"
              f"{names[codes[s, p]]}<br>attention weight "
              f"{'-' if np.isnan(w[s, p]) else f'{w[s, p]:.3f}'}" for p in range(n)]
             for s in range(n)]
    fig = go.Figure(go.Heatmap(z=codes, zmin=0, zmax=4, colorscale=scale, showscale=False,
                               x=list(range(n)), y=list(range(n)), xgap=2, ygap=2,
                               text=hover, hovertemplate="%{text}<extra></extra>",
                               name="cache states"))
    ss, pp = np.nonzero(~np.isnan(w))
    fig.add_trace(go.Scatter(
        x=pp, y=ss, mode="text", text=[f"{w[s, p]:.2f}" for s, p in zip(ss, pp)],
        textfont=dict(size=13, color=["white" if codes[s, p] in _DARK else "#111111"
                                      for s, p in zip(ss, pp)]),
        hoverinfo="skip", showlegend=False, name="weights"))
    for c in LEGEND_ORDER:
        if c != NOT_YET:
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=names[c],
                                     marker=dict(symbol="square", size=14, color=colours[c],
                                                 line=dict(color="#888888", width=1))))
    fig.add_shape(type="rect", x0=-0.5, x1=n - 0.5, y0=step - 0.5, y1=step + 0.5,
                  line=dict(color="#CC0000", width=3), name="step")
    if 0 <= track < n:
        fig.add_shape(type="rect", x0=track - 0.5, x1=track + 0.5, y0=-0.5, y1=n - 0.5,
                      line=dict(color="#CC0000", width=2, dash="dot"), name="track")
    base_layout(fig, f"Who holds what, with every weight (step {step} boxed in red)", height)
    fig.update_xaxes(title="position", tickmode="array", tickvals=list(range(n)),
                     ticktext=xlab, tickangle=-45, tickfont=dict(size=13), range=[-0.5, n - 0.5],
                     showgrid=False, zeroline=False)
    fig.update_yaxes(title="step (row: that step's attention; colour: state after it)",
                     autorange=False, range=[n - 0.5, -0.5], dtick=1, showgrid=False,
                     zeroline=False)
    fig.update_layout(legend=dict(orientation="h", y=-0.2, yanchor="top", x=0, xanchor="left"),
                      margin=dict(b=130))
    return fig


def label_bars(fig: go.Figure, digits: int = 3) -> go.Figure:
    """Every bar of `fig` labelled with its value (in place; returns it)."""
    for tr in fig.data:
        if tr.type == "bar" and tr.y is not None:
            y = np.asarray(tr.y, float)
            tr.text = ["" if not np.isfinite(v) else f"{v:.{digits}g}" for v in y]
            tr.textposition = "outside"
            tr.textfont = dict(size=13)
            tr.cliponaxis = False
    return fig
