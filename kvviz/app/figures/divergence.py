"""View 4: where A and B disagree."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.app.figures.common import base_layout, pair_colours
from kvviz.app.figures.states import NEVER, first_divergence, held_mask, symmetric_difference


def only_sets(ev_a, ev_b, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions held only by A, positions held only by B) after `step`."""
    a, b = held_mask(ev_a, step), held_mask(ev_b, step)
    return np.flatnonzero(a & ~b), np.flatnonzero(b & ~a)


def divergent_positions(ev_a, ev_b) -> np.ndarray:
    """Positions the two policies treat differently at some step (evicted at different steps)."""
    return np.flatnonzero(np.asarray(ev_a) != np.asarray(ev_b))


def decision_step(ev_a, ev_b, position: int) -> int:
    """The step at which the first of the two policies evicted `position` while the other did not
    evict it at that step (-1 if they agree about it)."""
    ea, eb = int(ev_a[position]), int(ev_b[position])
    if ea == eb:
        return NEVER
    return min(e for e in (ea, eb) if e != NEVER)


def divergence_figure(ev_a, ev_b, step: int, *, label_a="A", label_b="B",
                      height: int = 460) -> go.Figure:
    diff = symmetric_difference(ev_a, ev_b)
    ca, cb = pair_colours(label_a, label_b)
    first = first_divergence(ev_a, ev_b)
    only_a, only_b = only_sets(ev_a, ev_b, step)
    fig = make_subplots(rows=2, cols=1, row_heights=[0.62, 0.38], vertical_spacing=0.24,
                        subplot_titles=("|A Δ B| per step",
                                        f"step {step}: only A {len(only_a)} · only B "
                                        f"{len(only_b)}"))
    steps = np.arange(len(diff))
    fig.add_trace(go.Scatter(x=steps, y=diff, name="|A Δ B|", line=dict(color="#6a3d9a", width=2),
                             fill="tozeroy", fillcolor="rgba(106,61,154,0.15)",
                             hovertemplate="step %{x}: %{y} positions differ<extra></extra>"),
                  row=1, col=1)
    fig.add_vline(x=step, line=dict(color="#CC0000", width=1.5, dash="dot"), row=1, col=1)
    if first != NEVER:
        fig.add_vline(x=first, line=dict(color="#6a3d9a", width=1, dash="dash"), row=1, col=1)
        fig.add_annotation(x=first, y=1, yref="y domain", text=f"first divergence: step {first}",
                           showarrow=False, xanchor="left", yanchor="top", row=1, col=1,
                           bgcolor="rgba(255,255,255,0.8)")
    fig.add_trace(go.Scatter(x=only_a, y=np.ones(len(only_a)), mode="markers",
                             name=f"only A: {label_a}",
                             marker=dict(symbol="line-ns-open", size=18, color=ca,
                                         line=dict(width=2, color=ca)),
                             hovertemplate="position %{x}: held only by A<extra></extra>"),
                  row=2, col=1)
    fig.add_trace(go.Scatter(x=only_b, y=np.zeros(len(only_b)), mode="markers",
                             name=f"only B: {label_b}",
                             marker=dict(symbol="line-ns-open", size=18, color=cb,
                                         line=dict(width=2, color=cb)),
                             hovertemplate="position %{x}: held only by B<extra></extra>"),
                  row=2, col=1)
    base_layout(fig, "Divergence", height + 60, legend_below=True)
    fig.update_yaxes(title="positions", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(tickvals=[0, 1], ticktext=["only B", "only A"], range=[-0.6, 1.6], row=2, col=1)
    fig.update_xaxes(title="step", row=1, col=1)
    fig.update_xaxes(title="position", range=[-1, max(step, 1) + 1], row=2, col=1)
    return fig
