"""Small helpers shared by the figure builders."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

A_COLOUR = "#E69F00"   # orange: policy A everywhere in the app
B_COLOUR = "#0072B2"   # blue: policy B
DEFENDED_COLOUR = "#009E73"
FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=14)
_AXIS = dict(gridcolor="#EBF0F8", linecolor="#EBF0F8", zerolinecolor="#EBF0F8", ticks="",
             automargin=True, title=dict(standoff=12))
# A small white theme, laid on each figure as its values where the figure sets none (what a
# template does). Not as a template: assigning one to a figure, even this small dict, merges it
# into plotly's default template and validates the whole result, ~45 ms a figure, most of a
# small figure's cost (the class's question figure: 68 ms -> 39 ms).
LIGHT = dict(layout=dict(paper_bgcolor="white", plot_bgcolor="white", xaxis=_AXIS, yaxis=_AXIS,
                         colorway=["#E69F00", "#0072B2", "#009E73", "#CC79A7", "#56B4E9",
                                   "#D55E00", "#999999"], hovermode="closest"))


def _fill(obj, values: dict) -> None:
    """Set each of `values` on the plotly object `obj` where it has none (nested dicts
    likewise): a template's rule, that the figure's own values win."""
    for k, v in values.items():
        if isinstance(v, dict):
            _fill(obj[k], v)
        elif obj[k] is None:
            obj[k] = v


_LIGHT_TOP = {k: v for k, v in LIGHT["layout"].items() if k not in ("xaxis", "yaxis")}


def light(fig: go.Figure) -> go.Figure:
    """LIGHT on `fig`'s layout and every axis it has (call once its subplots exist)."""
    _fill(fig.layout, _LIGHT_TOP)
    fig.for_each_xaxis(lambda ax: _fill(ax, _AXIS))
    fig.for_each_yaxis(lambda ax: _fill(ax, _AXIS))
    return fig


def base_layout(fig: go.Figure, title: str, height: int = 360,
                legend_below: bool = False, bottom: int = 120) -> go.Figure:
    """Shared look. `legend_below` (figures with subplot titles, which a top legend would
    cover) pins the legend to the bottom edge of the figure, under the axis titles, inside a
    `bottom`-pixel margin."""
    legend = (dict(orientation="h", yref="container", yanchor="bottom", y=0.005, x=0,
                   xanchor="left") if legend_below
              else dict(orientation="h", yanchor="bottom", y=1.02, x=1, xanchor="right"))
    fig.update_layout(title=dict(text=title, x=0.0, xanchor="left"), height=height,
                      margin=dict(l=60, r=20, t=70, b=bottom if legend_below else 50), font=FONT,
                      hoverlabel=dict(font_size=14), legend=legend)
    return light(fig)


def range_label(lo: int, hi: int) -> str:
    """Inclusive label for the integer range [lo, hi)."""
    return f"{lo}" if hi - lo <= 1 else f"{lo}–{hi - 1}"


def plain_number(v: float) -> str:
    """0.002 -> '0.002', 5000 -> '5000': tick text a class reads without SI prefixes."""
    v = float(v)
    if v == 0 or 1e-5 <= abs(v) < 1e7:
        return np.format_float_positional(v, precision=6, trim="-")
    return f"{v:.0e}"


def log_ticks(values) -> dict:
    """Tick values and plain-number labels for a log axis over `values` (positive finite
    ones): 1-2-5 steps when the data spans up to 3 decades, powers of ten beyond."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v) & (v > 0)]
    if not len(v):
        return {}
    lo, hi = np.floor(np.log10(v.min())), np.ceil(np.log10(v.max()))
    mult = (1, 2, 5) if hi - lo <= 3 else (1,)
    ticks = [m * 10.0 ** e for e in range(int(lo), int(hi) + 1) for m in mult]
    ticks = [t for t in ticks if v.min() / 2.5 <= t <= v.max() * 2.5] or [10.0 ** lo]
    return dict(tickmode="array", tickvals=ticks, ticktext=[plain_number(t) for t in ticks])
