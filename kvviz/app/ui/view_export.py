"""Export view: the current run as CSV / JSON downloads."""
from __future__ import annotations

import streamlit as st

from kvviz.app.state import to_query
from kvviz.app.ui.context import Ctx
from kvviz.app.ui.export import eviction_log, metrics_frame, run_json
from kvviz.app.ui.session import view_state
from kvviz.app.ui.view_metrics import metrics_rows
from kvviz.core.budget import as_given


def render(ctx: Ctx):
    st.caption("Take the run away: the eviction log per position, the metrics, and the whole "
               "configuration as JSON.")
    rows = metrics_rows(ctx)
    vs = view_state()
    config = {"trace": ctx.key, "trace_name": getattr(ctx.trace, "name", ""), "layer": ctx.layer,
              "head": ctx.head,
              "budget": as_given(ctx.budget), "A": {"policy": ctx.a, "params": dict(ctx.pa)},
              "B": {"policy": ctx.b, "params": dict(ctx.pb)}, "step": ctx.step,
              "url_query": to_query(vs)}
    if ctx.solo:  # the other policy refused its settings: both sides hold this one's run
        config["refused"] = "B" if ctx.solo == "a" else "A"
    log = eviction_log(ctx.eng_a.run, ctx.eng_b.run, ctx.trace.tokens)
    stem = f"kvviz_{getattr(ctx.trace, 'name', 'trace')}_{ctx.a}_vs_{ctx.b}_b{ctx.budget}"
    c = st.columns(3)
    c[0].download_button("eviction log (CSV)", log.to_csv(index=False), f"{stem}_evictions.csv",
                         "text/csv", key="dl.log", width="stretch")
    c[1].download_button("metrics (CSV)", metrics_frame(rows).to_csv(index=False),
                         f"{stem}_metrics.csv", "text/csv", key="dl.metrics", width="stretch")
    c[2].download_button("run (JSON)", run_json(config, ctx.eng_a.run, ctx.eng_b.run, rows),
                         f"{stem}.json", "application/json", key="dl.json", width="stretch")
    st.caption("The CSV has one row per position: the step each policy evicted it (-1 = never) "
               "and how many steps it was held. The JSON holds the configuration, metrics and "
               "both full eviction logs.")
    st.dataframe(log.head(200), hide_index=True)
