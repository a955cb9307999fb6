"""Step navigation (slider, prev/next, play, the jumps, the tracked position) and the
status line. What each jump looks for is `kvviz.app.jumps`; the buttons' help says it."""
from __future__ import annotations

import numpy as np
import streamlit as st

from kvviz.app import explain, jumps
from kvviz.app import figures as V
from kvviz.app.figures.states import NEVER, next_after
from kvviz.app.ui import compute, follow, present
from kvviz.app.ui.context import Ctx
from kvviz.app.ui.glossary import glossary_popover
from kvviz.app.ui.positions import restore_position
from kvviz.app.ui.session import S, fragment_run, from_link, keep, note, restore, set_value, timer_place, widget, wkey
from kvviz.core.budget import is_ratio, resolve

SHARES = (0.002, 0.005, 0.01, 0.02, 0.05)  # the notable-divergence jump's thresholds

PLAY_SPEEDS = (1, 4, 16, 64)
NBSP = "\u00a0"
PLAY_INTERVAL_S = 1.0


def _shift(delta: int, steps: int):
    set_value("step", int(np.clip(int(S.get(wkey("step"), 0)) + delta, 0, steps - 1)))


def goto(step: int, why: int | None = None):
    set_value("step", int(step))
    if why is not None:
        set_value("why", int(why))


@st.cache_data(max_entries=32, show_spinner="Finding the steps worth a look…")
def _notable(key, layer, version, a, b, budget, head, share):
    ea = compute.get_engine(key, layer, version, a[0], a[1], budget, head).evicted_at
    eb = compute.get_engine(key, layer, version, b[0], b[1], budget, head).evicted_at
    return jumps.notable_divergences(compute.get_trace(key, layer, version, head), ea, eb, share)


@st.cache_data(max_entries=32, show_spinner="Finding the heavy hitters…")
def _heavy(key, layer, version, a, b, budget, head):
    trace = compute.get_trace(key, layer, version, head)
    ea = compute.get_engine(key, layer, version, a[0], a[1], budget, head).evicted_at
    eb = compute.get_engine(key, layer, version, b[0], b[1], budget, head).evicted_at
    return jumps.heavy_hitter_evictions(jumps.first_heavy(trace, resolve(budget, trace.steps) // 4), ea, eb)


def _args(ctx: Ctx) -> tuple:
    return (ctx.key, ctx.layer, ctx.version, (ctx.a, ctx.pa), (ctx.b, ctx.pb), ctx.budget,
            ctx.head)


def tracked(ctx: Ctx) -> int:
    """The tracked position (-1: none), checked against this trace."""
    v = int(S["kv"].get("track", -1))
    return v if -1 <= v < ctx.trace.steps else -1


def notable_here(ctx: Ctx):
    """(position, share, share step, threshold) when the page is where the next-divergence
    jump put it (the step it stops at, and its position as `why`: the jump sets both, and a
    link keeps them), else None."""
    if ctx.solo:
        return None
    share = float(S["kv"].get("share", jumps.NOTABLE_SHARE) or jumps.NOTABLE_SHARE)
    steps, positions = _notable(*_args(ctx), share)
    i = np.searchsorted(steps, ctx.step)
    if i >= len(steps) or int(steps[i]) != int(ctx.step):
        return None
    p = int(positions[i])
    why = S["kv"].get("why")
    if why is None or int(why) != p:  # (position 0 is a position)
        return None
    got, at = _share_of(*_args(ctx), p)
    return p, got, at, share


@st.cache_data(max_entries=64, show_spinner=False)
def _share_of(key, layer, version, a, b, budget, head, position):
    ea = compute.get_engine(key, layer, version, a[0], a[1], budget, head).evicted_at
    eb = compute.get_engine(key, layer, version, b[0], b[1], budget, head).evicted_at
    return jumps.divergence_share(compute.get_trace(key, layer, version, head), ea, eb, position)


def divergence_note(ctx: Ctx) -> None:
    """At a step the next-divergence jump stops at: which position, why it counts and each
    policy's score for it (the cache heatmap marks it)."""
    here = notable_here(ctx)
    if here is None or ctx.hide_from is not None:  # (it says when the other policy evicts)
        return
    p, got, at, share = here
    panels = [ctx.panel("a", ctx.step), ctx.panel("b", ctx.step)]
    st.markdown(explain.divergence_text(p, ctx.step, got, at, share, ctx.ev_a, ctx.ev_b, panels))


def _jump_button(where, label, key, target, help_, shortcut, why=None, hide_from=None):
    """`hide_from`: the page hides that step and later ones (a class's open question), so a
    target there is neither said nor reachable."""
    hidden = hide_from is not None and (target < 0 or target >= hide_from)
    if hidden:
        target, why = NEVER, None
    where.button(label, key=key, on_click=goto, args=(target, why), disabled=target < 0,
                 width="content", shortcut=shortcut,
                 help=help_ + (f" Next: step {target}." if target >= 0 else
                               f" Hidden from step {hide_from} on while the class's question "
                               "is open." if hidden else " None after this step."))


def jumps_row(ctx: Ctx, step: int):
    """The jumps a lecturer wants on one wrapping row (whole labels at 1024 px and 125 %
    zoom); their settings, the tracked position and the threshold, at the foot of the
    sidebar, so the first chart stays high on the page."""
    # presentation mode, a following student: the values, no widgets (app.py)
    side = present.sidebar(not (present.active() or follow.following()))
    side.header("Track and jump")
    restore_position("track", ctx.trace.steps)
    track = side.number_input("track position (-1: none)", min_value=-1,
                              max_value=ctx.trace.steps - 1, step=1, key=wkey("track"),
                              help="Pin one position: every view marks it, and a jump finds "
                                   "its next eviction.")
    keep(wkey("track"), int(track))
    if ctx.solo:
        return
    share = widget(side.selectbox, "share", "next divergence: attention share over", SHARES,
                   fit=lambda v: v if v in SHARES else jumps.NOTABLE_SHARE,
                   format_func=lambda v: f"{v:.1%}",
                   help="What the next-divergence jump (D) looks for: a position that one "
                        "policy has evicted and the other still holds, carrying over this "
                        "share of a step's attention while only one holds it.")
    row = st.container(horizontal=True, wrap=True, gap="small")
    steps, positions = _notable(*_args(ctx), share)
    i = np.searchsorted(steps, step, side="right")
    nxt, why = (int(steps[i]), int(positions[i])) if i < len(steps) else (NEVER, None)
    _jump_button(row, f"next divergence > {share:.1%}", "nav.div", nxt,
                 f"The next step at which A or B evicts a position the other keeps that, while "
                 f"only the other holds it, carries over {share:.1%} of a step's attention "
                 "(the Divergence view then explains that position).", "D", why, ctx.hide_from)
    epochs = jumps.epoch_boundaries(ctx.trace)
    if len(epochs):
        _jump_button(row, "next epoch", "nav.epoch", next_after(epochs, step),
                     f"The canonical trace redraws its heavy hitters every {ctx.trace.epoch} "
                     "steps: the next first step of an epoch.", "E", hide_from=ctx.hide_from)
    hh = _heavy(*_args(ctx))
    _jump_button(row, "next heavy-hitter eviction", "nav.hh", next_after(hh, step),
                 f"The next step at which A or B evicts a position that has been a heavy hitter "
                 f"(one of the {max(1, resolve(ctx.budget, ctx.trace.steps) // 4)} = budget/4 positions with the most "
                 "attention received so far in the full trace, see Glossary).", "H",
                 hide_from=ctx.hide_from)
    if track >= 0:
        _jump_button(row, f"next eviction of {int(track)}", "nav.track",
                     next_after(jumps.position_evictions(ctx.ev_a, ctx.ev_b, int(track)), step),
                     f"The next step at which A or B evicts the tracked position {int(track)}.",
                     "T", hide_from=ctx.hide_from)


def advance(step: int, speed: int, steps: int) -> tuple[int, bool]:
    """One play tick: (new step, still playing)."""
    new = min(step + speed, steps - 1)
    return new, new < steps - 1


def navigator(ctx: Ctx) -> int:
    steps = ctx.trace.steps
    for field in ("focus", "why", "track"):  # positions from a link or kept from another trace
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
    room = present.active()
    if room:  # one item each of presentation mode's compact row (no play, jumps by key)
        return _room_navigator(ctx, steps)
    if follow.following():
        return _follower_navigator(steps)
    step = st.slider("step", 0, steps - 1, key=wkey("step"), label_visibility="collapsed",
                     help="the decode step shown (state after that step's eviction)")
    # no spacer column: at 1024x768 (a projector) every button keeps its whole label
    cols = st.columns([1.2, 1.2, 1, 1], vertical_alignment="center", gap="small")
    cols[0].button("prev", key="nav.prev", on_click=_shift, args=(-1, steps), width="stretch",
                   icon=":material/chevron_left:", shortcut="J",
                   help="previous step (key J)")
    cols[1].button("next", key="nav.next", on_click=_shift, args=(1, steps), width="stretch",
                   icon=":material/chevron_right:", shortcut="K",
                   help="next step (key K)")
    cols[2].toggle("play", key="w.play")
    cols[3].selectbox("speed", PLAY_SPEEDS, key="w.speed", label_visibility="collapsed",
                      format_func=lambda v: f"+{v}", help="steps per tick while playing "
                      "(one tick a second)")
    keep(wkey("step"), int(step))
    jumps_row(ctx, int(step))
    if S.get("w.play"):
        with timer_place():  # a tick reruns the page every second: (why: session.timer_place)
            _ticker(steps)
    return int(step)


def _follower_navigator(steps: int) -> int:
    """A following student's: the step slider and the arrows, which take the student off on
    their own; no play, speed or jumps (the lecturer's page moves this one). After every move
    of the lecturer each student's page runs again: fewer widgets are less of the server's
    time per student ("Explore on my own" and any move bring the whole navigator back)."""
    step = st.slider("step", 0, steps - 1, key=wkey("step"), label_visibility="collapsed",
                     help="the decode step shown (state after that step's eviction)")
    row = st.container(horizontal=True, gap="small")
    row.button("prev", key="nav.prev", on_click=_shift, args=(-1, steps), shortcut="J",
               help="previous step (key J): you explore on your own from here")
    row.button("next", key="nav.next", on_click=_shift, args=(1, steps), shortcut="K",
               help="next step (key K): you explore on your own from here")
    keep(wkey("step"), int(step))
    return int(step)


def _room_navigator(ctx: Ctx, steps: int) -> int:
    """Presentation mode's step navigation, drawn into its compact row: previous, the step
    slider, next; the arrows' and the jumps' buttons hidden, their keys kept."""
    st.button("‹", key="nav.prev", on_click=_shift, args=(-1, steps), shortcut="J",
              help="previous step (key J or ←)")
    step = st.slider("step", 0, steps - 1, key=wkey("step"), label_visibility="collapsed",
                     help="the decode step shown (state after that step's eviction)")
    st.button("›", key="nav.next", on_click=_shift, args=(1, steps), shortcut="K",
              help="next step (key K or →)")
    arrows = st.container(key="nav-arrows")  # a button holds one key: the arrows' own pair
    arrows.button("previous step", key="nav.left", on_click=_shift, args=(-1, steps),
                  shortcut="Left")
    arrows.button("next step", key="nav.right", on_click=_shift, args=(1, steps),
                  shortcut="Right")
    keep(wkey("step"), int(step))
    with st.container(key="nav-jumps"):
        jumps_row(ctx, int(step))
    return int(step)


@st.fragment(run_every=PLAY_INTERVAL_S)
def _ticker(steps: int):
    """Runs inline on every page run (does nothing then) and alone every PLAY_INTERVAL_S while
    playing: each timer tick moves the step on and reruns the page."""
    if not S.get("w.play") or not fragment_run():
        return
    new, more = advance(int(S["kv"].get("step", 0)), int(S.get("w.speed", 1)), steps)
    set_value("step", new)
    if not more:
        S["w.play"] = False
    st.rerun(scope="app")


def tie_words(position: int, ties) -> str:
    """' (a tie-break: …)' after a victim a tie-break chose rather than its score, '' else: said
    beside the position, in few words, so the status line stays short; the count of the
    positions it ties with reads as a count ("… as 418 held positions"), never as a victim."""
    t = next((t for t in ties if t.position == int(position)), None)
    if t is None:
        return ""
    n = len(t.kept)
    return f" (a tie-break: scored as {n} held position{'s' if n != 1 else ''})"


@st.cache_resource(max_entries=512, show_spinner=False)
def _ties(run: compute.RunKey, which: str, step: int, _ctx: Ctx) -> tuple:
    """The tie-decided victims of `run` at `step` (explain.tie_facts), once per server: every
    page of a class at this step says the same (and peeks the same state)."""
    return tuple(explain.tie_facts(which.upper(), _ctx.panel(which, step)))


def ratio_line(ctx: Ctx) -> str:
    """The budget this step resolves to under a ratio budget, for A and B (each never below
    its own floor: its sinks and recent window)."""
    seen = ctx.step + 1
    sides = (("A", ctx.eng_a),) if ctx.solo == "a" else (("B", ctx.eng_b),) if ctx.solo == "b" else (
        ("A", ctx.eng_a), ("B", ctx.eng_b))
    held = " · ".join(f"**{w}** {resolve(eng.policy.ratio, seen)} slots" + (
        f" (its floor {eng.policy.ratio.floor})" if resolve(eng.policy.ratio, seen) == eng.policy.ratio.floor
        and eng.policy.ratio.floor > 1 else "") for w, eng in sides)
    return f"budget {ctx.budget} of the {seen:,} positions seen at step {ctx.step}: {held}"


def status(ctx: Ctx):
    """One wrapping line (metrics in five columns are cut at 1024 px): what each policy
    holds, |A Δ B| now, the first divergence and the positions evicted at this step (a
    victim the tie-break chose said to be one)."""
    s = ctx.step
    va, vb = ctx.eng_a.victims(s), ctx.eng_b.victims(s)
    sides = (ctx.solo,) if ctx.solo else ("a", "b")
    ties = {w: _ties(ctx.run(w), w, s, _ctx=ctx) for w in sides}

    def pos(v, w):
        if not len(v):
            return "nothing"
        tied = ties.get(w, ())
        shown = ", ".join(str(p) + tie_words(p, tied) for p in v[:4]) + (
            f" … ({len(v)} in all)" if len(v) > 4 else "")
        return ("position " if len(v) == 1 else "positions ") + shown

    hold_a = int(V.held_mask(ctx.ev_a, s).sum())
    room = present.active() and not ctx.solo  # the room: one short line (the chart names A, B)
    if room:
        first = ctx.first_divergence
        st.markdown(
            f"evicted at step {s}: <span style='color:{ctx.colours[0]}'>■</span> **A** "
            f"{pos(va, 'a')} · <span style='color:{ctx.colours[1]}'>■</span> **B** "
            f"{pos(vb, 'b')} · **|A Δ B|** "
            f"{int(ctx.pair['symdiff'][s])} · first\u00a0divergence:\u00a0"
            f"{'none' if first < 0 else 'step' + NBSP + str(first)}", unsafe_allow_html=True)
    elif follow.following():  # the glossary (6 KB) with Explore on my own: every student's
        line = st.container()  # page runs again after each move
    else:
        line, gloss = st.columns([4, 1.1], vertical_alignment="center")
        with gloss:
            glossary_popover()  # one click away whatever the view
    if ctx.solo:
        w = ctx.solo.upper()
        line.markdown(f"**{w}** {ctx.label_a if ctx.solo == 'a' else ctx.label_b} holds "
                    f"**{hold_a}** · evicted at step {s}: {pos(va, ctx.solo)} · the other policy refused "
                    "its settings (see above)")
    elif not room:
        hold_b = int(V.held_mask(ctx.ev_b, s).sum())
        diff = int(ctx.pair["symdiff"][s])
        first = ctx.first_divergence  # (-1 too when it is at a hidden step)
        first = (f"step{NBSP}{first}" if first >= 0 else "none" if ctx.hide_from is None
                 else f"none before step{NBSP}{ctx.hide_from}")
        line.markdown(
            f"<span style='color:{ctx.colours[0]}'>■</span> **A** {ctx.label_a} holds **{hold_a}** · "
            f"<span style='color:{ctx.colours[1]}'>■</span> **B** {ctx.label_b} holds **{hold_b}** · "
            f"**|A Δ B|** {diff} held by one only · "
            f"first\u00a0divergence:\u00a0"  # kept on one line
            f"{first}  \n"
            f"evicted at step {s}: **A** {pos(va, 'a')} · **B** {pos(vb, 'b')}", unsafe_allow_html=True,
            help="|A Δ B|: positions held by exactly one of the two policies"
                 + (" (the Glossary, with Explore on my own)" if follow.following()
                    else " (see Glossary)"))
    divergence_note(ctx)
    track = tracked(ctx)
    if track >= 0:
        st.markdown(explain.track_text(track, ctx.trace.tokens, ctx.ev_a, ctx.ev_b, s,
                                       solo=bool(ctx.solo)))
    if is_ratio(ctx.budget):
        st.caption(ratio_line(ctx), help="A ratio budget is re-counted at every step over the "
                   "positions seen so far, rounded down, and never below what the policy's "
                   "sinks and recent window need (kvviz.core.budget).")
    if resolve(ctx.budget, ctx.trace.steps) >= ctx.trace.steps:
        st.warning(f"Budget {ctx.budget} ≥ the {ctx.trace.steps} positions of this trace: "
                   "nothing is ever evicted, so both policies hold everything and the views "
                   f"show no choices. Set a budget below {ctx.trace.steps} in the sidebar.",
                   icon=":material/info:")
