"""Sinks & recent view: how many sinks and recent positions each policy keeps."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from kvviz.app import explain
from kvviz.app import figures as V
from kvviz.app.ui.context import CHART, Ctx, table
from kvviz.app.ui.present import chart


def render(ctx: Ctx):
    st.caption("Do the attention sinks (positions 0–3) and the 64 newest positions survive? "
               "Counted per step for each policy.")
    chart(V.survival_figure(ctx.ev_a, ctx.ev_b, ctx.step, label_a=ctx.label_a,
                                      label_b=ctx.label_b), key="chart.survival", **CHART)
    s = ctx.step
    sides = (("A", ctx.label_a, ctx.ev_a),) if ctx.solo else (
        ("A", ctx.label_a, ctx.ev_a), ("B", ctx.label_b, ctx.ev_b))
    st.caption(explain.survival_text([explain.survival_facts(w, lab, ev, s)
                                      for w, lab, ev in sides], s))
    rows = []
    for lab, ev in ((f"A: {ctx.label_a}", ctx.ev_a), (f"B: {ctx.label_b}", ctx.ev_b)):
        rows.append({"policy": lab, "sinks held": int(V.sinks_held(ev)[s]),
                     "recent-64 held": f"{V.recent_held_fraction(ev)[s]:.0%}"})
    table(pd.DataFrame(rows))  # drawn whole (kvviz.app.ui.context.table)
