"""kvviz explorer: watch decode-time KV-cache eviction policies work, step by step.

    streamlit run app.py

Thin entry point: lays out the page; the work lives in kvviz.app.ui (state, cached compute,
controls) and kvviz.app.figures (pure figure builders).
"""
import streamlit as st

from kvviz.app.ui import layout
from kvviz.app.ui.imports import import_lock, settle

st.set_page_config(page_title="kvviz: KV-cache eviction explorer", page_icon="🗂️", layout="wide")

# The page's style and title in one element (each element costs every run a message).
st.markdown(f"<style>{layout.CSS}</style>\n\n#### {layout.TITLE}", unsafe_allow_html=True)
notices = st.container()   # notes about the link
top = st.container()       # step navigation, status line
main = st.empty()          # the selected view
# Streamlit runs every session's script in its own thread, so on a fresh server the first
# sessions import numpy, pandas, PIL and plotly at the same moment. `import numpy` waits for a
# complete module, but plotly looks numpy, pandas and PIL.Image up in sys.modules directly, so
# a chart drawn while another session is half-way through importing them fails ("partially
# initialized module 'numpy' has no attribute 'ndarray'"). Drawing the first chart and doing
# those imports under one server-wide lock means no chart is ever drawn beside a half-made
# module. Later runs find them loaded. The placeholder is text, not a chart: a Plotly element
# makes the browser load and run plotly.js (4.7 MB), which held up drawing the first chart's
# server-built image (kvviz.app.ui.view_cache's preview).
with import_lock():
    if not st.session_state.get("kv.drawn"):  # session.DRAWN (imported below)
        main.caption("Replaying the policies…")
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import PIL.Image  # noqa: F401
    import plotly.graph_objects  # noqa: F401
    settle()

from kvviz.app.ui import compute, follow, lesson, panels, predict, present, session, sidebar
from kvviz.core.plugins import load_all
from kvviz.core.policies import config_label

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
    room = present.active()  # presentation mode: no sidebar, one view, large type (kvviz.app.ui.present)
    # a following student's sidebar says the lecturer's settings instead of drawing their
    # controls (the same values, through presentation mode's quiet sidebar), until they
    # explore on their own: a third of a page run, 30 times after every move
    quiet = room or follow.following()
    row = None
    if room:
        with top:
            # one compact row: the lesson's scene, the class, the step navigation, the ask
            # buttons and the way back (key P), so the chart is on the first screen
            row = present.bar()
    else:
        panels.open_linked_experiment()
        present.button()
    with notices:
        lesson.bar(draw_picker=not quiet, row=row)  # the lesson bar (its picker in the sidebar)
    if room:
        follow.code_line(row)  # an open class's code and its live count, for a late student

    # The guided experiments and an open experiment's text head the sidebar: beside the chart
    # they explain, not above it (at 1024x768 and 125 % zoom the chart would leave the screen).
    experiments = present.sidebar(not quiet).container()
    if not room:
        follow.panel()  # the Class panel: open a class, its code and link
    key, layer, version, trace = sidebar.trace_controls(draw=not quiet)
    own = panels.current_view(trace.tokens is not None)
    if own in ("loop", "needle") and not predict.active():
        # the closed-loop and pass-key results carry their own policies, budgets and steps:
        # the page-wide ones (and a status line about the trace) would be a second, unrelated
        # set on the screen (a class's question, when one is up, is drawn below instead)
        if not quiet:
            sidebar.loop_note()
            with experiments:
                panels.experiments_box()
        elif not room:
            follow.summary(key)
        if room:
            present.leave(row)
        with main.container():
            if not room:
                panels.view_selector(trace.tokens is not None)
            with present.frame(own):
                panels.RENDER[own](panels.loop_ctx(key, layer, version, trace))
        for note in session.pop_notes():
            notices.warning(note, icon=":material/warning:")
        st.session_state[session.DRAWN] = True
        session.write_url()
        follow.publish(banner)
        st.stop()
    budget, pols = sidebar.policy_controls(trace.steps, trace, draw=not quiet)
    if quiet and not room:
        follow.summary(key, budget, pols)

    if not quiet:
        with experiments:
            if not predict.active():  # an experiment's text may name the question's answer
                panels.experiments_box()
    for note in session.pop_notes():  # values clamped or ignored while drawing the sidebar
        notices.warning(note, icon=":material/warning:")

    refused = {w: p for w, p in pols.items() if p[2]}
    for which in refused:
        top.error(panels.refusal_message(which, pols))
    if len(refused) == 2:  # nothing left to draw
        if room:
            present.leave(row)
        main.empty()
        session.write_url()
        follow.publish(banner)
        st.stop()
    solo = "" if not refused else "b" if "a" in refused else "a"
    if solo:  # draw the valid policy on both sides (the views say which one refused)
        pols["a" if solo == "b" else "b"] = pols[solo]
    (a, pa, _), (b, pb, _) = pols["a"], pols["b"]
    head = sidebar.current_head()
    eng_a = compute.get_engine(key, layer, version, a, compute.params_key(pa), budget, head)
    eng_b = compute.get_engine(key, layer, version, b, compute.params_key(pb), budget, head)
    ctx = panels.Ctx(key=key, layer=layer, version=version, trace=trace, budget=budget, a=a, b=b,
                     pa=compute.params_key(pa), pb=compute.params_key(pb), eng_a=eng_a, eng_b=eng_b,
                     label_a=config_label(a, pa), label_b=config_label(b, pb), solo=solo,
                     head=head)
    if solo:
        setattr(ctx, "label_" + ("b" if solo == "a" else "a"),
                f"{config_label(a, pa)}, shown again: {'B' if solo == 'a' else 'A'} refused")
    with top:
        locked = predict.locked(ctx)  # a question is up: no navigation, no status (victims)
        if locked is None:
            with row if room else st.container(key="nav"):  # (wraps, never cuts a label)
                ctx.step = panels.navigator(ctx)
            session.check_positions(ctx.step)
            panels.status(ctx)
        else:
            ctx.step = locked
        predict.controls(ctx, row)
        if room:
            present.leave(row)
    with main.container():
        if not predict.question(ctx):  # the question panel replaces the view while it is up
            view = (panels.current_view(trace.tokens is not None) if room
                    else panels.view_selector(trace.tokens is not None))
            with present.frame(view):
                panels.RENDER[view](ctx)
    for note in session.pop_notes():  # ... and while drawing the views
        notices.warning(note, icon=":material/warning:")
    st.session_state[session.DRAWN] = True
    session.write_url()
    follow.publish(banner)  # the lecturer's page moves the class; a student's is moved
    if not follow.following():  # (a following student's page: every element, every move)
        st.caption("kvviz · policies, replay and metrics come from the kvviz core; this page only "
                   "draws them. The address bar always links to exactly this view.")
