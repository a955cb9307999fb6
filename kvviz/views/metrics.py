"""View 5: metrics for A and B, and sweeps."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from .common import A_COLOUR, B_COLOUR, base_layout

METRIC_LABELS = {"retained_mass": "retained mass", "hh_recall": "heavy-hitter recall",
                 "attention_loss": "attention loss", "memory_bytes": "memory (bytes)"}
POLICY_COLOURS = {"tova": A_COLOUR, "snapkv": B_COLOUR, "h2o": "#009E73",
                  "streaming-llm": "#CC79A7", "scissorhands": "#56B4E9", "random": "#999999"}


def metrics_table(rows: list[dict]) -> pd.DataFrame:
    """rows: dicts with 'run' (label), 'policy', 'params', 'budget' and the summary metrics."""
    df = pd.DataFrame(rows)
    cols = ["run", "policy", "params", "budget", "retained_mass", "hh_recall", "attention_loss",
            "memory_bytes"]
    df = df[[c for c in cols if c in df.columns]].rename(columns=METRIC_LABELS)
    return df


def sweep_figure(rows: list[dict], x: str, metric: str = "retained_mass", group: str = "policy",
                 title: str | None = None, height: int = 360, mark_x=None) -> go.Figure:
    """Line per `group` of `metric` against `x`. rows: dicts holding x, group and metric keys."""
    df = pd.DataFrame(rows)
    fig = go.Figure()
    if len(df):
        for name, g in df.groupby(group, sort=False):
            g = g.sort_values(x)
            fig.add_trace(go.Scatter(x=g[x], y=g[metric], mode="lines+markers", name=str(name),
                                     line=dict(color=POLICY_COLOURS.get(str(name)), width=2.5),
                                     marker=dict(size=8),
                                     hovertemplate=f"{x} %{{x}}<br>{METRIC_LABELS.get(metric, metric)}"
                                     " %{y:.6g}<extra>" + str(name) + "</extra>"))
    if mark_x is not None:
        fig.add_vline(x=mark_x, line=dict(color="#CC0000", width=1, dash="dot"))
    base_layout(fig, title or f"{METRIC_LABELS.get(metric, metric)} vs {x}", height)
    fig.update_xaxes(title=x)
    fig.update_yaxes(title=METRIC_LABELS.get(metric, metric))
    return fig
