"""The "Forgetting" view: pass-key results as figures (pure: data in, Plotly figure/HTML out).
What they show is counted in kvviz.studies.forgetting; these functions only draw it.

Inputs are `kvviz needle`'s records: the results table (one row per run and configuration:
length, depth, seed, prompt_mode, granularity, policy, params, budget, answer, correct, ...)
and one run's arrays (`tokens`, `evicted_at` (C, L, G, T), meta with key_positions,
question_start, prompt_len, configs, answers, correct).
"""
from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.app.figures.cache import cache_heatmap
from kvviz.app.figures.common import (
    KEY_COLOUR,
    RIGHT_COLOUR,
    WRONG_COLOUR,
    base_layout,
    pair_colours,
    policy_of,
    setting_colour,
)
from kvviz.app.figures.tokens import _token_html
from kvviz.studies.forgetting import accuracy, at_budget, held_share, lines_order, lost_step

# accuracy 0 -> wrong's wine, 1 -> right's green, through a light grey: colours no policy has
ACCURACY_SCALE = [[0, WRONG_COLOUR], [0.5, "#eeeeee"], [1, RIGHT_COLOUR]]


PANELS_PER_ROW = 4  # beyond this the panels wrap: their titles stay readable at 1024 px


def needle_figure(rows: pd.DataFrame, budget: int, prompt_mode: str, granularity: str,
                  row_height: int = 250, what: str = "Pass-key") -> go.Figure:
    """The classic needle chart: depth (y) x context length (x), coloured by the share of
    correct answers over seeds; one panel per configuration at `budget` (full cache first),
    PANELS_PER_ROW to a row. `what` names the task in the title."""
    r = at_budget(rows, budget, prompt_mode, granularity)
    acc = accuracy(r)
    lines = lines_order(r)
    lengths = sorted(int(x) for x in r["length"].unique())
    depths = sorted(float(x) for x in r["depth"].unique())
    n = max(1, len(lines))
    cols = min(n, PANELS_PER_ROW)
    nrows = -(-n // cols)
    titles = [ln.replace(" (", "<br>(") for ln in lines]  # parameters on a second line
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=titles or ["no results"],
                        shared_yaxes=True, horizontal_spacing=min(0.04, 0.4 / cols),
                        vertical_spacing=min(0.16, 0.6 / nrows))
    for i, line in enumerate(lines):
        row, col = i // cols + 1, i % cols + 1
        a = acc[acc["line"] == line].set_index(["depth", "length"])
        z = [[a["accuracy"].get((d, n_), np.nan) for n_ in lengths] for d in depths]
        text = [[f"{int(a['right'][(d, n_)])}/{int(a['n'][(d, n_)])}" if (d, n_) in a.index
                 else "" for n_ in lengths] for d in depths]
        fig.add_trace(go.Heatmap(
            z=z, x=[str(x) for x in lengths], y=[f"{d:g}%" for d in depths], text=text,
            texttemplate="%{text}", zmin=0, zmax=1, colorscale=ACCURACY_SCALE,
            showscale=i == 0, name=line, xgap=2, ygap=2,
            colorbar=dict(title="correct", tickformat=".0%", len=min(0.9, 1.2 / nrows), y=1,
                          yanchor="top"),
            hovertemplate=f"<b>{html.escape(line)}</b><br>length %{{x}} tokens<br>depth %{{y}}"
                          "<br>%{text} correct<extra></extra>"), row=row, col=col)
        bottom = i + cols >= len(lines)
        fig.update_xaxes(title="context length" if bottom and col == (cols + 1) // 2 else None,
                         type="category", row=row, col=col)
    for row in range(1, nrows + 1):
        fig.update_yaxes(title="key depth", type="category", row=row, col=1)
    fig.update_annotations(font_size=13)  # the panel titles
    base_layout(fig, f"{what} accuracy by depth and context length: budget {budget}, "
                     f"{prompt_mode} prompt, {granularity} granularity", 110 + row_height * nrows)
    return fig


# the task's other marked tokens in the prompt strip: pale backgrounds no policy or category uses
REMINDER_COLOUR = "#CFE8FF"    # the recall task's reminder sentences (pale blue)
DISTRACTOR_COLOUR = "#FFD6CC"  # another person's key (pale red)

def task_marks(meta: dict) -> tuple[str, list[tuple[str, str, dict]]]:
    """What the prompt strip marks beside the question, from a run's meta: (the key's name in
    the legend, [(css class, legend label, {position: tooltip})]): the recall task's reminder
    sentences, the distractors task's other keys (each named), the phrase as the key."""
    task = meta.get("task") or "passkey"
    if task == "phrase":
        return "the pass phrase", []
    if task == "recall":
        tips = {p: "a reminder" for a, b in meta.get("reminders") or [] for p in range(int(a), int(b))}
        return "the key", [("kv-rem", "a reminder", tips)] if tips else []
    if task == "distractors":
        tips = {int(p): f"{name}'s key (a distractor)"
                for name, ps in zip(meta.get("distractor_names") or [], meta.get("distractor_positions") or [])
                for p in ps}
        target = meta.get("target") or "the asked person"
        return f"{target}'s key (asked)", [("kv-dis", "another person's key (a distractor)", tips)] if tips else []
    return "the key", []


def key_strip_html(tokens, key_positions, question_start: int, marks=(), key_label: str = "the key") -> str:
    """The prompt's tokens with the key highlighted and the question underlined; `marks`
    ([(css class kv-rem or kv-dis, legend label, {position: tooltip})], task_marks) shaded in
    their own colours, and a legend of what is marked."""
    keys = set(int(p) for p in key_positions)
    other = {}
    for cls, _, tips in marks:
        for p, tip in tips.items():
            other[int(p)] = (cls, tip)
    spans = []
    for p, tok in enumerate(tokens):
        if p in keys:
            cls, tip = "kv-key", f"position {p}: {key_label}"
        elif p in other:
            cls, tip = other[p][0], f"position {p}: {other[p][1]}"
        elif p >= question_start:
            cls, tip = "kv-q", f"position {p}: the question"
        else:
            cls, tip = "", f"position {p}"
        spans.append(f'<span class="kv-tok {cls}" title="{html.escape(tip)}">{_token_html(tok)}</span>')
    style = ("<style>.kv-strip{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:14px;"
             "line-height:1.8;max-height:260px;overflow-y:auto;padding:8px;border:1px solid #ddd;"
             "border-radius:6px;background:#fff}.kv-tok{white-space:pre}.kv-ws{opacity:0.45}"
             f".kv-key{{background:{KEY_COLOUR};font-weight:bold;outline:1px solid #999}}"
             f".kv-rem{{background:{REMINDER_COLOUR}}}"
             f".kv-dis{{background:{DISTRACTOR_COLOUR};outline:1px dashed #999}}"
             ".kv-q{text-decoration:underline;color:#332288}"
             ".kv-legend{font-size:13px;margin:2px 0 6px 0}.kv-legend span{padding:0 6px;"
             "margin-right:10px}</style>")
    legend = [f'<span class="kv-key">{html.escape(key_label)}</span>']
    legend += [f'<span class="{cls}">{html.escape(label)}</span>' for cls, label, _ in marks]
    legend.append('<span class="kv-q">the question</span>')
    return (f'{style}<div class="kv-legend" data-testid="kv-needle-legend">{"".join(legend)}</div>'
            f'<div class="kv-strip" data-testid="kv-needle-strip">{"<wbr>".join(spans)}</div>')


def _runs(positions) -> list[tuple[int, int]]:
    """Contiguous runs [lo, hi] of sorted positions."""
    out = []
    for p in sorted(int(x) for x in positions):
        if out and p == out[-1][1] + 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return [tuple(r) for r in out]


def key_cache_figure(ev_a, ev_b, *, key_positions, prompt_len: int, label_a: str,
                     label_b: str, height: int = 520) -> go.Figure:
    """The cache heatmap of one layer (and KV head) for two configurations, with the key's
    positions shaded, the end of the prompt marked, and each one's first key eviction."""
    ev_a, ev_b = np.asarray(ev_a), np.asarray(ev_b)
    fig = cache_heatmap(ev_a, ev_b, prompt_len - 1, label_a=label_a, label_b=label_b,
                        height=height)
    for lo, hi in _runs(key_positions):
        fig.add_vrect(x0=lo - 0.5, x1=hi + 0.5, fillcolor=KEY_COLOUR, opacity=0.35,
                      line=dict(color="#8a7f00", width=1), layer="above", name="key")
    ca, cb = pair_colours(label_a, label_b)
    for ev, lab, colour, sym in ((ev_a, "A", ca, "x"), (ev_b, "B", cb, "cross")):
        s = lost_step(ev, key_positions)
        if s >= 0:
            first = min(int(p) for p in key_positions if (ev[..., int(p)] == s).any())
            fig.add_trace(go.Scatter(
                x=[first], y=[s], mode="markers+text", text=[f"{lab} lost the key"],
                # A's label above-left, B's below-right: two losses at one step never overlap
                textposition="top left" if lab == "A" else "bottom right",
                name=f"{lab} loses the key (step {s})",
                marker=dict(symbol=sym + "-thin", size=16, color=colour,
                            line=dict(width=3, color=colour)),
                textfont=dict(color=colour, size=14, weight="bold",
                              shadow="0 0 3px white, 0 0 3px white, 0 0 3px white"),
                hovertemplate=f"{lab}: first key token evicted at step {s}<extra></extra>"))
    fig.layout.title.text = f"Cache contents over time (key shaded): A = {label_a}, B = {label_b}"
    return fig


def prefill_kept(ev, prompt_len: int) -> np.ndarray:
    """bool (prompt_len,): the prompt positions a configuration holds right after the
    one-shot eviction at the end of the prompt (step prompt_len - 1)."""
    e = np.asarray(ev)[..., :int(prompt_len)]
    return (e < 0) | (e > int(prompt_len) - 1)


def prefill_figure(ev_a, ev_b, *, key_positions, prompt_len: int, label_a: str, label_b: str,
                   height: int = 300) -> go.Figure:
    """Prefill mode: the prompt is read whole and evicted once, at its end. One row per
    configuration (A above B), one column per prompt position: held after that eviction in
    the policy's colour, evicted in grey; the key's positions shaded."""
    T0 = int(prompt_len)
    ka, kb = prefill_kept(ev_a, T0), prefill_kept(ev_b, T0)
    ca, cb = pair_colours(label_a, label_b)
    z = np.stack([np.where(ka, 1, 0), np.where(kb, 2, 0)]).astype(np.int8)
    scale = [[0, "#e4e4e4"], [1 / 3, "#e4e4e4"], [1 / 3, ca], [2 / 3, ca], [2 / 3, cb], [1, cb]]
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(T0)), y=[f"A: {label_a}", f"B: {label_b}"], zmin=-0.5, zmax=2.5,
        colorscale=scale, showscale=False, ygap=6, name="kept after the prompt's eviction",
        hovertemplate="%{y}<br>position %{x}<extra></extra>"))
    for lo, hi in _runs(key_positions):
        fig.add_vrect(x0=lo - 0.5, x1=hi + 0.5, fillcolor=KEY_COLOUR, opacity=0.45,
                      line=dict(color="#8a7f00", width=1), layer="above", name="key")
    for lab, colour in ((f"A: {label_a}", ca), (f"B: {label_b}", cb)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"held by {lab}",
                                 marker=dict(symbol="square", size=14, color=colour)))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="evicted",
                             marker=dict(symbol="square", size=14, color="#e4e4e4",
                                         line=dict(color="#888888", width=1))))
    base_layout(fig, f"What each kept of the prompt after its one eviction (step {T0 - 1})",
                height)
    fig.update_xaxes(title="prompt position", range=[-0.5, T0 - 0.5], showgrid=False)
    fig.update_yaxes(autorange="reversed", showgrid=False)
    fig.update_layout(legend=dict(orientation="h", y=-0.35, yanchor="top", x=0, xanchor="left"),
                      margin=dict(b=90))
    return fig


def layers_figure(evicted_at, meta: dict, indices, labels, step: int,
                  layer_names=None, height: int = 420) -> go.Figure:
    """Per layer (y) and configuration (x): the share of the key's positions held after
    `step`, mean over KV heads (1 = the whole key is there)."""
    ev = np.asarray(evicted_at)
    kp = meta["key_positions"]
    z = np.stack([held_share(ev[i], kp, step).mean(-1) for i in indices], 1)  # (L, n)
    names = list(layer_names) if layer_names is not None else list(range(z.shape[0]))
    fig = go.Figure(go.Heatmap(
        z=z, x=list(labels), y=[str(n) for n in names], zmin=0, zmax=1, xgap=1, ygap=1,
        colorscale=[[0, "#e4e4e4"], [1, "#3a3a3a"]], colorbar=dict(title="key held",
                                                                   tickformat=".0%"),
        hovertemplate="%{x}<br>layer %{y}<br>%{z:.0%} of the key held<extra></extra>"))
    base_layout(fig, f"Which layers still hold the key after step {step}", height)
    fig.update_xaxes(title="configuration", type="category")
    fig.update_yaxes(title="model layer", type="category", autorange="reversed")
    return fig




# --- the recall task: the key's attention over the prompt ----------------------------------
LOST_SYMBOLS = ("x", "diamond", "triangle-up", "square", "star", "circle", "pentagon")
LOST_STACK = 0.09  # of the y range: the gap between two markers losing the key at one step


def _attention_top(y, reminders, key_positions) -> float:
    """The y range's top: the key's own steps (and the few after them) take far more than
    any later step, so the axis is scaled to the steps from the first reminder on (without
    one: from just after the key), and a note gives the highest value above it."""
    T = len(y)
    kp = [int(p) for p in key_positions]
    start = min((int(r[0]) for r in reminders), default=(max(kp) + 1) if kp else 0)
    later = y[start:] if start < T else y
    return 1.4 * float(np.nanmax(later)) if len(later) and np.nanmax(later) > 0 else 1.0


def key_attention_figure(attention, *, reminders, key_positions, lost: dict, layer=None,
                         height: int = 380) -> go.Figure:
    """Per prompt step (x), the attention the full cache's query at that step pays to the
    key's positions (y: summed over them, mean over query heads), from a (layers, steps)
    array: layer `layer`'s row, or with None the mean over layers. The reminder sentences'
    steps shaded, the key's own positions in the key's colour, and each policy's step of
    losing the key (`lost`: {label: step}, -1 never) marked on the curve. The y axis fits the
    steps from the first reminder on; the key's own, higher steps run above it, their peak said
    in a note."""
    a = np.asarray(attention, float)
    y = a.mean(0) if layer is None else a[int(layer)]
    T = len(y)
    fig = go.Figure(go.Scatter(x=list(range(T)), y=y.tolist(), mode="lines", name="attention on the key",
                               showlegend=False,  # (the y axis's title says what it is)
                               line=dict(color="#3a3a3a", width=1.5),
                               hovertemplate="step %{x}<br>%{y:.3f} of the row on the key<extra></extra>"))
    for lo, hi in sorted((int(r[0]), int(r[1])) for r in reminders):  # [start, end) spans
        fig.add_vrect(x0=lo - 0.5, x1=hi - 0.5, fillcolor=REMINDER_COLOUR, opacity=0.8, layer="below",
                      line_width=0, name="reminder")
    for lo, hi in _runs(key_positions):
        fig.add_vrect(x0=lo - 0.5, x1=hi + 0.5, fillcolor=KEY_COLOUR, opacity=0.6, layer="below",
                      line_width=0, name="key")
    # policies losing the key at one step: stacked above the curve, one above the other,
    # each with its own symbol (and its own legend entry), so none hides another
    top = _attention_top(y, reminders, key_positions)
    stacked: dict = {}
    settings: dict = {}  # a policy's settings so far: each setting its own shade
    for i, (label, step) in enumerate(lost.items()):
        fam = policy_of(label)
        nth = settings[fam] = settings.get(fam, -1) + 1
        step = int(step)
        if step < 0 or step >= T:
            continue
        colour = setting_colour(fam, nth)
        k = stacked[step] = stacked.get(step, -1) + 1
        fig.add_trace(go.Scatter(
            x=[step], y=[min(float(y[step]) + k * LOST_STACK * top, top)], mode="markers",
            name=f"{label} loses the key (step {step})",
            marker=dict(symbol=LOST_SYMBOLS[i % len(LOST_SYMBOLS)], size=13, color=colour,
                        line=dict(width=1.5, color="#222222")),
            hovertemplate=f"{html.escape(label)}: first key token evicted at step {step}<extra></extra>"))
    for name, colour in (("a reminder sentence", REMINDER_COLOUR), ("the key", KEY_COLOUR)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=14, color=colour)))
    where = "mean over layers" if layer is None else f"layer {int(layer)}"
    base_layout(fig, f"The key's attention at each prompt step (full cache, {where})", height,
                legend_below=True)
    fig.update_xaxes(title="prompt step (the query's position)", range=[-0.5, T - 0.5])
    if T and float(np.nanmax(y)) > top:
        peak = int(np.nanargmax(y))
        fig.add_annotation(x=peak, y=top, yanchor="top", showarrow=False, yshift=-2,
                           text=f"↑ up to {float(y[peak]):.2f}<br>at the key (step {peak})",
                           font=dict(size=12, color="#555555"), xanchor="left")
    fig.update_yaxes(title="attention on the key", range=[0, top])
    return fig
