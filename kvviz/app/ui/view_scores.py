"""Scores view: the policy's own scores around a slot at the current step."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app import explain
from kvviz.app import figures as V
from kvviz.app.figures.toy import SMALL, label_bars
from kvviz.app.ui import present
from kvviz.app.ui.context import CHART, Ctx
from kvviz.app.ui.navigation import tracked
from kvviz.app.ui.positions import focus_input
from kvviz.app.ui.present import chart
from kvviz.app.ui.session import set_value


def panels(ctx: Ctx, s: int) -> list[dict]:
    """The panels shown (each with its policy's parameters, which the explanation reads)."""
    def one(which):
        return dict(ctx.panel(which, s), params=dict(ctx.pa if which == "a" else ctx.pb))

    if ctx.solo:
        return [one(ctx.solo)]
    pa, pb = one("a"), one("b")
    # show the pooled policy first (the neighbourhood is built around its slots)
    return [pb, pa] if "pooled" in pb["scores"] and "pooled" not in pa["scores"] else [pa, pb]


def _policy(ctx: Ctx, panel: dict):
    """The panel's policy object, as its replay built it (what it declares: SnapKV's
    pooling radius); its parameters when the panel has no engine."""
    eng = ctx.eng_a if panel["label"][0] == "A" else ctx.eng_b
    return eng.policy if eng is not None else panel["params"]


def render(ctx: Ctx):
    s = ctx.step
    if not present.active():  # (the room: the chart first)
        st.caption("Each held slot's score at this step as the policy computed it (its own "
                   "`scores()`): lowest goes first. Hover a slot for its numbers; for SnapKV, "
                   "which neighbour's window sum set its pooled score.")
    shown = panels(ctx, s)
    victims = np.concatenate([p["victims"] for p in shown])
    track = tracked(ctx)
    auto = track if track >= 0 else int(victims[0]) if len(victims) else int(s // 2)
    center = focus_input(ctx, auto)
    room = present.active()  # side by side, three slots each side, positions only (tokens
    # in the hover): what the room's short window shows whole and legible
    fig = V.neighbourhood_figure(shown, s, center, tokens=None if room else ctx.trace.tokens,
                                 side_by_side=room, **({"half_width": 3} if room else {}))
    if ctx.trace.steps <= SMALL:
        label_bars(fig)
    chart(fig, key="chart.scores", **CHART)
    if track >= 0:
        n = explain.number_format([d.score for d in (explain.decision(p["label"][0], p, track)
                                                     for p in shown)])
        lines = [explain.tracked_score_text(explain.decision(p["label"][0], p, track), track, s, n)
                 for p in shown]
        st.markdown(f"**Tracked position {track}** at step {s}: " + " ".join(lines))
    for p in shown:
        if "pooled" in p["scores"]:
            d = V.defended_positions(p["kept"], p["scores"], p["victims"])
            if len(d):
                c1, c2 = st.columns([5, 1])
                c1.markdown(f"**{p['label']}** at step {s}: defended by pooling: "
                            f"{', '.join(map(str, d))} (own window sum ranked among the "
                            "victims; a neighbour's pooled score kept it).")
                c2.button(f"zoom to {int(d[0])}", key=f"scores.defended.{p['label'][0].lower()}",
                          on_click=set_value,
                          args=("focus", int(d[0])))
                pos = center if center in set(d.tolist()) else int(d[0])
                f = explain.pooling_facts(p["kept"], p["scores"], p["victims"], pos,
                                          _policy(ctx, p), s)
                st.info(explain.pooling_text(f), icon=":material/shield:")
            else:
                st.caption(f"{p['label']} at step {s}: no slot defended by pooling at this step.")
