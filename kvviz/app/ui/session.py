"""Session state <-> widgets <-> st.query_params.

Widgets use keys "w.<field>" (parameters: "w.pa.<name>", "w.pb.<name>"). On a session's
first run the URL is parsed into those keys. Streamlit forgets a widget's value when the
widget is not drawn in a run (e.g. the zoom box on another view), so every value is also
kept in a plain dict (`kv`) and restored when its widget key is missing; `widget` does both
around drawing one. After the page is drawn, the state is written back to the URL, so the
address bar is always a link to exactly this view.
"""
from __future__ import annotations

import streamlit as st

from kvviz.app.state import FIELDS, PLAIN, ViewState, from_query, to_query
from kvviz.app.ui import classroom
from kvviz.core.policies import param_specs

S = st.session_state
# FIELDS: every ViewState field, the page's and each view's own, but the parameter dicts
# (kept per parameter, see pkey)
BLANK = ViewState()
# widget keys of the plain fields (state.PLAIN), so a view keeps its existing keys
PLAIN_KEYS = {f: k for k, f in PLAIN.items()}


# The page's own session keys beside the widgets' and `kv`, gathered here with what each is
# for (a view's widget keys are its own: "w.<field>", "w.pa.<name>", "loop.*", "slides.*",
# "nav.*", "exp.*", "chart.*", "dl.*", "sweep.*", "why.*", "class.*"). Prefix keys end in ".".
KV = "kv"                        # the page state: ViewState fields and parameters, every run
NOTES = "notes"                  # warnings collected while drawing, shown once (note)
FROM_LINK = "from_link"          # the link's keys, on a session's first run only
UPLOADS = "uploads"              # this session's uploaded traces (upload:SHA)
UPLOAD_MSG = "upload_msg"        # the last upload's result, shown once
BUDGET_TRACE = "budget_trace"    # the trace the budget belongs to (sidebar)
BUDGET_BY_TRACE = "budget_by_trace"  # the budget last used on each trace
PREVIEWED = "kv.previewed"       # the first heatmap's server-drawn preview has been shown
DRAWN = "kv.drawn"               # the page has drawn once (app.py's placeholder text)
RUNS = "kv.runs"                 # whole-page runs of this session (timer_place)
SWEEP_ON = "sweep_on."           # + budget/pool/obs: the sweep asked for, on which setting
PAGE_KEYS = (KV, NOTES, FROM_LINK, UPLOADS, UPLOAD_MSG, BUDGET_TRACE, BUDGET_BY_TRACE,
             PREVIEWED, DRAWN, RUNS, SWEEP_ON,
             # kept by other modules: the guided experiments' message, the loop view's
             # background job, the slides' trace and automatic frame count
             "exp_msg", "loop.job", "slides.src", "slides.auto",
             # the class this session leads or follows, and its member token (ui/classroom.py)
             *classroom.KEYS,
             # a student's page: the lecturer's version applied, its state then, exploring
             # on their own (ui/follow.py)
             "follow.applied", "follow.base", "follow.own",
             # predict then reveal: the question panel's own keys and widgets (ui/predict.py)
             "predict.",
             # the lesson's picker and scene (plain keys), its buttons and error (ui/lesson.py)
             "lesson", "scene", "lesson.",
             # the budget as a share of the tokens seen: its switch and share (ui/sidebar.py)
             "budget_share.")


def note(msg: str) -> None:
    """A warning for the page's notice area (a clamped or ignored value), shown this run."""
    S.setdefault(NOTES, [])
    if msg not in S[NOTES]:
        S[NOTES].append(msg)


def from_link(field: str) -> bool:
    """True on a session's first run when the link set `field` (a value to check and, if
    out of range, to warn about; later resets after a trace switch are not warned)."""
    return field in S.get(FROM_LINK, ())


def fragment_run() -> bool:
    """True when only fragments are re-running (a timer tick: the play ticker, the
    lecturer's live histogram), not the whole page."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return bool(ctx is not None and getattr(ctx, "fragment_ids_this_run", None))


def pop_notes() -> list[str]:
    return S.pop(NOTES, [])


def wkey(field: str) -> str:
    return f"w.{field}"


def pkey(which: str, name: str) -> str:
    return f"w.p{which}.{name}"


def init() -> list[str]:
    """First run of a session: URL -> session state. Returns notes about ignored keys."""
    if "kv" in S:
        return []
    query = {k: st.query_params.get_all(k) for k in st.query_params}  # repeats are said
    st_, notes = from_query(query)
    S[FROM_LINK] = set(query)
    S["kv"] = {}
    refusal = classroom.init_follow(query)  # follow=CODE: a student's page (ui/follow.py)
    if refusal:
        S[classroom.REFUSED] = refusal
    unled = S.pop(classroom.UNLED, None)  # (not a refusal: the page is an explorer of the class)
    apply_state(st_)
    return notes + ([unled] if unled else [])


def apply_state(vs: ViewState, clear_exp: bool = False) -> None:
    """Put a whole ViewState into the widget keys (call from callbacks or before widgets)."""
    kv = S["kv"]
    S[BUDGET_TRACE] = vs.trace  # the budget comes with this trace (see sidebar)
    for f in FIELDS:
        v = getattr(vs, f)
        key = PLAIN_KEYS.get(f, wkey(f))
        if f in ("step", "budget") and v is None:  # chosen once the trace is known
            kv.pop(f, None)
            S.pop(key, None)
            continue
        kv[f] = v
        if f in PLAIN_KEYS and v == getattr(BLANK, f):
            S.pop(key, None)  # the view's own default
        else:
            S[key] = v
    for which in ("a", "b"):
        name = getattr(vs, which)
        given = vs.pa if which == "a" else vs.pb
        for spec in param_specs(name):
            val = given.get(spec.name, spec.default)
            kv[pkey(which, spec.name)] = val
            S[pkey(which, spec.name)] = val


def restore(key: str, default):
    """Before drawing a widget: make sure its key holds a value (the kept one or `default`)."""
    if key not in S:
        S[key] = S["kv"].get(key, default) if key.startswith("w.p") else S["kv"].get(
            key[2:], default)
    return S[key]


def keep(key: str, value) -> None:
    """After drawing a widget: remember its value across runs where it is not drawn."""
    if key.startswith("w.p"):
        S["kv"][key] = value
    else:
        S["kv"][key[2:]] = value


def widget(draw, field: str, *args, key: str | None = None, fit=None, show=None, store=None,
           **kw):
    """Draw a widget (`draw(*args, key=..., **kw)`, e.g. `st.slider` or `col.selectbox`)
    whose value is the page state `field`, so it is in the link and survives runs where
    the widget is not drawn. `show` turns a state value into the widget's (a name into its
    label), `store` the widget's back; `fit(value)` returns the value to show instead of one
    that does not fit (the view's default for the blank state). Returns the widget's value."""
    key = key or PLAIN_KEYS.get(field) or wkey(field)
    if key in S:
        value = S[key]
    else:
        value = S["kv"].get(field, getattr(BLANK, field))
        value = show(value) if show is not None else value
    if fit is not None:
        value = fit(value)
    S[key] = value
    out = draw(*args, key=key, **kw)
    S["kv"][field] = store(out) if store is not None else out
    return out


def fits(options: list, field: str, default, what: str):
    """A `widget` fit for a choice among `options`: a value not among them becomes `default`,
    said (naming the link key and `what` it should be) when the link asked for it."""
    def fit(v):
        if v in options:
            return v
        link = PLAIN_KEYS.get(field, field)
        if v not in ("", 0, None) and from_link(link):
            note(f"{link}={v}: no such {what} here; showing {default}")
        return default
    return fit


def set_value(field: str, value) -> None:
    """From a callback: change a field (widget key and kept copy)."""
    S[wkey(field)] = value
    S["kv"][field] = value


def current(which: str) -> dict:
    """Parameter dict of policy 'a' or 'b' as the widgets hold it."""
    name = S["kv"].get(which)
    out = {}
    for spec in param_specs(name):
        k = pkey(which, spec.name)
        try:  # a key another policy's parameter of the same name left behind may not fit
            out[spec.name] = spec.coerce(S.get(k, S["kv"].get(k, spec.default)))
        except ValueError:
            out[spec.name] = spec.default
    return out


def view_state() -> ViewState:
    kv = S["kv"]
    vs = ViewState(**{f: kv[f] for f in FIELDS if kv.get(f) is not None},
                   pa=current("a"), pb=current("b"))
    vs.settle()  # each view's slice puts its own fields back in their types
    return vs


def check_positions(step: int) -> None:
    """A link's zoom or explained position not yet generated at its step goes back to
    automatic, said (a title "around position 4000" at step 600 names nothing on screen)."""
    for f in ("focus", "why"):
        v = int(S["kv"].get(f, -1))
        if v > step and from_link(f):
            note(f"{f}={v} is not generated until step {v} (this link shows step {step}); "
                 "using -1 (automatic)")
            S["kv"][f] = -1
            S.pop(wkey(f), None)


def timer_place():
    """A container for a timer fragment (`st.fragment(run_every=...)`), in one of two places
    used in turn, whole-page run after whole-page run. Streamlit names a fragment by its
    place, so the timer's id changes with every page run: a tick the browser sent before it
    heard of a run names a fragment that no longer exists, and Streamlit drops it. Otherwise
    a tick landing just as a run ends starts a new script runner, Streamlit discards the
    run's unsent last messages (its end, its timer: see its AppSession.request_rerun), and
    the page never moves again (`scripts/loadtest.py --class 30`: 1-6 such students in 3 of
    4 runs before; none in three runs after)."""
    places = (st.container(), st.container())
    return places[S.get(RUNS, 0) % 2]


def write_url() -> None:
    """End of a whole-page run: the page's state into the address bar."""
    S[RUNS] = S.get(RUNS, 0) + 1  # (timer_place)
    S.pop(FROM_LINK, None)  # the link's values have been checked
    q = to_query(view_state())
    if S.get(classroom.FOLLOWS):  # a student's reload (or reconnection) keeps following
        q["follow"] = S[classroom.FOLLOWS]
    elif S.get(classroom.LEADS):  # the lecturer's leads again (with its browser's key)
        q["lead"] = S[classroom.LEADS]
    if st.query_params.to_dict() != q:
        st.query_params.from_dict(q)
