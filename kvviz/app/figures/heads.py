"""Heads view: held slots per KV head over time, an allocator beside its plain scorer.

Data in (held counts as kvviz.core.layers.replay_layers and a plain replay record them),
Plotly figure out; no policy logic here.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

# one per KV head: categories, so none is a policy's colour (kvviz.app.figures.common)
HEAD_COLOURS = ("#332288", "#882255", "#117733", "#000000", "#6A3D9A", "#8C564B", "#2F4F4F",
                "#B8860B")


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
            role = ""  # a head's role is its layer's: said with the layer
            if roles is not None and roles[d] is not None:
                role = (" retrieval" if roles[d][g] else " streaming") + f" (layer {layers[d]})"
            fig.add_trace(go.Scatter(x=x, y=held[d, g], mode="lines", line=dict(color=colour),
                                     name=f"kv{g}{role}: {label}", legendgroup=f"kv{g}",
                                     showlegend=d == 0 or bool(role)), row=1, col=d + 1)
            fig.add_trace(go.Scatter(x=x, y=plain[d, g], mode="lines",
                                     line=dict(color=colour, dash="dash", width=1),
                                     name=f"kv{g}: {plain_label}", legendgroup=f"kv{g}",
                                     showlegend=d == 0), row=1, col=d + 1)
        if step is not None:
            fig.add_vline(x=int(step), line=dict(color="grey", width=1, dash="dot"), row=1, col=d + 1,
                          name="step")
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="slots held", row=1, col=1)
    shown = sum(1 for tr in fig.data if tr.showlegend)
    # the title pinned to the top, the panels' titles under it; as tall as the legend's
    # entries need (one a line), so the legend never scrolls
    fig.update_layout(title=dict(text=f"Held slots per KV head: {label} vs {plain_label} @ {budget}",
                                 yref="container", y=1, yanchor="top", pad=dict(t=10)),
                      height=max(380, 150 + 24 * shown), margin=dict(t=100, l=50, r=10, b=40))
    return fig


def eviction_grid(runs, position: int) -> np.ndarray:
    """int64 (layers, heads): the step each stream's run evicted `position` at (its own
    `evicted_at`), NEVER (-1) where it held the position to the end. `runs`: [layer][head] Run."""
    return np.array([[int(r.evicted_at[int(position)]) for r in row] for row in runs], np.int64)


def _grid_heatmap(fig, z, text, col, *, layers, colorscale, zmin, zmax, showscale, colorbar=None,
                  hover=None):
    z = np.asarray(z)
    fig.add_trace(go.Heatmap(z=z, x=[f"kv{g}" for g in range(z.shape[1])],
                             y=[f"layer {lay}" for lay in layers], text=text,
                             texttemplate="%{text}", colorscale=colorscale, zmin=zmin, zmax=zmax,
                             showscale=showscale, colorbar=colorbar, xgap=1, ygap=1,
                             customdata=hover if hover is not None else text,
                             hovertemplate="%{y}, %{x}: %{customdata}<extra></extra>"), row=1, col=col)


def position_figure(evicted, plain, layers, *, position: int, steps: int, label: str,
                    plain_label: str) -> go.Figure:
    """Where one position went on every (layer, KV head): the step at which the allocator
    (left) and its plain scorer (right) evicted it, "held" where it stayed to the end.

    `evicted` and `plain` are int (layers, heads) as `eviction_grid` gives them (-1: held to
    the end); `steps` the trace's length (the colour of a held cell); `layers` the model layer
    numbers. Each cell's text is the eviction step, or "held".
    """
    evicted, plain = np.asarray(evicted, np.int64), np.asarray(plain, np.int64)
    if evicted.ndim != 2 or evicted.shape != plain.shape:
        raise ValueError(f"evicted and plain must both be (layers, heads), got {evicted.shape} "
                         f"and {plain.shape}")
    if len(layers) != evicted.shape[0]:
        raise ValueError(f"layers must name the {evicted.shape[0]} layers, got {len(layers)}")
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=[label, plain_label])
    for col, ev in ((1, evicted), (2, plain)):
        text = [["held" if v < 0 else str(int(v)) for v in row] for row in ev]
        _grid_heatmap(fig, np.where(ev < 0, steps, ev), text, col, layers=layers,
                      colorscale="Viridis", zmin=int(position), zmax=int(steps),
                      showscale=col == 2, colorbar=dict(title="evicted at step"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=f"Position {int(position)}: the step each KV head evicted it "
                            f"({label} vs {plain_label})",
                      height=120 + 40 * len(layers), margin=dict(t=80, l=70, r=10, b=30))
    return fig


def needle_heads_figure(held_a, held_b, key_mass, *, label_a: str, label_b: str,
                        key_held_a=None, key_held_b=None, key_tokens: int | None = None) -> go.Figure:
    """A pass-key prompt per (layer, KV head), after the prompt, under two configurations,
    beside the full cache's attention mass from the question onto the key.

    `held_a`, `held_b` int (layers, heads): the slots held; `key_mass` float (layers, heads);
    as lab.alloc_report writes them; the layers are the model's, from 0. With
    `key_held_a`, `key_held_b` (layers, heads: how many of the key's `key_tokens` tokens each
    head still holds) the two left panels show those counts ("3/5"), the slots held in their
    hover text; without them, the slots held.
    """
    held_a, held_b, key_mass = (np.asarray(held_a), np.asarray(held_b), np.asarray(key_mass, float))
    if not (held_a.ndim == 2 and held_a.shape == held_b.shape == key_mass.shape):
        raise ValueError(f"held_a, held_b and key_mass must all be (layers, heads), got "
                         f"{held_a.shape}, {held_b.shape} and {key_mass.shape}")
    keyed = key_held_a is not None
    if keyed:
        key_held_a, key_held_b = np.asarray(key_held_a), np.asarray(key_held_b)
        if key_held_a.shape != held_a.shape or key_held_b.shape != held_a.shape:
            raise ValueError(f"key_held_a and key_held_b must be (layers, heads) like held_a "
                             f"{held_a.shape}, got {key_held_a.shape} and {key_held_b.shape}")
        if key_tokens is None or key_tokens < 1 or max(key_held_a.max(), key_held_b.max()) > key_tokens:
            raise ValueError(f"key_tokens must be the key's token count, at least every head's "
                             f"key_held, got {key_tokens!r}")
    layers = list(range(held_a.shape[0]))
    what = "key tokens held" if keyed else "held"
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, horizontal_spacing=0.05,
                        subplot_titles=[f"{what}: {label_a}", f"{what}: {label_b}",
                                        "key attention (full cache)"])
    top = int(max(held_a.max(), held_b.max()))
    for col, held, key in ((1, held_a, key_held_a), (2, held_b, key_held_b)):
        if keyed:
            text = [[f"{int(k)}/{key_tokens}" for k in row] for row in key]
            hover = [[f"{int(k)} of the key's {key_tokens} tokens, {int(n)} slots held"
                      for k, n in zip(krow, nrow)] for krow, nrow in zip(key, held)]
            _grid_heatmap(fig, key, text, col, layers=layers, colorscale="Blues", zmin=0,
                          zmax=key_tokens, showscale=False, hover=hover)
        else:
            _grid_heatmap(fig, held, [[str(int(v)) for v in row] for row in held], col,
                          layers=layers, colorscale="Blues", zmin=0, zmax=top, showscale=False)
    _grid_heatmap(fig, key_mass, [[f"{v:.4f}" for v in row] for row in key_mass], 3,
                  layers=layers, colorscale="Reds", zmin=0, zmax=float(key_mass.max()),
                  showscale=True, colorbar=dict(title="mass"))
    fig.update_yaxes(autorange="reversed")
    shown = "the key's tokens each head holds" if keyed else "held slots"
    fig.update_layout(title=f"Pass key per KV head after the prompt: {shown} ({label_a} vs "
                            f"{label_b}) and the key's attention mass",
                      height=140 + 30 * len(layers), margin=dict(t=80, l=70, r=10, b=30))
    return fig
