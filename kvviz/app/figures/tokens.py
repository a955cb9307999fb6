"""Token view (for traces that carry tokens): the text coloured by cache state.

`token_strip_html` returns a self-contained HTML fragment (no scripts), `token_timeline_figure`
the TOVA-paper picture: tokens along x, steps down y, each cell coloured by state.
"""
from __future__ import annotations

import html

import numpy as np
import plotly.graph_objects as go

from kvviz.app.explain import visible_token
from kvviz.app.figures.common import base_layout
from kvviz.app.figures.states import BOTH, NEITHER, NOT_YET, ONLY_A, ONLY_B, bin_edges, state_colours, states_at

_TEXT_ON = {BOTH: "#ffffff", ONLY_A: "#000000", ONLY_B: "#ffffff", NEITHER: "#555555",
            NOT_YET: "#9a9a9a"}


def token_html(tok: str) -> str:
    """One token as HTML: escaped, whitespace made visible (· space, ⏎ newline + line
    break, ⇥ tab, ␍), ∅ for an empty token."""
    out = []
    for ch in str(tok):
        if ch == "\n":
            out.append('<span class="kv-ws">⏎</span><br>')
        elif ch == "\t":
            out.append('<span class="kv-ws">⇥</span>')
        elif ch == " ":
            out.append('<span class="kv-ws">·</span>')
        elif ch == "\r":
            out.append('<span class="kv-ws">␍</span>')
        else:
            out.append(html.escape(ch))
    return "".join(out) or '<span class="kv-ws">∅</span>'


_token_html = token_html  # the old private name


def join_token_spans(tokens, spans) -> str:
    """Token spans side by side with nothing between them (a word split into subwords
    reads as one word), and a line-break opportunity (<wbr>) at each word boundary:
    before a token that starts with whitespace, after one that ends with it."""
    out = []
    prev_ws = False
    for tok, span in zip(tokens, spans):
        t = str(tok)
        if out and (prev_ws or t[:1].isspace()):
            out.append("<wbr>")
        out.append(span)
        prev_ws = t[-1:].isspace()
    return "".join(out)


def strip_css() -> str:
    """The token strips' shared style: text that wraps at the box's edge (long words break
    anywhere rather than overflow), token spans with no margin or side padding; a box of
    class `kv-end` opens scrolled to its end (CSS column-reverse, no script). The box's
    height is set on each box (two strips' styles on one page must not fight)."""
    return ("<style>.kv-strip{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:15px;"
            "line-height:1.9;overflow-y:auto;overflow-x:hidden;"
            "padding:8px;border:1px solid #ddd;border-radius:6px;background:#fff;"
            "white-space:normal;overflow-wrap:anywhere;word-break:normal}"
            ".kv-strip.kv-end{display:flex;flex-direction:column-reverse}"
            ".kv-strip .kv-tok{margin:0;padding:1px 0;border-radius:0}"
            ".kv-tok{white-space:normal}"
            ".kv-legend .kv-tok{padding:1px 4px;margin-right:4px;border-radius:3px}"
            ".kv-ws{opacity:0.55}.kv-legend{margin-bottom:6px;font-size:13px}</style>")


def token_strip_html(tokens, ev_a, ev_b, step: int, *, label_a="A", label_b="B",
                     lo: int = 0, hi: int | None = None) -> str:
    """Tokens lo..hi-1 as inline spans coloured by their state after `step`, wrapped at
    the box's edge.

    The strip is a scroll box that opens scrolled to its end (the current step); scroll up
    for the start of the text (CSS column-reverse, no script)."""
    hi = len(tokens) if hi is None else min(int(hi), len(tokens))
    codes = states_at(ev_a, ev_b, step)
    colours = state_colours(label_a, label_b)
    names = {BOTH: "held by both", ONLY_A: f"only A ({label_a})", ONLY_B: f"only B ({label_b})",
             NEITHER: "evicted by both", NOT_YET: "not yet generated"}
    legend = " ".join(
        f'<span class="kv-tok" style="background:{colours[c]};color:{_TEXT_ON[c]};'
        f'border:1px solid #999">{html.escape(names[c])}</span>'
        for c in (BOTH, ONLY_A, ONLY_B, NEITHER, NOT_YET))
    spans = []
    for p in range(int(lo), hi):
        c = int(codes[p])
        spans.append(
            f'<span class="kv-tok kv-s{c}" title="position {p}: {html.escape(names[c])}" '
            f'style="background:{colours[c]};color:{_TEXT_ON[c]}">{token_html(tokens[p])}</span>')
    body = join_token_spans([tokens[p] for p in range(int(lo), hi)], spans)
    return (f'{strip_css()}<div class="kv-legend">step {int(step)}: {legend}</div>'
            f'<div class="kv-strip kv-end" style="max-height:640px"><div>{body}</div></div>')


def token_timeline_figure(tokens, ev_a, ev_b, step: int, *, lo: int, hi: int,
                          label_a="A", label_b="B", max_rows: int = 48,
                          height: int = 460) -> go.Figure:
    """Tokens lo..hi-1 (x) by steps lo..step (the window's lifetime so far), sampled to at
    most `max_rows` rows (y); each row is the state after that step."""
    hi = min(int(hi), len(tokens))
    lo = max(0, min(int(lo), hi - 1))
    first = min(lo, int(step))
    edges = bin_edges(int(step) + 1 - first, max_rows) + first
    rows = edges[1:] - 1  # the last step of each bin: state after that step
    z = np.stack([states_at(ev_a, ev_b, int(s))[lo:hi] for s in rows])
    names = {BOTH: "held by both", ONLY_A: f"only A ({label_a})", ONLY_B: f"only B ({label_b})",
             NEITHER: "evicted by both", NOT_YET: "not yet generated"}
    order = (NOT_YET, NEITHER, ONLY_B, ONLY_A, BOTH)
    colours = state_colours(label_a, label_b)
    k = len(order)
    scale = []
    for i, code in enumerate(order):
        scale += [[i / k, colours[code]], [(i + 1) / k, colours[code]]]
    xlab = [f"{p} {visible_token(tokens[p])}" for p in range(lo, hi)]
    text = [[names[int(c)] for c in r] for r in z]
    fig = go.Figure(go.Heatmap(z=z.astype(np.int8), x=xlab, y=[f"step {s}" for s in rows], text=text,
                               zmin=-0.5, zmax=k - 0.5, colorscale=scale, showscale=False,
                               xgap=1, ygap=1,
                               hovertemplate="%{y}<br>token %{x}<br><b>%{text}</b><extra></extra>"))
    base_layout(fig, f"Tokens {lo}–{hi - 1} over time (rows: state after the step)", height)
    fig.update_xaxes(tickangle=-60, tickfont=dict(size=11), title=None)
    fig.update_yaxes(autorange="reversed", title=None)
    return fig
