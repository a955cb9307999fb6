"""Model in the loop: what eviction cost the model (pure figure builders, no Streamlit).

Input is a closed-loop result's summaries and per-token arrays (kvviz.model.loop.LoopResult):
`results` rows (policy, params, budget, perplexity, ...), `nll` / `p_true` (C, T-1) where
entry t scores token t+1 from the logits at position t.
"""
from __future__ import annotations

import html
import math

import numpy as np
import plotly.graph_objects as go

from kvviz.app.explain import visible_token
from kvviz.app.figures.common import RIGHT_COLOUR, WRONG_COLOUR, base_layout, setting_colour
from kvviz.app.figures.tokens import join_token_spans, strip_css, token_html
from kvviz.core.policies import FULL, FULL_LABEL, config_label

FULL_COLOUR = "#000000"  # the full cache: no policy's colour
DASHES = ("solid", "dash", "dot", "dashdot")  # a policy's second, third... setting
# eviction cost (wrong's wine) and help (right's green): categories, no policy's colours
HURT, HELPED = (tuple(int(c.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4))
                for c in (WRONG_COLOUR, RIGHT_COLOUR))
DELTA_CLIP = 2.0  # nats: colours saturate beyond this


def nice_log_ticks(lo: float, hi: float, min_ticks: int = 3) -> list[float]:
    """Round tick values for a log axis spanning [lo, hi]: the sparsest of the 1-2-5 style
    mantissa sets that still gives `min_ticks` ticks (a narrow range gets denser ones)."""
    if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"log ticks need a positive finite range, got {lo}..{hi}")
    lo, hi = min(lo, hi), max(lo, hi)
    sets = [(1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9),
            tuple(np.round(np.arange(1, 10, 0.1), 1))]
    best: list[float] = []
    for mantissas in sets:
        ticks = []
        for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
            for m in mantissas:
                v = float(f"{m * 10.0 ** e:.6g}")
                if lo <= v <= hi:
                    ticks.append(v)
        best = sorted(set(ticks))
        if len(best) >= min_ticks:
            return best
    return best or [float(f"{lo:.3g}"), float(f"{hi:.3g}")]


def tick_text(v: float) -> str:
    """Plain numbers: 12, 1.5, 0.25, 1,000 (no 1e3, no SI suffixes)."""
    if v >= 1000:
        return f"{v:,.0f}"
    return f"{v:.6g}"


def perplexity_figure(results: list[dict], *, metric: str = "perplexity",
                      title: str | None = None, height: int = 420) -> go.Figure:
    """Perplexity (log y, plain tick labels) against budget, one line per policy with its
    parameters; the full cache, which has no budget, is a dashed horizontal line."""
    label = {"perplexity": "perplexity (all predicted tokens)",
             "perplexity_after_eviction": "perplexity (tokens after the first eviction)"}
    if metric not in label:
        raise ValueError(f"metric must be one of {sorted(label)}, got {metric!r}")
    lines: dict[str, list[tuple[int, float]]] = {}
    policy_of: dict[str, str] = {}
    full = None
    for r in results:
        v = r.get(metric)
        if v is None or not np.isfinite(v):
            continue
        if r["policy"] == FULL:
            full = float(v)
            continue
        if isinstance(r["budget"], str):  # a ratio of the tokens seen has no place on the slots axis
            continue
        name = config_label(r["policy"], r.get("params", {}))
        policy_of[name] = r["policy"]
        lines.setdefault(name, []).append((int(r["budget"]), float(v)))
    budgets = sorted({b for pts in lines.values() for b, _ in pts})
    fig = go.Figure()
    seen: dict[str, int] = {}
    for name, pts in sorted(lines.items()):
        pts.sort()
        p = policy_of[name]
        nth = seen[p] = seen.get(p, -1) + 1  # a shade of its policy's colour and a dash a setting
        fig.add_trace(go.Scatter(
            x=[b for b, _ in pts], y=[v for _, v in pts], mode="lines+markers", name=name,
            line=dict(color=setting_colour(p, nth), width=2.5, dash=DASHES[nth % len(DASHES)]),
            hovertemplate=f"<b>{html.escape(name)}</b><br>budget %{{x}}<br>perplexity "
                          "%{y:.3f}<extra></extra>"))
    values = [v for pts in lines.values() for _, v in pts] + ([full] if full else [])
    if full is not None and budgets:
        fig.add_trace(go.Scatter(
            x=[budgets[0], budgets[-1]], y=[full, full], mode="lines", name=FULL_LABEL,
            line=dict(color=FULL_COLOUR, dash="dash", width=2),
            hovertemplate=f"full cache (no eviction)<br>perplexity {full:.3f}<extra></extra>"))
    base_layout(fig, title or "What eviction costs the model: perplexity against budget", height)
    fig.update_layout(legend=dict(orientation="v", yanchor="top", y=1, x=1.02, xanchor="left"),
                      margin=dict(r=220))
    fig.update_xaxes(title="budget (positions held per layer)", type="log",
                     tickvals=budgets, ticktext=[str(b) for b in budgets])
    if values:
        lo, hi = min(values), max(values)
        ticks = nice_log_ticks(lo, hi)
        pad = (math.log10(hi) - math.log10(lo)) * 0.06 or 0.02
        fig.update_yaxes(title=label[metric] + ", log scale", type="log",
                         tickvals=ticks, ticktext=[tick_text(t) for t in ticks],
                         range=[math.log10(lo) - pad, math.log10(hi) + pad])
    else:
        fig.update_yaxes(title=label[metric] + ", log scale", type="log")
    return fig


def delta_nll(nll_full, nll_evicted) -> np.ndarray:
    """Per predicted token: NLL with the evicted cache minus NLL with the full cache (nats);
    positive = eviction made the true token less likely."""
    a, b = np.asarray(nll_full, np.float64), np.asarray(nll_evicted, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"nll arrays must have the same shape, got {a.shape} and {b.shape}")
    return b - a


def _delta_colour(d: float) -> tuple[str, str]:
    """(background, text colour) for a ΔNLL: white at 0, saturating at ±DELTA_CLIP."""
    s = min(abs(d) / DELTA_CLIP, 1.0)
    base = HURT if d > 0 else HELPED
    rgb = tuple(round(255 + (c - 255) * s) for c in base)
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})", "#ffffff" if s > 0.6 else "#000000"


def delta_strip_html(tokens, nll_full, nll_evicted, p_full, p_evicted, *, label: str,
                     lo: int = 0, hi: int | None = None) -> str:
    """Tokens lo..hi-1 coloured by ΔNLL against the full cache (token t+1 by the prediction
    made at t; token 0 is never predicted and stays grey). Hover (title) gives both
    probabilities of the true token."""
    d = delta_nll(nll_full, nll_evicted)
    hi = len(tokens) if hi is None else min(int(hi), len(tokens))
    spans = []
    for p in range(int(lo), hi):
        tok = token_html(tokens[p])
        if p == 0:
            spans.append(f'<span class="kv-tok" title="position 0: not predicted" '
                         f'style="background:#eeeeee;color:#777">{tok}</span>')
            continue
        i = p - 1
        bg, fg = _delta_colour(float(d[i]))
        tip = (f"position {p} {visible_token(tokens[p])!r}: p(true token) full cache "
               f"{p_full[i]:.4f}, {label} {p_evicted[i]:.4f}; ΔNLL {d[i]:+.3f} nats")
        spans.append(f'<span class="kv-tok" title="{html.escape(tip)}" '
                     f'style="background:{bg};color:{fg}">{tok}</span>')
    legend = " ".join(
        f'<span class="kv-tok" style="background:{_delta_colour(v)[0]};color:'
        f'{_delta_colour(v)[1]};border:1px solid #999">{t}</span>'
        for v, t in ((-DELTA_CLIP, f"−{DELTA_CLIP:g} nats: helped"), (-0.5, "−0.5"), (0, "0"),
                     (0.5, "+0.5"), (DELTA_CLIP, f"+{DELTA_CLIP:g} nats or more: hurt")))
    style = strip_css()
    return (f'{style}<div class="kv-legend">ΔNLL of each token, {html.escape(label)} against '
            f'the full cache (hover a token for both probabilities): {legend}</div>'
            f'<div class="kv-strip" data-testid="kv-loop-strip" style="max-height:420px">'
            f'{join_token_spans(tokens[int(lo):hi], spans)}</div>')


def delta_figure(tokens, nll_full, nll_evicted, p_full, p_evicted, *, label: str,
                 height: int = 300) -> go.Figure:
    """ΔNLL per position as bars (same colours as the strip), hover with the token and both
    probabilities of the true token; a running mean shows where the cost accumulates."""
    d = delta_nll(nll_full, nll_evicted)
    pos = np.arange(1, len(d) + 1)
    colours = [_delta_colour(float(v))[0] for v in d]
    custom = np.stack([np.asarray(p_full, np.float64), np.asarray(p_evicted, np.float64)], 1)
    text = [visible_token(tokens[p]) for p in pos]
    fig = go.Figure(go.Bar(
        x=pos, y=d, marker=dict(color=colours, line=dict(width=0)), name="ΔNLL",
        customdata=custom, text=text, textposition="none",
        hovertemplate="position %{x} <b>%{text}</b><br>p(true) full cache %{customdata[0]:.4f}"
                      f"<br>p(true) {html.escape(label)} %{{customdata[1]:.4f}}"
                      "<br>ΔNLL %{y:+.3f} nats<extra></extra>"))
    cum = np.cumsum(d) / np.arange(1, len(d) + 1)
    fig.add_trace(go.Scatter(x=pos, y=cum, mode="lines", name="running mean ΔNLL",
                             line=dict(color="#333333", width=1.5),
                             hovertemplate="mean ΔNLL over positions 1–%{x}: %{y:+.4f}"
                                           "<extra></extra>"))
    base_layout(fig, f"Where eviction hurt: ΔNLL per token, {label} against the full cache",
                height)
    fig.update_xaxes(title="position of the predicted token")
    fig.update_yaxes(title="ΔNLL (nats)", zeroline=True, zerolinecolor="#777777")
    return fig


def worst_tokens(tokens, nll_full, nll_evicted, p_full, p_evicted, k: int = 10) -> list[dict]:
    """The k predicted tokens eviction hurt most (largest ΔNLL; ties to the earlier one)."""
    d = delta_nll(nll_full, nll_evicted)
    order = np.lexsort((np.arange(len(d)), -d))[:k]
    return [{"position": int(i + 1), "token": visible_token(tokens[i + 1]),
             "p(true) full": float(p_full[i]), "p(true) evicted": float(p_evicted[i]),
             "ΔNLL (nats)": float(d[i])} for i in order]
