"""Step navigation (slider, prev/next, play, next divergence) and the status line."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz import views as V
from kvviz.ui.context import Ctx
from kvviz.ui.session import S, keep, restore, set_value, wkey

PLAY_SPEEDS = (1, 4, 16, 64)
PLAY_INTERVAL_S = 1.0


def _shift(delta: int, steps: int):
    set_value("step", int(np.clip(int(S.get(wkey("step"), 0)) + delta, 0, steps - 1)))


def goto(step: int):
    set_value("step", int(step))


def advance(step: int, speed: int, steps: int) -> tuple[int, bool]:
    """One play tick: (new step, still playing)."""
    new = min(step + speed, steps - 1)
    return new, new < steps - 1


def navigator(ctx: Ctx) -> int:
    steps = ctx.trace.steps
    for field in ("focus", "why"):  # positions kept from another trace
        if not -1 <= int(S["kv"].get(field, -1)) < steps:
            S["kv"][field] = -1
            S.pop(wkey(field), None)
    if S["kv"].get("step") is None and wkey("step") not in S:
        first = V.first_divergence(ctx.ev_a, ctx.ev_b)
        S["kv"]["step"] = first if first >= 0 else steps - 1
    restore(wkey("step"), steps - 1)
    S[wkey("step")] = int(np.clip(int(S[wkey("step")]), 0, steps - 1))
    nxt = V.next_divergence(ctx.ev_a, ctx.ev_b, int(S[wkey("step")]))
    step = st.slider("step", 0, steps - 1, key=wkey("step"),
                     help="the decode step shown (state after that step's eviction)")
    cols = st.columns([1.35, 1.35, 1, 0.9, 2.4, 1.6], vertical_alignment="center")
    cols[0].button("prev", key="nav.prev", on_click=_shift, args=(-1, steps), width="stretch",
                   icon=":material/chevron_left:", help="previous step (key J)", shortcut="J")
    cols[1].button("next", key="nav.next", on_click=_shift, args=(1, steps), width="stretch",
                   icon=":material/chevron_right:", help="next step (key K)", shortcut="K")
    cols[2].toggle("play", key="w.play")
    cols[3].selectbox("speed", PLAY_SPEEDS, key="w.speed", label_visibility="collapsed",
                      format_func=lambda v: f"+{v}", help="steps per tick while playing "
                      "(one tick a second)")
    cols[4].button("next divergence", key="nav.div", on_click=goto, args=(nxt,),
                   disabled=nxt < 0, width="stretch", icon=":material/fast_forward:",
                   shortcut="D",
                   help=f"jump to the next step where A and B evict differently: {nxt}"
                   if nxt >= 0 else "A and B make no different eviction after this step")
    keep(wkey("step"), int(step))
    if S.get("w.play"):
        _ticker(steps)
    return int(step)


def _fragment_run() -> bool:
    """True when only fragments are re-running (a timer tick), not the whole page."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return bool(ctx is not None and getattr(ctx, "fragment_ids_this_run", None))


@st.fragment(run_every=PLAY_INTERVAL_S)
def _ticker(steps: int):
    """Runs inline on every page run (does nothing then) and alone every PLAY_INTERVAL_S while
    playing: each timer tick moves the step on and reruns the page."""
    if not S.get("w.play") or not _fragment_run():
        return
    new, more = advance(int(S["kv"].get("step", 0)), int(S.get("w.speed", 1)), steps)
    set_value("step", new)
    if not more:
        S["w.play"] = False
    st.rerun(scope="app")


def status(ctx: Ctx):
    s = ctx.step
    ha = V.held_mask(ctx.ev_a, s).sum()
    hb = V.held_mask(ctx.ev_b, s).sum()
    diff = int(V.symmetric_difference(ctx.ev_a, ctx.ev_b)[s])
    first = V.first_divergence(ctx.ev_a, ctx.ev_b)
    cols = st.columns(5)
    cols[0].metric(f"A holds · {ctx.label_a}", f"{ha}")
    cols[1].metric(f"B holds · {ctx.label_b}", f"{hb}")
    cols[2].metric("|A Δ B| now", f"{diff}")
    cols[3].metric("first divergence", "none" if first < 0 else f"step {first}")
    va, vb = ctx.eng_a.victims(s), ctx.eng_b.victims(s)

    def short(v):
        return "–" if not len(v) else ",".join(map(str, v[:3])) + ("…" if len(v) > 3 else "")

    cols[4].metric("evicted now (A / B)", f"{short(va)} / {short(vb)}",
                   help=f"A evicted {list(map(int, va))}; B evicted {list(map(int, vb))}")
