"""The explorer's page run: the link read, the sidebar, the step navigation, the selected view,
then one finishing step (the notes said, the link written, the class told).

`app.py` lays out the page's frame (title, notice area, navigation row, view slot) and loads
the heavy libraries under the server-wide import lock before this module is imported; then it
calls `run`. Every way through the page (the views, the loop and Forgetting views with their
own policies, both policies refused) returns here to `_finish`, so the address bar and a
class's lecturer always hear of the run the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from kvviz.app.ui import compute, follow, lesson, panels, predict, present, session, sidebar
from kvviz.app.ui.imports import import_lock
from kvviz.core.plugins import load_all
from kvviz.core.policies import config_label

FOOTER = ("kvviz · policies, replay and metrics come from the kvviz core; this page only "
          "draws them. The address bar always links to exactly this view.")

# What a run drew, for the finishing step
VIEWS = "views"      # the page's policies A/B in the selected view
OWN = "own"          # the loop or Forgetting view, with its own policies
NOTHING = "nothing"  # both policies refused their settings
# views with their own results, policies and budgets (no step slider, status line or page-wide
# policies: those belong to the trace, not to these charts)
OWN_VIEWS = ("loop", "needle", "heads")


@dataclass
class Page:
    """The page's frame (from app.py) and what this run decided about its layout."""

    notices: object           # notes about the link, refusals, the lesson bar
    top: object               # step navigation, status line
    main: object              # the selected view (an st.empty)
    room: bool = False        # presentation mode (kvviz.app.ui.present)
    quiet: bool = False       # no sidebar controls: presentation mode or following a class
    row: object = None        # presentation mode's one compact row
    experiments: object = None  # the sidebar's guided-experiments slot


def run(notices, top, main) -> None:
    """One whole-page run into the frame app.py laid out."""
    page = Page(notices, top, main)
    with import_lock():  # installed entry points and $KVVIZ_PLUGINS, before the link is read
        for refusal in load_all():  # once per server process; refusals are kept and said each run
            notices.error(f"Plugin refused (the built-in policies still work): {refusal}")
    notes = session.init()
    lesson.init()  # a scene's short link (?lesson=NAME&scene=N) applies the scene's state
    for note in notes:
        notices.warning(f"Link: {note}")
    # A class's students take turns drawing their pages (kvviz.app.ui.follow.turn): after the
    # lecturer moves, 30 pages run at once otherwise, and sharing one interpreter each
    # finishes only when all do.
    with follow.turn():
        banner = follow.sync(notices)  # a student's page takes the lecturer's state, before any widget
        drew = _draw(page)
        _finish(page, banner, drew)


def _finish(page: Page, banner, drew: str) -> None:
    """The end of every run: notes collected while drawing, the link, the class."""
    for note in session.pop_notes():  # values clamped or ignored while drawing the views
        page.notices.warning(note, icon=":material/warning:")
    if drew != NOTHING:
        st.session_state[session.DRAWN] = True
    session.write_url()
    follow.publish(banner)  # the lecturer's page moves the class; a student's is moved
    if drew == VIEWS and not follow.following():  # (a following student's page: every element, every move)
        st.caption(FOOTER)


def _draw(page: Page) -> str:
    """Everything between the link and the finish; returns what it drew (VIEWS, OWN, NOTHING)."""
    page.room = present.active()  # presentation mode: no sidebar, one view, large type
    # a following student's sidebar says the lecturer's settings instead of drawing their
    # controls (the same values, through presentation mode's quiet sidebar), until they
    # explore on their own: a third of a page run, 30 times after every move
    page.quiet = page.room or follow.following()
    if page.room:
        with page.top:
            # one compact row: the lesson's scene, the class, the step navigation, the ask
            # buttons and the way back (key P), so the chart is on the first screen
            page.row = present.bar()
    else:
        if predict.hidden() is None:  # a linked experiment's focus may be the asked eviction
            panels.open_linked_experiment()
        present.button()
    with page.notices:
        lesson.bar(draw_picker=not page.quiet, row=page.row)  # the lesson bar (its picker in the sidebar)
    if page.room:
        follow.code_line(page.row)  # an open class's code and its live count, for a late student

    # The guided experiments and an open experiment's text head the sidebar: beside the chart
    # they explain, not above it (at 1024x768 and 125 % zoom the chart would leave the screen).
    page.experiments = present.sidebar(not page.quiet).container()
    if not page.room:
        follow.panel()  # the Class panel: open a class, its code and link
    key, layer, version, trace = sidebar.trace_controls(draw=not page.quiet)
    own = panels.current_view(trace.tokens is not None)
    if own in OWN_VIEWS and not predict.active():
        _own_view(page, own, key, layer, version, trace)
        return OWN
    return _views(page, key, layer, version, trace)


def _own_view(page: Page, own: str, key, layer, version, trace) -> None:
    """The closed-loop and pass-key results carry their own policies, budgets and steps: the
    page-wide ones (and a status line about the trace) would be a second, unrelated set on
    the screen (a class's question, when one is up, is drawn by `_views` instead)."""
    if not page.quiet:
        sidebar.loop_note()
        with page.experiments:
            panels.experiments_box()
    elif not page.room:
        follow.summary(key)
    if page.room:
        present.leave(page.row)
    with page.main.container():
        if not page.room:
            panels.view_selector(trace.tokens is not None)
        with present.frame(own):
            panels.RENDER[own](panels.loop_ctx(key, layer, version, trace))


def _views(page: Page, key, layer, version, trace) -> str:
    """The page's budget and policies A/B, the step navigation and the selected view."""
    budget, pols, built = sidebar.policy_controls(trace.steps, trace, draw=not page.quiet)
    if page.quiet and not page.room:
        follow.summary(key, budget, pols)
    if not page.quiet:
        with page.experiments:
            # an experiment's text may name the question's answer (at any step it found)
            if not predict.active() and predict.hidden() is None:
                panels.experiments_box()
    for note in session.pop_notes():  # values clamped or ignored while drawing the sidebar
        page.notices.warning(note, icon=":material/warning:")

    refused = {w: p for w, p in pols.items() if p[2]}
    for which in refused:
        page.top.error(panels.refusal_message(which, pols))
    if len(refused) == 2:  # nothing left to draw
        if page.room:
            present.leave(page.row)
        page.main.empty()
        return NOTHING
    ctx = _context(key, layer, version, trace, budget, pols, built, refused)
    with page.top:
        locked = predict.locked(ctx)  # a question is up: no navigation, no status (victims)
        if locked is None:
            with page.row if page.room else st.container(key="nav"):  # (wraps, never cuts a label)
                ctx.step = panels.navigator(ctx)
            session.check_positions(ctx.step)
            panels.status(ctx)
        else:
            ctx.step = locked
        predict.controls(ctx, page.row)
        if page.room:
            present.leave(page.row)
    with page.main.container():
        # the question panel replaces the view while it is up; a hidden question, whole-run views
        if not predict.question(ctx) and not hidden_view(ctx):
            view = (panels.current_view(trace.tokens is not None) if page.room
                    else panels.view_selector(trace.tokens is not None))
            with present.frame(view):
                panels.RENDER[view](ctx)
    return VIEWS


def _context(key, layer, version, trace, budget, pols, built, refused) -> panels.Ctx:
    """The views' context: both runs replayed (each with the policy object the sidebar built,
    so the run builds each configuration once). With one policy refused, the valid one is
    drawn on both sides (the views say which one refused)."""
    solo = "" if not refused else "b" if "a" in refused else "a"
    if solo:
        other = "a" if solo == "b" else "b"
        pols[other], built[other] = pols[solo], built[solo]
    (a, pa, _), (b, pb, _) = pols["a"], pols["b"]
    head = sidebar.current_head()
    eng_a = compute.get_engine(key, layer, version, a, compute.params_key(pa), budget, head,
                               built=built["a"])
    eng_b = compute.get_engine(key, layer, version, b, compute.params_key(pb), budget, head,
                               built=built["b"])
    ctx = panels.Ctx(key=key, layer=layer, version=version, trace=trace, budget=budget, a=a, b=b,
                     pa=compute.params_key(pa), pb=compute.params_key(pb), eng_a=eng_a, eng_b=eng_b,
                     label_a=config_label(a, pa), label_b=config_label(b, pb), solo=solo,
                     head=head)
    if solo:
        setattr(ctx, "label_" + ("b" if solo == "a" else "a"),
                f"{config_label(a, pa)}, shown again: {'B' if solo == 'a' else 'A'} refused")
    return ctx


def hidden_view(ctx: panels.Ctx) -> bool:
    """While the page hides a class's open question (kvviz.app.ui.predict): a view that shows the whole
    run (and the asked eviction with it) is replaced by a sentence, beside the view chooser."""
    if ctx.hide_from is None:
        return False
    tokens = ctx.trace.tokens is not None
    if panels.current_view(tokens) in predict.WHOLE_RUN_SHOWN:
        return False  # (drawn by the page, the heatmap cut at `Ctx.hide_from`)
    if not present.active():
        panels.view_selector(tokens)
    st.info("This view shows the whole run, the step the class's open question asks about "
            "included: it is back once the lecturer reveals the answer. The Cache heatmap and "
            "Scores views show the run up to this step.", icon=":material/quiz:")
    return True
