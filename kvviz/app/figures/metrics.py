"""View 5: metrics for A and B, and sweeps."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from kvviz.app.figures.common import PALETTE, base_layout, policy_colour  # noqa: F401 (re-exported)

METRIC_LABELS = {"retained_mass": "retained mass", "hh_recall": "heavy-hitter recall",
                 "attention_loss": "attention loss", "memory_bytes": "memory (bytes)"}
def metrics_table(rows: list[dict]) -> pd.DataFrame:
    """rows: dicts with 'run' (label), 'policy', 'params', 'budget' and the summary metrics."""
    df = pd.DataFrame(rows)
    cols = ["run", "policy", "params", "budget", "retained_mass", "hh_recall", "attention_loss",
            "memory_bytes"]
    df = df[[c for c in cols if c in df.columns]].rename(columns=METRIC_LABELS)
    return df


SHARES = {"retained_mass", "hh_recall", "attention_loss"}  # fractions of 1
# How the tables' number columns are shown (Streamlit NumberColumn printf formats): shares to
# six places, bytes as whole numbers with thousands separators (43,520, not 43520).
TABLE_FORMATS = {"retained mass": "%.6f", "heavy-hitter recall": "%.6f",
                 "attention loss": "%.6f", "memory (bytes)": "%,d"}


def value_format(metric: str) -> dict:
    """Plotly axis tick format and hover format of a metric (d3 syntax)."""
    return ({"tickformat": ".2f", "hover": ".6g"} if metric in SHARES
            else {"tickformat": ",", "hover": ","})


def log_spaced(values) -> bool:
    """True when positive swept values are more evenly spaced on a log axis than on a
    linear one (1, 2, 4, 8 … on a linear axis crowd their first ticks into one label)."""
    v = np.unique(np.asarray(values, float))
    if len(v) < 3 or v[0] <= 0:
        return False

    def unevenness(d):
        return float(np.std(d) / np.mean(d))

    return unevenness(np.diff(np.log(v))) < unevenness(np.diff(v))


def honest_range(values, share: bool) -> list[float] | None:
    """A y range that does not dramatise: shares stay inside [0, 1] and span at least 0.2
    (a 0.004 change looks like one); counts and bytes start at zero."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if not len(v):
        return None
    if not share:
        return [0.0, float(v.max()) * 1.08 or 1.0]
    span = max(0.2, 1.2 * (v.max() - v.min()))
    mid = (v.max() + v.min()) / 2
    lo = min(max(0.0, mid - span / 2), 1.0 - span)
    return [max(0.0, lo), min(1.0, max(0.0, lo) + span)]


def sweep_figure(rows: list[dict], x: str, metric: str = "retained_mass", group: str = "policy",
                 title: str | None = None, height: int = 360, mark_x=None,
                 x_label: str | None = None, log_x: bool | None = None) -> go.Figure:
    """Line per `group` of `metric` against `x`. rows: dicts holding x, group and metric keys.
    `x_label` names the control as the page does (poolKernel); ticks sit on the swept
    values only; `mark_x` marks the current setting. `log_x` None: a log axis when the swept
    values are log-spaced (obsWindow 1, 2, 4 … 128), else linear (poolKernel 1, 3, 5 …)."""
    df = pd.DataFrame(rows)
    xl = x_label or x
    ml = METRIC_LABELS.get(metric, metric)
    if log_x is None:
        log_x = bool(len(df)) and log_spaced(df[x])
    fmt = value_format(metric)
    fig = go.Figure()
    if len(df):
        for name, g in df.groupby(group, sort=False):
            g = g.sort_values(x)
            fig.add_trace(go.Scatter(x=g[x], y=g[metric], mode="lines+markers", name=str(name),
                                     line=dict(color=policy_colour(name), width=2.5),
                                     marker=dict(size=8),
                                     hovertemplate=f"{xl} %{{x}}<br>{ml} %{{y:{fmt['hover']}}}<extra>"
                                     + str(name) + "</extra>"))
    if mark_x is not None:
        # shapes take data coordinates; annotations on a log axis take log10 of them
        fig.add_vline(x=mark_x, line=dict(color="#CC0000", width=1.5, dash="dot"))
        fig.add_annotation(x=np.log10(mark_x) if log_x else mark_x, y=0, yref="y domain",
                           text=f" now: {xl}={mark_x}", showarrow=False, xanchor="left",
                           yanchor="bottom", font=dict(color="#CC0000", size=12),
                           bgcolor="rgba(255,255,255,0.8)")
    base_layout(fig, title or f"{ml} vs {xl}", height)
    xs = sorted(set(df[x].tolist())) if len(df) else []
    fig.update_xaxes(title=xl, type="log" if log_x else "linear", tickmode="array",
                     tickvals=xs, ticktext=[str(v) for v in xs])
    rng = honest_range(df[metric] if len(df) else [], metric in SHARES)
    fig.update_yaxes(title=ml, range=rng, tickformat=fmt["tickformat"])
    return fig
