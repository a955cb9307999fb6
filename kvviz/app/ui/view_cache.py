"""Cache heatmap view: who holds what, every step (whole run or zoomed)."""
from __future__ import annotations

import html

import numpy as np
import streamlit as st

from kvviz.app.figures.cache import Prebuilt, at_step, without_hover
from kvviz.app.figures.states import NOT_YET
from kvviz.app.figures.toy import SMALL, labelled_heatmap
from kvviz.app.figures.track import heatmap_with_divergence, heatmap_with_track
from kvviz.app.ui import compute, follow
from kvviz.app.ui.context import CHART, Ctx
from kvviz.app.ui.navigation import notable_here, tracked
from kvviz.app.ui.positions import ZOOMS, zoom_centre, zoom_window
from kvviz.app.ui.present import chart
from kvviz.app.ui.session import PREVIEWED, S, widget

# The Plotly chart hides the preview as soon as its own image is in place.
PREVIEW_CSS = (".st-key-cache-chart:has(.js-plotly-plot image) .kv-preview{display:none}"
               ".kv-preview{box-sizing:border-box;font-size:17px;color:#222;position:relative}"
               ".kv-preview img{width:100%!important;height:100%!important;max-width:none;"
               "object-fit:fill!important;image-rendering:pixelated;display:block;margin:0}"
               ".kv-preview span{position:absolute;left:4px;top:14px;font-weight:600}"
               ".kv-preview b{position:absolute;height:2px;background:#CC0000}")


def preview_html(base: dict, step: int) -> str:
    """The heatmap's PNG (built on the server) with its title and step line, as plain HTML
    laid out with the figure's own height, margins and step axis: a first visit sees the chart
    without waiting for the browser to load Streamlit's Plotly bundle (4.7 MB); the Plotly
    chart, with hover, replaces it."""
    lay = base["layout"]
    m, height = lay["margin"], lay["height"]
    lo, hi = lay["yaxis"]["range"][::-1]  # reversed axis: the first step at the top
    plot = height - m["t"] - m["b"]
    top = m["t"] + plot * min(max((step - lo) / max(hi - lo, 1), 0.0), 1.0)
    box = f"height:{height}px;padding:{m['t']}px {m['r']}px {m['b']}px {m['l']}px"
    return (f"<style>{PREVIEW_CSS}</style><div class='kv-preview' style='{box}'>"
            f"<span>{html.escape(lay['title']['text'])}</span>"
            f"<img src='{base['data'][0]['source']}' alt='cache heatmap'>"
            f"<b style='top:{top:.0f}px;left:{m['l']}px;right:{m['r']}px'></b></div>")


HIDDEN = "hidden while the class's question is open"


def blank_labelled(fig, start: int):
    """The toy's labelled heatmap (`labelled_heatmap`, drawn from logs cut at `start`) with
    steps `start`.. blank: their cells "not yet generated" and their hover said hidden, their
    attention weights left out (in place; returns it)."""
    for tr in fig.data:
        if tr.name == "cache states":
            z = np.array(tr.z, copy=True)
            z[start:] = NOT_YET
            text = [list(row) for row in tr.text]
            text[start:] = [[HIDDEN] * len(row) for row in text[start:]]
            tr.update(z=z, text=text)
        elif tr.name == "weights":
            keep = np.asarray(tr.y) < start
            tr.update(x=np.asarray(tr.x)[keep], y=np.asarray(tr.y)[keep],
                      text=[t for t, k in zip(tr.text, keep) if k],
                      textfont=dict(color=[c for c, k in zip(tr.textfont.color, keep) if k]))
    return fig


def hide_rows(fig, start: int, steps: int) -> Prebuilt:
    """`fig` with steps `start`.. covered and said hidden (a class's open question asks about
    step `start`: kvviz.app.ui.predict), and without its hover layer."""
    spec = without_hover(fig if isinstance(fig, Prebuilt) else Prebuilt(fig.to_dict())).to_dict()
    lay = dict(spec["layout"])
    lay["shapes"] = [*lay.get("shapes", ()), dict(
        type="rect", xref="paper", x0=0, x1=1, yref="y", y0=start - 0.5, y1=steps - 0.5,
        fillcolor="#e6e6e6", line=dict(width=0), layer="above", name="hidden")]
    lay["annotations"] = [*lay.get("annotations", ()), dict(
        xref="paper", x=0.5, yref="y", y=(start + steps - 1) / 2, showarrow=False,
        text=f"steps {start}–{steps - 1}: {HIDDEN}", font=dict(size=15, color="#333333"))]
    return Prebuilt({**spec, "layout": lay})


def render(ctx: Ctx):
    track = tracked(ctx)
    cut = ctx.hide_from if ctx.hide_from is not None and ctx.hide_from < ctx.trace.steps else None
    if ctx.trace.steps <= SMALL:  # the toy trace: every cell with its number
        st.caption("Who holds which position after every step: one row per step (down), one "
                   "column per position (across); a position is generated at its own step.")
        # (the logs without the evictions from the asked step on: Ctx.ev_a)
        fig = labelled_heatmap(ctx.trace, ctx.ev_a, ctx.ev_b, ctx.step,
                               label_a=ctx.label_a, label_b=ctx.label_b, track=track)
        chart(fig if cut is None else hide_rows(blank_labelled(fig, cut), cut, ctx.trace.steps),
              key="chart.cache", **CHART)
        st.caption("Each cell is one (step, position): its colour is who holds the position "
                   "after that step, its number the attention that step's query paid it in "
                   "the full trace (each policy sees the row renormalised over what it holds).")
        return
    slot = st.container(key="cache-chart")  # above its range control: first on the screen
    zoom = widget(st.segmented_control, "zoom", "heatmap range", ZOOMS, required=True,
                  fit=lambda z: z if z in ZOOMS else 0,
                  format_func=lambda z: "whole run" if z == 0 else f"zoom ±{z} steps",
                  help="Zoom shows single cells around the current step and the positions "
                       "being evicted now (or the zoom position set in the Scores view).",
                  label_visibility="collapsed")  # its options say what it is
    window = (zoom_window(ctx.step, ctx.trace.steps, zoom, zoom_centre(ctx)) if zoom else None)
    base = compute.cache_figure(ctx.key, ctx.layer, ctx.version, (ctx.a, ctx.pa), (ctx.b, ctx.pb),
                                ctx.budget, (ctx.label_a, ctx.label_b), window=window, head=ctx.head,
                                hide_from=cut)  # (cut: nothing of those steps in its data)
    with slot:
        preview = st.empty()
        if not S.get(PREVIEWED) and cut is None:  # the session's first heatmap: its PNG first
            S[PREVIEWED] = True
            preview.markdown(preview_html(base, ctx.step), unsafe_allow_html=True)
        fig = at_step(base, ctx.step)
        if track >= 0:
            fig = heatmap_with_track(fig, track, ctx.ev_a, ctx.ev_b, ctx.trace.steps,
                                     ctx.label_a, ctx.label_b, hide_from=cut)
        here = notable_here(ctx)
        if here is not None:  # the next-divergence jump's position, where it diverged
            fig = heatmap_with_divergence(fig, here[0], ctx.step)
        hover = not follow.following() and cut is None
        if cut is not None:
            fig = hide_rows(fig, cut, ctx.trace.steps)
        elif not hover:  # every student's page runs again after each move: two thirds of the
            fig = without_hover(fig)  # figure's bytes, theirs when they explore on their own
        chart(fig, key="chart.cache", **CHART)
    w = int(base["data"][0]["dy"])  # the image's pixel height in steps
    st.caption("Who holds which position after every step: one row per step (down), one "
               "column per position (across); a position is generated at its own step. "
               f"Each pixel is a block of {w}×{w} cells, coloured by its most frequent state, or "
               "by the disagreement (only A / only B) when the policies differ on a whole line "
               "of it, so one-position differences stay visible. "
               + ("Hover for exact shares of larger blocks. " if hover else
                  "The exact shares of larger blocks are on hover when you explore on your "
                  "own (while following, the page leaves them out: every student's page is "
                  "sent again after each move). ")
               + "The red line is the current step."
               if w > 1 else "Who holds which position after every step: one row per step "
               "(down), one column per position (across). Each pixel is one (step, position) "
               "cell. The red line is the current step.")
