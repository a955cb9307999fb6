"""Compare view: up to six policies on one trace at one budget, side by side.

Pure builders over eviction logs (int64 `evicted_at` per position, -1 = never): small
multiples of each policy's held set over time (server-side aggregated to a small PNG per
policy, like the cache heatmap), one survival chart for sinks and the 64 newest positions,
and one metrics table. No policy logic here: the logs and metrics come from the runs the
page already caches.
"""
from __future__ import annotations

import base64
import io

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from PIL import Image

from kvviz.app.figures.common import base_layout
from kvviz.app.figures.metrics import METRIC_LABELS
from kvviz.app.figures.metrics import policy_colour as _colour_of
from kvviz.app.figures.states import (
    BOTH,
    NEITHER,
    NOT_YET,
    STATE_COLOURS,
    bin_edges,
    held_mask,
    recent_held_fraction,
    sinks_held,
    state_counts,
)

SMALL_BINS = 192      # pixels per axis of each small multiple (4,096 steps -> 22-cell blocks)
MAX_POLICIES = 6  # kvviz.app.state.MAX_COMPARE says the same (it has no plotly)
COLS = 3


def _rgb(hex_colour: str) -> np.ndarray:
    h = hex_colour.lstrip("#")
    return np.array([int(h[i:i + 2], 16) for i in (0, 2, 4)], np.float64)


def held_shares(evicted_at, max_bins: int = SMALL_BINS) -> dict:
    """One policy's held set over time, aggregated: per (step block, position block) the share
    of cells not yet generated, held and evicted (exact counts, `states.state_counts` with
    the run compared to itself). Independent of the current step, so cacheable."""
    ev = np.asarray(evicted_at, np.int64)
    n = len(ev)
    step_edges = bin_edges(n, max_bins)
    pos_edges = bin_edges(n, max_bins)
    counts = state_counts(ev, ev, step_edges, pos_edges).astype(np.float64)
    total = np.maximum(counts.sum(axis=0), 1)
    return dict(step_edges=step_edges, pos_edges=pos_edges, not_yet=counts[NOT_YET] / total,
                held=counts[BOTH] / total, evicted=counts[NEITHER] / total)


def held_rgb(shares: dict, colour: str) -> np.ndarray:
    """(rows, cols, 3) uint8: white for not yet generated, grey for evicted, `colour` for held,
    mixed by share. Among generated cells the held colour follows the square root of the held
    share, so a single position held through a block (a sink) stays visible at 1/20 of it."""
    white, grey, c = _rgb(STATE_COLOURS[NOT_YET]), _rgb(STATE_COLOURS[NEITHER]), _rgb(colour)
    gen = shares["held"] + shares["evicted"]
    frac = np.sqrt(np.divide(shares["held"], gen, out=np.zeros_like(gen), where=gen > 0))
    generated = grey[None, None] * (1 - frac[..., None]) + c[None, None] * frac[..., None]
    rgb = white[None, None] * shares["not_yet"][..., None] + generated * gen[..., None]
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)


def rgb_to_png(rgb: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(rgb, mode="RGB").save(buf, format="PNG", compress_level=6)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def policy_colour(label: str) -> str:
    return _colour_of(label.split(" ")[0])


def _grid_axes(rows: int, cols: int, hgap: float, vgap: float) -> list[dict]:
    """Domains and axis names of a rows x cols grid, row-major from the top left (what
    make_subplots computes; built directly because plotly's per-subplot updates cost ~1 s
    for six panels)."""
    w = (1 - hgap * (cols - 1)) / cols
    h = (1 - vgap * (rows - 1)) / rows
    out = []
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        n = "" if i == 0 else str(i + 1)
        x0, y1 = c * (w + hgap), 1 - r * (h + vgap)
        out.append(dict(x=f"x{n}", y=f"y{n}", xaxis=f"xaxis{n}", yaxis=f"yaxis{n}",
                        xd=[x0, x0 + w], yd=[y1 - h, y1], row=r, col=c))
    return out


def _title(text: str, ax: dict) -> dict:
    return dict(text=text, x=sum(ax["xd"]) / 2, y=ax["yd"][1], xref="paper", yref="paper",
                xanchor="center", yanchor="bottom", showarrow=False, font=dict(size=13))


def small_multiples(panels: list[dict], step: int, *, cols: int = COLS,
                    height_per_row: int = 300) -> go.Figure:
    """One small heatmap per policy. panels: dicts with 'label' (policy name first), 'shares'
    (from `held_shares`), 'evicted_at' and optionally 'png' (the panel's image, cached).
    The red line marks `step`; each title says how many slots the policy holds after it."""
    if not panels:
        raise ValueError("panels must hold at least one policy")
    if len(panels) > MAX_POLICIES:
        raise ValueError(f"panels: at most {MAX_POLICIES} policies, got {len(panels)}")
    cols = min(cols, len(panels))
    rows = -(-len(panels) // cols)
    axes = _grid_axes(rows, cols, 0.04, 0.16 if rows > 1 else 0.0)
    data, layout, shapes, notes = [], {}, [], []
    for p, ax in zip(panels, axes):
        sh = p["shares"]
        se, pe = sh["step_edges"], sh["pos_edges"]
        dy, dx = int(se[1] - se[0]), int(pe[1] - pe[0])
        png = p.get("png") or rgb_to_png(held_rgb(sh, policy_colour(p["label"])))
        data.append(go.Image(source=png,
                             x0=int(pe[0]) + (dx - 1) / 2, dx=dx, y0=int(se[0]) + (dy - 1) / 2,
                             dy=dy, hoverinfo="skip", name=p["label"], xaxis=ax["x"],
                             yaxis=ax["y"]))
        layout[ax["xaxis"]] = dict(domain=ax["xd"], anchor=ax["y"],
                                   range=[pe[0] - 0.5, pe[-1] - 0.5],
                                   showgrid=False, zeroline=False, nticks=3,
                                   title=dict(text="position") if ax["row"] == rows - 1 else None)
        layout[ax["yaxis"]] = dict(domain=ax["yd"], anchor=ax["x"],
                                   range=[se[-1] - 0.5, se[0] - 0.5],
                                   showgrid=False, zeroline=False, nticks=5,
                                   showticklabels=ax["col"] == 0,  # same steps in every panel
                                   title=dict(text="step") if ax["col"] == 0 else None)
        shapes.append(dict(type="line", xref=f"{ax['x']} domain", x0=0, x1=1, yref=ax["y"],
                           y0=int(step), y1=int(step), line=dict(color="#CC0000", width=1.5)))
        held = int(held_mask(p["evicted_at"], step).sum())
        notes.append(_title(f"{p['label']}<br>holds {held}", ax))
    fig = go.Figure(data=data, layout=dict(shapes=shapes, annotations=notes, showlegend=False,
                                           **layout))
    base_layout(fig, f"Held set over time, step {int(step)} in red", height_per_row * rows + 90)
    fig.update_layout(margin=dict(l=60, r=20, t=100, b=50))
    return fig


def survival_compare(panels: list[dict], step: int, *, sinks: int = 4, recent: int = 64,
                     height: int = 380) -> go.Figure:
    """Every policy's sinks held (left) and share of the `recent` newest positions held
    (right), per step. panels: dicts with 'label' and 'evicted_at'."""
    if not panels:
        raise ValueError("panels must hold at least one policy")
    left, right = _grid_axes(1, 2, 0.1, 0.0)
    dashes = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
    data = []
    for i, p in enumerate(panels):
        ev, lab = p["evicted_at"], p["label"]
        line = dict(color=policy_colour(lab), width=2.2, dash=dashes[i % len(dashes)])
        # x0/dx instead of an x array, small dtypes: six policies x 4,096 steps stay
        # ~0.2 MB of chart data instead of ~0.5 MB
        data.append(go.Scatter(x0=0, dx=1, y=sinks_held(ev, sinks).astype(np.uint8), name=lab,
                               legendgroup=lab, line={**line, "shape": "hv"},
                               hovertemplate="step %{x}: %{y} sinks held<extra>" + lab
                               + "</extra>"))
        data.append(go.Scatter(x0=0, dx=1, y=recent_held_fraction(ev, recent).astype(np.float32),
                               name=lab, legendgroup=lab, showlegend=False, line=line,
                               xaxis="x2", yaxis="y2",
                               hovertemplate="step %{x}: %{y:.1%} of the newest held<extra>"
                               + lab + "</extra>"))
    marks = [dict(type="line", yref=f"{ax['y']} domain", y0=0, y1=1, xref=ax["x"], x0=int(step),
                  x1=int(step), line=dict(color="#CC0000", width=1.5, dash="dot"))
             for ax in (left, right)]
    layout = dict(
        xaxis=dict(domain=left["xd"], anchor="y", title=dict(text="step")),
        yaxis=dict(domain=left["yd"], anchor="x", range=[-0.2, sinks + 0.2], dtick=1,
                   title=dict(text="sinks held")),
        xaxis2=dict(domain=right["xd"], anchor="y2", title=dict(text="step")),
        yaxis2=dict(domain=right["yd"], anchor="x2", range=[-0.03, 1.03], tickformat=".0%",
                    title=dict(text="held")),
        shapes=marks,
        annotations=[_title(f"sinks held (of positions 0–{sinks - 1})", left),
                     _title(f"share of the {recent} newest positions held", right)])
    fig = go.Figure(data=data, layout=layout)
    base_layout(fig, "Sinks and recent-window survival, every policy", height + 40,
                legend_below=True)
    return fig


def compare_table(rows: list[dict]) -> pd.DataFrame:
    """rows: dicts with 'policy', 'params', 'budget', 'held now' and `kvviz.core.metrics.summary`'s
    keys. One row per policy, metrics labelled as in the Metrics view."""
    cols = ["policy", "params", "budget", "held now", "retained_mass", "hh_recall",
            "attention_loss", "memory_bytes"]
    df = pd.DataFrame(rows)
    return df[[c for c in cols if c in df.columns]].rename(columns=METRIC_LABELS)
