"""View 2: do the attention sinks and the newest positions survive?"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.app.figures.common import base_layout, pair_colours
from kvviz.app.figures.states import recent_held_fraction, sinks_held


def survival_figure(ev_a, ev_b, step: int, *, label_a="A", label_b="B", sinks: int = 4,
                    recent: int = 64, height: int = 380) -> go.Figure:
    steps = np.arange(len(ev_a))
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=(f"sinks 0–{sinks - 1} held",
                                        f"{recent} newest held"))
    ca, cb = pair_colours(label_a, label_b)
    for ev, label, colour, dash in ((ev_a, f"A: {label_a}", ca, "solid"),
                                    (ev_b, f"B: {label_b}", cb, "dash")):
        fig.add_trace(go.Scatter(x=steps, y=sinks_held(ev, sinks), name=label, legendgroup=label,
                                 line=dict(color=colour, width=2.5, dash=dash, shape="hv"),
                                 hovertemplate="step %{x}: %{y} sinks held<extra>" + label + "</extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=steps, y=recent_held_fraction(ev, recent), name=label,
                                 legendgroup=label, showlegend=False,
                                 line=dict(color=colour, width=2.5, dash=dash),
                                 hovertemplate="step %{x}: %{y:.1%} of the newest held<extra>"
                                 + label + "</extra>"),
                      row=1, col=2)
    for col in (1, 2):
        fig.add_vline(x=step, line=dict(color="#CC0000", width=1.5, dash="dot"), row=1, col=col,
                      name="step")
    base_layout(fig, "Sinks and recent-window survival", height + 40, legend_below=True)
    fig.update_yaxes(range=[-0.2, sinks + 0.2], dtick=1, title="sinks held", row=1, col=1)
    fig.update_yaxes(range=[-0.03, 1.03], tickformat=".0%", title="held", row=1, col=2)
    fig.update_xaxes(title="step")
    return fig
