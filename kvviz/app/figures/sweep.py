"""A sweep's table (`python -m kvviz sweep`) as small multiples: one panel per trace and
layer, one line per policy configuration, the metric against the budget."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.app.figures.common import base_layout
from kvviz.app.figures.metrics import METRIC_LABELS, policy_colour, value_format
from kvviz.core.policies import config_label

REQUIRED = ("trace", "layer", "policy", "budget", "retained_mass", "hh_recall", "memory_bytes",
            "status")
FIXED = {"trace", "layer", "head", "policy", "budget", "retained_mass", "hh_recall",
         "attention_loss", "memory_bytes", "status", "error", "kvviz_version", "trace_sha256",
         "model"}
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")


def check_results(df: pd.DataFrame) -> None:
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"not a kvviz sweep table: no column {missing[0]!r} "
                         f"(expected {', '.join(REQUIRED)})")


def series_labels(df: pd.DataFrame) -> pd.Series:
    """One line per configuration: config_label with the parameters that vary among that
    policy's rows (shown even at their default), then the head when heads vary."""
    params = [c for c in df.columns if c not in FIXED]
    by_head = "head" in df.columns and df["head"].nunique(dropna=True) > 1
    labels = df["policy"].astype(str).copy()
    for policy, g in df.groupby("policy", sort=False):
        cols = [c for c in params if g[c].nunique(dropna=True) > 1]
        for i, r in g.iterrows():
            name = config_label(policy, {c: r[c] for c in cols}, keep=cols)
            labels[i] = f"{name}, head {r['head']}" if by_head else name
    return labels


def panels(df: pd.DataFrame) -> list[tuple]:
    """(trace, layer) pairs in table order; the canonical trace has no layer."""
    seen = []
    for t, layer in zip(df["trace"], df["layer"]):
        key = (t, None if pd.isna(layer) else int(layer))
        if key not in seen:
            seen.append(key)
    return seen


def sweep_grid_figure(df: pd.DataFrame, metric: str = "retained_mass",
                      panel_height: int = 240) -> go.Figure:
    """Rows are traces, columns that trace's layers; x is the budget (log scale, ticks at the
    swept budgets; the title names it, so no axis title collides with the panel below).
    Failed cells are left out."""
    check_results(df)
    df = df[df["status"] == "ok"].reset_index(drop=True)
    keys = panels(df)
    traces = list(dict.fromkeys(t for t, _ in keys))
    ncols = max((sum(1 for t, _ in keys if t == tr) for tr in traces), default=1)
    where, titles = {}, [""] * (max(len(traces), 1) * ncols)
    for r, tr in enumerate(traces):
        for c, key in enumerate(k for k in keys if k[0] == tr):
            where[key] = (r + 1, c + 1)
            titles[r * ncols + c] = tr + ("" if key[1] is None else f" · layer {key[1]}")
    fig = make_subplots(rows=max(len(traces), 1), cols=ncols, subplot_titles=titles,
                        shared_yaxes=True, horizontal_spacing=0.04,
                        vertical_spacing=min(0.12, 0.5 / max(len(traces), 1)))
    labels = series_labels(df) if len(df) else pd.Series(dtype=str)
    panel_of = [(t, None if pd.isna(layer) else int(layer)) for t, layer in zip(df["trace"], df["layer"])]
    dash: dict[str, str] = {}
    shown = set()
    for (panel, label), g in df.groupby([pd.Series(panel_of, index=df.index), labels], sort=False):
        policy = str(g["policy"].iloc[0])
        dash.setdefault(label, DASHES[sum(1 for k in dash if k.split(" ")[0] == policy) % len(DASHES)])
        g = g.sort_values("budget")
        r, c = where[panel]
        fig.add_trace(go.Scatter(
            x=g["budget"], y=g[metric].astype(float), mode="lines+markers", name=label,
            legendgroup=label, showlegend=label not in shown,
            line=dict(color=policy_colour(policy), dash=dash[label], width=2),
            marker=dict(size=6),
            hovertemplate=f"budget %{{x}}<br>{METRIC_LABELS.get(metric, metric)} "
                          f"%{{y:{value_format(metric)['hover']}}}"
                          f"<extra>{label}</extra>"), row=r, col=c)
        shown.add(label)
    base_layout(fig, f"{METRIC_LABELS.get(metric, metric)} against budget, by trace and layer",
                height=max(320, panel_height * max(len(traces), 1) + 120), legend_below=True,
                bottom=140)
    budgets = sorted(int(b) for b in df["budget"].unique())
    fig.update_xaxes(type="log", tickvals=budgets, ticktext=[str(b) for b in budgets])
    fig.update_yaxes(tickformat=value_format(metric)["tickformat"])
    return fig
