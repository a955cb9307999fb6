"""Scores view: the policy's own scores around a slot at the current step."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz import views as V
from kvviz.ui.context import CHART, Ctx
from kvviz.ui.positions import focus_input
from kvviz.ui.session import set_value


def render(ctx: Ctx):
    s = ctx.step
    st.caption("Each held slot's score at this step as the policy computed it (its own "
               "`scores()`): lowest goes first. Hover a slot for its numbers; for SnapKV, which "
               "neighbour's window sum set its pooled score.")
    if ctx.solo:
        panels = [ctx.panel(ctx.solo, s)]
    else:
        pa, pb = ctx.panel("a", s), ctx.panel("b", s)
        # show the pooled policy first (the neighbourhood is built around its slots)
        panels = [pb, pa] if "pooled" in pb["scores"] and "pooled" not in pa["scores"] else [pa, pb]
    victims = np.concatenate([p["victims"] for p in panels])
    auto = int(victims[0]) if len(victims) else int(s // 2)
    center = focus_input(ctx, auto)
    st.plotly_chart(V.neighbourhood_figure(panels, s, center, tokens=ctx.trace.tokens),
                    key="chart.scores", **CHART)
    for p in panels:
        if "pooled" in p["scores"]:
            d = V.defended_positions(p["kept"], p["scores"], p["victims"])
            if len(d):
                c1, c2 = st.columns([5, 1])
                c1.markdown(f"**{p['label']}** at step {s}: defended by pooling: "
                            f"{', '.join(map(str, d))} (own window sum ranked among the "
                            "victims; a neighbour's pooled score kept it).")
                c2.button(f"zoom to {int(d[0])}", key="scores.defended", on_click=set_value,
                          args=("focus", int(d[0])))
                shown = center if center in set(d.tolist()) else int(d[0])
                e = V.scores.pooling_explanation(p["kept"], p["scores"], p["victims"], shown)
                st.info(V.scores.explain_text(e, s), icon=":material/shield:")
            else:
                st.caption(f"{p['label']} at step {s}: no slot defended by pooling at this step.")
