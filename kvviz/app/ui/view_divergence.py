"""Divergence view: |A Δ B| over time and why a position was treated differently."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app import explain
from kvviz.app import figures as V
from kvviz.app.ui.context import CHART, Ctx, table
from kvviz.app.ui.navigation import goto
from kvviz.app.ui.positions import restore_position
from kvviz.app.ui.present import chart, more
from kvviz.app.ui.session import keep, wkey


def render(ctx: Ctx):
    s = ctx.step
    st.caption("Where A and B disagree: how many positions exactly one of them holds, per step, "
               "and for any such position the scores that made each policy decide.")
    if ctx.solo:
        st.info("Divergence needs two policies; one refused its settings (see above).")
        return
    chart(V.divergence_figure(ctx.ev_a, ctx.ev_b, s, label_a=ctx.label_a,
                                        label_b=ctx.label_b), key="chart.divergence", **CHART)
    with more():
        _why(ctx)


def _why(ctx: Ctx):
    s = ctx.step
    only_a, only_b = V.only_sets(ctx.ev_a, ctx.ev_b, s)
    cands = V.divergent_positions(ctx.ev_a, ctx.ev_b)
    st.subheader("Why? The scores each policy gave a divergent position")
    if not len(cands):
        st.info("A and B never evict differently on this trace and budget.")
        return
    restore_position("why", ctx.trace.steps)
    c1, c2 = st.columns([2, 5])
    why = c1.number_input("divergent position (-1: first one held by only one side now)",
                          min_value=-1, max_value=ctx.trace.steps - 1, step=1, key=wkey("why"))
    keep(wkey("why"), int(why))
    if why < 0:
        now = np.concatenate([only_a, only_b])
        pos = int(now.min()) if len(now) else int(cands[0])
    else:
        pos = int(why)
    dstep = V.decision_step(ctx.ev_a, ctx.ev_b, pos)
    if dstep < 0:
        same = ("both hold it to the end" if int(ctx.ev_a[pos]) < 0 else
                f"both evict it at step {int(ctx.ev_a[pos])}")
        c2.warning(f"A and B treat position {pos} the same way ({same}). Divergent positions include "
                   f"{', '.join(map(str, cands[:8]))}…")
        return
    panels = [ctx.panel("a", dstep), ctx.panel("b", dstep)]
    facts = [explain.decision(w, p, pos) for w, p in zip("AB", panels)]
    ties = [t for w, p in zip("AB", panels) for t in explain.tie_facts(w, p)]
    c2.markdown(explain.why_text(pos, ctx.ev_a, ctx.ev_b, facts, dstep, ties=ties)
                + " Below, both policies' candidates at that step.")
    c2.button(f"go to step {dstep}", key="why.go", on_click=goto, args=(dstep,))
    chart(V.why_figure(pos, dstep, panels), key="chart.why", **CHART)
    table(V.why_table(pos, dstep, panels, tokens=ctx.trace.tokens))  # whole
