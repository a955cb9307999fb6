"""Follow the lecturer: the Class panel, the lecturer's state published every
run, and a student's page that moves when the lecturer's does.

The lecturer's session publishes its page as a query mapping (`to_query(view_state())`)
at the end of each run, without the keys that are a screen's own preference (`present`).
A student's page applies the lecturer's state when the class's version moves: the server
runs it again then (kvviz.app.ui.watch; never for votes, only for the lecturer's moves
and the question opening, revealed or closed), so no student's page polls. A student who
moves a control explores on their own: their page stops moving until "Back to the
lecturer". Only the session that
opened the class can move it (`Class.publish` refuses any other token), so a student's
page never publishes.

A page in a class outlives its server: it keeps a timer (`_reconnect`), which is what makes
Streamlit's page run the script again when it reconnects (a restarted server has no session
of it), and that run finds the class again from the link (`follow=`, `lead=`) and the
browser's cookies (kvviz.app.ui.classroom). While the page is cut off it says so
(`RECONNECTING`, a style: the page cannot run then).
"""
from __future__ import annotations

import contextlib

import streamlit as st

from kvviz.app.state import from_query, to_query
from kvviz.app.teach.classroom import CODE_LEN, HERE_SECONDS, Refused
from kvviz.app.ui import classroom, compute, predict, session, watch
from kvviz.app.ui.session import S
from kvviz.core.policies import config_label

# A student's page does not poll: the server moves it (kvviz.app.ui.watch), one read of the
# class store per server process every watch.WATCH_S, however many students follow.
COUNT_S = 2.0  # how often the lecturer's panel recounts the students

OWN_KEYS = ("present",)  # a screen's own preference: neither published nor applied
APPLIED = "follow.applied"  # the lecturer's version this page last applied
BASE = "follow.base"        # the states that are not a move: the lecturer's, and this page's
                            # at the end of the run that applied it
OWN = "follow.own"          # True: the student explores on their own (not moved)
MARK = "follow.marker"      # the class's question (predict.marker) when this run started
KEYS = (APPLIED, BASE, OWN, MARK)  # for session.PAGE_KEYS


def _question_marker(c) -> tuple:
    return predict.marker(c.current_round())


# This process's students' pages, moved by one thread (kvviz.app.ui.watch).
WATCHER = watch.Watcher(classroom.REGISTRY, watch.streamlit_rerun, watch.streamlit_alive,
                        _question_marker)


# A page in a class: its timer's period. The timer does nothing; it is there because Streamlit's
# page runs the script again on reconnecting only when it has one (without it a student's page
# reconnected to a restarted server would stay as it was, following nothing).
RECONNECT_S = 30.0
RECONNECTING = "Reconnecting to the class…"
_CUT_OFF = '[data-testid="stApp"][data-test-connection-state]:not([data-test-connection-state="CONNECTED"])'
_STYLE = (f"<style>{_CUT_OFF}::after {{content: '{RECONNECTING}'; position: fixed; top: 3.2rem; "
          "left: 50%; transform: translateX(-50%); z-index: 1000100; padding: .5rem 1.2rem; "
          "border-radius: .5rem; background: #fff3cd; color: #4d3a00; font-weight: 600; "
          "box-shadow: 0 2px 8px rgba(0,0,0,.25);}} "
          f"{_CUT_OFF} .st-key-class-banner {{visibility: hidden;}}</style>")


# The longest a student's page waits for its turn (`turn`) before drawing anyway.
TURN_WAIT_S = 5.0


@contextlib.contextmanager
def turn():
    """A following student's page run waits for its class's other students' (one at a time).
    When the lecturer moves, every follower reruns within a second; run together, the runs
    share one interpreter and each finishes only when all do, with the server's messages
    queued behind them. One at a time, the first finishes first, and the server's event loop
    gets its turns to send. Never waits more than TURN_WAIT_S (then it runs beside the
    others, as without a turn); a student exploring on their own, a lecturer and a page in
    no class do not take turns."""
    c = None
    if following():
        try:  # not classroom.follows(): a closed class is said by `sync`, not forgotten here
            c = classroom.REGISTRY.get(S[classroom.FOLLOWS])
        except Refused:
            pass
    got = c is not None and c.turn.acquire(timeout=TURN_WAIT_S)
    try:
        yield
    finally:
        if got:
            c.turn.release()


def shared_query() -> dict[str, str]:
    """This page's state as the class shares it (a screen's own keys left out)."""
    q = to_query(session.view_state())
    for k in OWN_KEYS:
        q.pop(k, None)
    return q


def _apply(version: int, state: dict) -> None:
    """Put the lecturer's state on this page, keeping this screen's own preferences."""
    vs, notes = from_query(state)
    for k in OWN_KEYS:
        setattr(vs, k, S["kv"].get(k, getattr(vs, k)))
    session.apply_state(vs)
    for n in notes:
        session.note(f"The lecturer's page: {n}")
    S[APPLIED] = version
    S[BASE] = [{k: v for k, v in state.items() if k not in OWN_KEYS}]


def following() -> bool:
    """This page follows its class's lecturer now (not exploring on its own)."""
    return bool(S.get(classroom.FOLLOWS)) and not S.get(OWN)


def _explore() -> None:
    S[OWN] = True


def summary(key: str, budget: int | None = None, pols: dict | None = None) -> None:
    """A following student's sidebar: the lecturer's settings as text, and the way to explore
    on one's own (which draws the controls, set as the lecturer's are)."""
    lines = [f"- trace: {compute.trace_label(key)}"]
    if budget is not None:
        lines.append(f"- budget: {budget}")
    for which, (name, params, error) in (pols or {}).items():
        lines.append(f"- {which.upper()}: {config_label(name, params)}"
                     + (" (refused: see the page)" if error else ""))
    side = st.sidebar
    side.markdown(f"**The lecturer's settings** (class **{S[classroom.FOLLOWS]}**):\n"
                  + "\n".join(lines))
    side.button("Explore on my own", key="class.explore", on_click=_explore,
                icon=":material/explore:", width="stretch",
                help="Your own trace, policies, budget and view, starting from the "
                     "lecturer's; \"Back to the lecturer\" follows again.")


def _forget() -> None:
    """Stop following: the page leaves the class. During an unrevealed question it goes
    back one step, to the cache before the eviction asked about: the status line at the
    question's step would name the answer."""
    c = classroom.follows()
    r = c.current_round() if c is not None else None
    if r is not None and not r.revealed:
        S[classroom.LEFT] = (c.code, r.number)
        session.set_value("step", max(0, int(r.answer_step) - 1))
        with contextlib.suppress(Refused):  # a vote they cast on it after coming back is marked
            c.left(classroom.me(), r.number)
    if c is not None:  # its questions' answers stay hidden here (kvviz.app.ui.predict.hidden)
        S[classroom.KNOWN] = c.code
    S[classroom.FOLLOWS] = ""
    for k in KEYS:
        S.pop(k, None)


def _back() -> None:
    """Callback: the lecturer's current state, and follow again."""
    try:  # not follows(): a closed class is said by the page run, not forgotten here
        version, state = classroom.REGISTRY.get(S.get(classroom.FOLLOWS, "")).snapshot()
    except Refused:
        return
    S[OWN] = False
    if state:
        _apply(version, state)


def _open() -> None:
    try:
        classroom.open_class()
    except Refused as exc:  # the class store cannot be reached: said under the button
        S[OPEN_MSG] = str(exc)


OPEN_MSG = "class.open.msg"


TAKE_CODE, TAKE_KEY, TAKE_MSG = "class.take.code", "class.take.key", "class.take.msg"


def _take_back() -> None:
    """Callback: lead the class again, at the page it is on (the class's last published one)."""
    try:
        c = classroom.take_back(S.get(TAKE_CODE, ""), S.get(TAKE_KEY, ""))
    except Refused as exc:
        S[TAKE_MSG] = str(exc)
        return
    for k in (TAKE_CODE, TAKE_KEY):
        S.pop(k, None)
    version, state = c.snapshot()
    if state:
        _apply(version, state)


def _close() -> None:
    c = classroom.leads()
    if c is not None:
        classroom.REGISTRY.close(c.code, classroom.token())
    S[classroom.LEADS] = ""


def sync(where):
    """Start of a run, before any widget: a student's page takes the lecturer's state when
    it moved. Returns the slot for the banner (drawn by `publish`, at the end of the run,
    once it is known whether the student moved)."""
    msg = S.pop(classroom.REFUSED, None)  # session.init kept the link's refusal
    if msg:
        where.error(f"Follow: {msg}. This page works as a plain explorer.",
                    icon=":material/group_off:")
    slot = where.container(key="class-banner")
    code = S.get(classroom.FOLLOWS, "")
    if not code:
        return slot
    me = classroom.me()  # the student (their votes count once, whichever page)
    c = classroom.follows()
    if c is None and S.get(classroom.DOWN):  # not closed: the class store does not answer
        where.error(S.pop(classroom.DOWN), icon=":material/cloud_off:")
        return slot
    if c is None:
        where.warning(f"Class {code} has been closed (by its lecturer, or after a long idle "
                      "spell): this page is your own explorer now.",
                      icon=":material/group_off:")
        _forget()
        return slot
    c.here(me)  # counted on the lecturer's panel
    S[classroom.WAS_STUDENT] = True  # (kvviz.app.ui.lesson.student: never a speaker note)
    # read before drawing: a question that moves during the run is newer than this, and the
    # watcher runs the page again for it
    S[MARK] = _question_marker(c)
    if not S.get(OWN):
        version, state = c.snapshot()
        if version != S.get(APPLIED):
            if state:
                _apply(version, state)
            else:  # nothing published yet: seen, so the watcher does not rerun it
                S[APPLIED] = version
    return slot


def student_link(code: str) -> str:
    url = st.context.url or ""
    return f"{url.rstrip('/')}/?follow={code}"


def code_line(where=None) -> None:
    """Presentation mode (no sidebar): the open class's code and link, so a late student can
    still join from the projector, and the students counted now, recounted every COUNT_S
    without a move (a timer fragment). `where`: the compact row it goes in."""
    c = classroom.leads()
    if c is None:
        return
    with where if where is not None else contextlib.nullcontext():
        with session.timer_place():  # (why: kvviz.app.ui.session.timer_place)
            _code_line(c.code, student_link(c.code))


@st.fragment(run_every=COUNT_S)
def _code_line(code: str, link: str) -> None:
    try:
        n = classroom.REGISTRY.get(code).students()
    except Refused:  # closed: the page run says so
        return
    st.markdown(f"Class **{code}** `{link}` · **{n}** {'student' if n == 1 else 'students'}",
                width="content",
                help="Students open the link (or type the code); the count is of their pages "
                     f"heard from in the last {HERE_SECONDS:.0f} s, recounted every "
                     f"{COUNT_S:.0f} s.")


def panel() -> None:
    """The sidebar's Class panel: open a class, its code and the students' link, close it."""
    side = st.sidebar
    c = classroom.leads()
    if S.get(classroom.DOWN):
        side.error(S.pop(classroom.DOWN), icon=":material/cloud_off:")
    if c is None:
        if not S.get(classroom.FOLLOWS):  # a student's page opens no class of its own
            side.button("Open a class", key="class.open", on_click=_open,
                        icon=":material/groups:",
                        help="Students who open the link this gives follow this page: it "
                             "moves theirs as you move. The class is kept in this server's "
                             "class store (a file on the server, or Redis), shared by its "
                             "processes; it closes after 12 idle hours.")
            if S.get(OPEN_MSG):
                side.error(S.pop(OPEN_MSG))
            msg = S.pop(TAKE_MSG, None)
            with side.expander("Take back a class", expanded=bool(msg)):
                st.caption("Your tab was reloaded or closed: the class's code and the "
                           "lecturer key its page showed make this tab its lecturer.")
                st.text_input("class code", key=TAKE_CODE, max_chars=CODE_LEN)
                st.text_input("lecturer key", key=TAKE_KEY, type="password", max_chars=9)
                st.button("Take it back", key="class.take", on_click=_take_back)
                if msg:
                    st.error(msg)
        return
    link = student_link(c.code)
    side.markdown(
        f"**Class open.** Students open  \n`{link}`  \nor type the code:\n\n"
        f"<div style='font-size:2.2rem;font-weight:700;letter-spacing:.12em;"
        f"line-height:1.1'>{c.code}</div>", unsafe_allow_html=True,
        help="Their pages follow yours: trace, policies, parameters, view and step "
             "(presentation mode is each screen's own). Only this session moves the class.")
    with side, session.timer_place():  # (why: kvviz.app.ui.session.timer_place)
        _count(c.code)
    with side.expander("If this tab is reloaded or closed"):
        st.caption("A reload of this tab, or this page reconnecting to a restarted server, "
                   "leads the class again (this browser keeps the key). Another browser or a "
                   "new tab does not: keep this key off the projector; with the code, "
                   "**Take back a class** there leads it again.")
        k = S.get(classroom.KEY, "")
        st.markdown(f"lecturer key: `{k[:4]}-{k[4:]}`")
    side.button("Close the class", key="class.close", on_click=_close,
                icon=":material/close:")


def students_line(n: int) -> str:
    return f"**{n}** {'student' if n == 1 else 'students'} in the class now"


@st.fragment(run_every=COUNT_S)
def _count(code: str) -> None:
    """The lecturer's count of students' pages open (heard from in the last
    classroom.HERE_SECONDS), redrawn every COUNT_S: who has joined, before the class starts."""
    try:
        n = classroom.REGISTRY.get(code).students()
    except Refused:  # closed: the page run says so
        return
    st.caption(students_line(n), help="Students' pages heard from in the last "
               f"{HERE_SECONDS:.0f} s (the server hears each open page every "
               f"{watch.HEARD_S:.0f} s); a closed tab stops being counted.")


def publish(slot) -> None:
    """End of a run: the lecturer's page publishes its state; a student's page sees whether
    the student moved (their state is no longer the one the lecturer's gave), draws its
    banner in `slot` (from `sync`) and tells the process's watcher what it drew, so the
    lecturer's next move or question runs it again (kvviz.app.ui.watch)."""
    c = classroom.leads()
    sid = watch.session_id()
    if c is not None or S.get(classroom.FOLLOWS):
        _outlive()
    if c is not None:
        c.publish(classroom.token(), shared_query())
        WATCHER.track(sid, None)
        return
    code = S.get(classroom.FOLLOWS, "")
    if not code:
        WATCHER.track(sid, None)
        return
    if not S.get(OWN) and S.get(BASE):
        mine, base = shared_query(), S[BASE]
        if len(base) == 1:  # the run that applied it: what this page made of it
            base.append(mine)
        elif mine not in base:
            S[OWN] = True
            # this run drew the lecturer's settings in the sidebar: redraw it as the
            # student's own, so the sidebar and the banner say the same
            st.rerun()
    with slot:
        row = st.container(horizontal=True, vertical_alignment="center", gap="small")
        if S.get(OWN):
            row.info(f"Class **{code}**: you are exploring on your own; the lecturer's moves "
                     "do not reach this page.", icon=":material/explore:")
            row.button("Back to the lecturer", key="class.back", on_click=_back,
                       icon=":material/undo:")
        else:
            row.info(f"Following the lecturer of class **{code}**: this page moves as theirs "
                     "does.", icon=":material/groups:")
        row.button("Stop following", key="class.leave", on_click=_forget,
                   icon=":material/logout:")
    if sid is not None and APPLIED in S:  # (a run that reached the class in `sync`)
        WATCHER.track(sid, watch.Page(code, classroom.me(),
                                      None if S.get(OWN) else S[APPLIED],
                                      S.get(MARK, (0, False))))


def _outlive() -> None:
    """A page in a class: what brings it back after its server restarts (the timer, the
    cookies) and what it says while it is cut off."""
    st.html(_STYLE)
    with session.timer_place():  # (why: kvviz.app.ui.session.timer_place)
        _reconnect()
    classroom.remember()


@st.fragment(run_every=RECONNECT_S)
def _reconnect() -> None:
    """Nothing: a timer's presence is what the page's reconnection looks for (RECONNECT_S)."""
