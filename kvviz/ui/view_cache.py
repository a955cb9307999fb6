"""Cache heatmap view: who holds what, every step (whole run or zoomed)."""
from __future__ import annotations

import streamlit as st

from kvviz.views.cache import at_step
from kvviz.ui import compute
from kvviz.ui.context import CHART, Ctx
from kvviz.ui.positions import ZOOMS, zoom_centre, zoom_window
from kvviz.ui.session import S, keep, restore, wkey


def render(ctx: Ctx):
    st.caption("Who holds which position after every step: one row per step (down), one "
               "column per position (across); a position is generated at its own step.")
    restore(wkey("zoom"), 0)
    if S[wkey("zoom")] not in ZOOMS:
        S[wkey("zoom")] = 0
    zoom = st.segmented_control("heatmap range", ZOOMS, key=wkey("zoom"), required=True,
                                format_func=lambda z: "whole run" if z == 0 else
                                f"zoom ±{z} steps", help="Zoom shows single cells around the "
                                "current step and the positions being evicted now (or the "
                                "zoom position set in the Scores view).")
    keep(wkey("zoom"), zoom)
    window = (zoom_window(ctx.step, ctx.trace.steps, zoom, zoom_centre(ctx)) if zoom else None)
    base = compute.cache_figure(ctx.key, ctx.layer, ctx.version, (ctx.a, ctx.pa), (ctx.b, ctx.pb),
                                ctx.budget, (ctx.label_a, ctx.label_b), window=window, head=ctx.head)
    st.plotly_chart(at_step(base, ctx.step), key="chart.cache", **CHART)
    w = int(base["data"][0]["dy"])  # the image's pixel height in steps
    st.caption(f"Each pixel is a block of {w}×{w} cells, coloured by its most frequent state, or "
               "by the disagreement (only A / only B) when the policies differ on a whole line "
               "of it, so one-position differences stay visible. Hover for exact shares of "
               "larger blocks. The red line is the current step."
               if w > 1 else "Each pixel is one (step, position) cell. The red line is the "
               "current step.")
