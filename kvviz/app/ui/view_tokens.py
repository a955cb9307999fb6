"""Tokens view: the text coloured by state, and the TOVA-paper timeline."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app import explain
from kvviz.app import figures as V
from kvviz.app.figures.track import strip_track_css
from kvviz.app.ui.context import CHART, Ctx
from kvviz.app.ui.navigation import tracked
from kvviz.app.ui.positions import zoom_centre
from kvviz.app.ui.present import chart


def render(ctx: Ctx):
    st.caption("The text itself, each token coloured by whether A, B, both or neither still "
               "hold it after this step.")
    tokens = ctx.trace.tokens
    s = ctx.step
    track = tracked(ctx)
    strip = V.token_strip_html(tokens, ctx.ev_a, ctx.ev_b, s, label_a=ctx.label_a,
                               label_b=ctx.label_b, hi=min(len(tokens), s + 1 + 24))
    if track >= 0:  # the tracked token outlined in red, its state said
        st.markdown(explain.track_text(track, tokens, ctx.ev_a, ctx.ev_b, s, bool(ctx.solo))
                    + " (outlined in red below)")
        strip = strip_track_css(track) + strip
    st.html(strip)
    centre = zoom_centre(ctx)
    lo = int(np.clip(centre - 30, 0, max(0, len(tokens) - 60)))
    chart(V.token_timeline_figure(tokens, ctx.ev_a, ctx.ev_b, s, lo=lo, hi=lo + 60,
                                            label_a=ctx.label_a, label_b=ctx.label_b),
                    key="chart.tokens", **CHART)
    st.caption("Top: the text up to the current step, each token coloured by its state after "
               "this step (· space, ⏎ newline, ⇥ tab); the box opens at the current step, scroll "
               "up for the start. Bottom: 60 tokens around the zoom position (Scores view) or "
               "around the positions being evicted now, from their creation to this step.")
