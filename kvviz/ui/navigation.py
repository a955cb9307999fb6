"""Step navigation (slider, prev/next, play, next divergence) and the status line."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz import views as V
from kvviz.ui.context import Ctx
from kvviz.ui.glossary import glossary_popover
from kvviz.views.common import A_COLOUR, B_COLOUR
from kvviz.ui.session import S, from_link, keep, note, restore, set_value, wkey

PLAY_SPEEDS = (1, 4, 16, 64)
NBSP = "\u00a0"
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
    for field in ("focus", "why"):  # positions from a link or kept from another trace
        v = int(S["kv"].get(field, -1))
        if not -1 <= v < steps:
            if from_link(field):
                note(f"{field}={v} is not a position of this trace (0–{steps - 1}); "
                     "using -1 (automatic)")
            S["kv"][field] = -1
            S.pop(wkey(field), None)
    if S["kv"].get("step") is None and wkey("step") not in S:
        first = ctx.first_divergence
        S["kv"]["step"] = first if first >= 0 else steps - 1
    restore(wkey("step"), steps - 1)
    if not 0 <= int(S[wkey("step")]) < steps:
        clamped = int(np.clip(int(S[wkey("step")]), 0, steps - 1))
        if from_link("step"):
            note(f"step={int(S[wkey('step')])} is not a step of this trace (0–{steps - 1}); "
                 f"showing step {clamped}")
        S[wkey("step")] = clamped
    # set, not left to the widget: a slider whose range changed (another trace) would
    # otherwise start again at 0
    S[wkey("step")] = int(S[wkey("step")])
    nxt = ctx.next_divergence(int(S[wkey("step")]))
    step = st.slider("step", 0, steps - 1, key=wkey("step"), label_visibility="collapsed",
                     help="the decode step shown (state after that step's eviction)")
    # no spacer column: at 1024x768 (a projector) every button keeps its whole label
    cols = st.columns([1.2, 1.2, 1, 1, 2.1], vertical_alignment="center", gap="small")
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
    """One wrapping line (metrics in five columns are cut at 1024 px): what each policy
    holds, |A Δ B| now, the first divergence and the positions evicted at this step."""
    s = ctx.step
    va, vb = ctx.eng_a.victims(s), ctx.eng_b.victims(s)

    def pos(v):
        if not len(v):
            return "nothing"
        shown = ", ".join(map(str, v[:4])) + (f" … ({len(v)} in all)" if len(v) > 4 else "")
        return ("position " if len(v) == 1 else "positions ") + shown

    hold_a = int(V.held_mask(ctx.ev_a, s).sum())
    line, gloss = st.columns([4, 1.1], vertical_alignment="center")
    with gloss:
        glossary_popover()  # one click away whatever the view
    if ctx.solo:
        w = ctx.solo.upper()
        line.markdown(f"**{w}** {ctx.label_a if ctx.solo == 'a' else ctx.label_b} holds "
                    f"**{hold_a}** · evicted at step {s}: {pos(va)} · the other policy refused "
                    "its settings (see above)")
    else:
        hold_b = int(V.held_mask(ctx.ev_b, s).sum())
        diff = int(ctx.pair["symdiff"][s])
        first = ctx.first_divergence
        line.markdown(
            f"<span style='color:{A_COLOUR}'>■</span> **A** {ctx.label_a} holds **{hold_a}** · "
            f"<span style='color:{B_COLOUR}'>■</span> **B** {ctx.label_b} holds **{hold_b}** · "
            f"**|A Δ B|** {diff} · first\u00a0divergence:\u00a0"  # kept on one line
            f"{'none' if first < 0 else 'step' + NBSP + str(first)}  \n"
            f"evicted at step {s}: **A** {pos(va)} · **B** {pos(vb)}", unsafe_allow_html=True,
            help="|A Δ B|: positions held by exactly one of the two policies (see Glossary)")
    if ctx.budget >= ctx.trace.steps:
        st.warning(f"Budget {ctx.budget} ≥ the {ctx.trace.steps} positions of this trace: "
                   "nothing is ever evicted, so both policies hold everything and the views "
                   f"show no choices. Set a budget below {ctx.trace.steps} in the sidebar.",
                   icon=":material/info:")
