"""Heads view: held slots per KV head over time, an allocator beside its plain scorer.

Data in (held counts as kvviz.core.layers.replay_layers and a plain replay record them),
Plotly figure out; no policy logic here.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

HEAD_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")


def heads_figure(held, plain, layers, budgets, *, label: str, plain_label: str, budget: int,
                 roles=None, step: int | None = None) -> go.Figure:
    """One panel per layer: each KV head's held count after every step under the allocator
    (solid) and under its plain scorer at the same per-head budget (dashed).

    `held` and `plain` are int (layers, heads, T); `layers` the model layer numbers;
    `budgets` each layer's per-head budget under the allocator; `roles`, optional, a tuple
    per layer of one bool per head (True: a retrieval head), shown in the legend names.
    """
    held, plain = np.asarray(held), np.asarray(plain)
    if held.ndim != 3 or held.shape != plain.shape:
        raise ValueError(f"held and plain must both be (layers, heads, steps), got {held.shape} "
                         f"and {plain.shape}")
    L, H, T = held.shape
    if len(layers) != L or len(budgets) != L:
        raise ValueError(f"layers and budgets must name the {L} layers, got {len(layers)} and "
                         f"{len(budgets)}")
    fig = make_subplots(rows=1, cols=L, shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"layer {lay} (per-head budget {b})"
                                        for lay, b in zip(layers, budgets)])
    x = np.arange(T)
    for d in range(L):
        for g in range(H):
            colour = HEAD_COLOURS[g % len(HEAD_COLOURS)]
            role = ""
            if roles is not None and roles[d] is not None:
                role = " retrieval" if roles[d][g] else " streaming"
            fig.add_trace(go.Scatter(x=x, y=held[d, g], mode="lines", line=dict(color=colour),
                                     name=f"kv{g}{role}: {label}", legendgroup=f"kv{g}",
                                     showlegend=d == 0 or bool(role)), row=1, col=d + 1)
            fig.add_trace(go.Scatter(x=x, y=plain[d, g], mode="lines",
                                     line=dict(color=colour, dash="dash", width=1),
                                     name=f"kv{g}: {plain_label}", legendgroup=f"kv{g}",
                                     showlegend=d == 0), row=1, col=d + 1)
        if step is not None:
            fig.add_vline(x=int(step), line=dict(color="grey", width=1, dash="dot"), row=1, col=d + 1)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="slots held", row=1, col=1)
    fig.update_layout(title=f"Held slots per KV head: {label} vs {plain_label} @ {budget}",
                      height=380, margin=dict(t=70, l=50, r=10, b=40))
    return fig
