"""The lesson bar: the lesson's title, "Scene 3 of 13: title", previous/next scene
(keys N and B: PageUp/PageDown scroll the page), the scene's short link; the speaker note
in the sidebar (a popover in presentation mode); and the lesson picker in the sidebar. A
class's students get the title line only: no scene buttons, keys or notes.

The page's state holds `lesson` (a file stem in lessons/) and `scene` (1-based). A short
link, `?lesson=NAME&scene=N` with no other state, applies the scene's saved state on the
session's first run; a full link (the address bar once the page has drawn) keeps its own
state, so a reload does not jump back to the scene's start. Lessons and notes come from
kvviz.app.teach.lesson (validated, placeholders computed from the library).
"""
from __future__ import annotations

import streamlit as st

from kvviz.app.state import from_query
from kvviz.app.teach import lesson as L
from kvviz.app.ui import classroom, compute, session
from kvviz.app.ui.session import S

ERROR = "lesson.error"  # a lesson that could not be opened, said once
# link keys a short link may carry beside lesson and scene (not the page's state)
SHORT = {"lesson", "scene", "present", "follow", "embed", "embed_options"}


@st.cache_resource(max_entries=8, show_spinner=False)
def _load(path: str, mtime: float) -> L.Lesson:
    return L.load(path)


def load(name: str) -> L.Lesson:
    """The lesson named `name`, validated (once per file version, server-wide)."""
    path = L.path_of(name)
    return _load(str(path), path.stat().st_mtime)


@st.cache_resource(max_entries=64, show_spinner="Computing the speaker note…")
def _note(path: str, mtime: float, n: int) -> str:
    return L.note_text(_load(path, mtime), n)


def note(les: L.Lesson, n: int) -> str:
    return _note(str(les.path), les.path.stat().st_mtime, int(n))


def _forget_view_keys() -> None:
    """Widget keys the loop, slides and needle views keep of their own: left over, they would
    win over the scene's state (slides.src would reset the scene's slides to the trace's
    defaults)."""
    for k in [k for k in S if isinstance(k, str) and (k in ("loop.source", "slides.src") or (
            k.startswith("needle.") and not k.startswith(("needle.job", "needle.new.",
                                                          "needle.mine")))) ]:
        S.pop(k, None)


def go(name: str, n: int) -> None:
    """Apply scene n of lesson `name` (a callback, or before the widgets are drawn). A lesson
    that cannot be opened is kept as the page's error, and the page stays as it is."""
    try:
        scene = load(name).scene(n)
    except ValueError as exc:
        S[ERROR] = str(exc)
        return
    vs, _ = from_query({**scene.query, "lesson": name, "scene": str(int(n))})
    vs.present = int(S["kv"].get("present", 0) or 0)  # the lecturer's choice, not the scene's
    _forget_view_keys()
    session.apply_state(vs)


def init() -> None:
    """First run of a session: a short link applies its scene's state."""
    keys = S.get(session.FROM_LINK)
    if not keys or "lesson" not in keys or not set(keys) <= SHORT:
        return
    name, n = str(S["kv"].get("lesson", "")), int(S["kv"].get("scene", 0) or 0)
    if name:  # a scene the link names, even 0, is checked (an error naming it); none: scene 1
        go(name, n if "scene" in keys else 1)


def _picked() -> None:
    name = S.get("lesson", "")
    if name:
        go(name, 1)
    else:  # the bar is drawn before the picker: say it now
        S["kv"]["lesson"], S["kv"]["scene"] = "", 0
        S.pop("scene", None)


def picker() -> None:
    """The sidebar's lesson chooser: every lesson in lessons/, and "no lesson"."""
    options = [""] + L.names(compute.listing(L.lessons_folder(), "*.toml"))
    st.sidebar.header("Lesson")
    session.widget(st.sidebar.selectbox, "lesson", "lesson", options,
                   fit=lambda v: v if v in options else "", on_change=_picked,
                   format_func=lambda v: v or "no lesson", label_visibility="collapsed",
                   help="A lesson is a playlist of saved views with a speaker note each "
                        "(lessons/*.toml; see docs/teaching.md). Choosing one opens scene 1.")


NEXT_KEY, PREV_KEY = "N", "B"  # PageDown/PageUp scroll the page (a student's, a lecturer's)


def student() -> bool:
    """This session is, or was, a class's student: it never sees a speaker note (the notes
    name the answers of the questions the class is asked), nor scene buttons or keys; nor
    does a page in a browser that has been one, unless it leads a class (its own link without
    `follow=` opens no note: kvviz.app.ui.classroom.was_student)."""
    return classroom.was_student()


def bar(draw_picker: bool = True, row=None) -> None:
    """The lesson bar (when the page has a lesson), then the sidebar picker (not drawn in
    presentation mode, which has no sidebar). `row`: presentation mode's compact row, where
    the scene's line, its buttons and the note (a popover) go."""
    err = S.pop(ERROR, None)
    if err:
        st.error(f"Lesson: {err}", icon=":material/error:")
    name = str(S["kv"].get("lesson", ""))
    if name:
        _bar(name, row, said=bool(err))
    if draw_picker:
        picker()


def _question_up() -> bool:
    from kvviz.app.ui import predict  # (predict draws views; imported when a note is drawn)

    return predict.active() or predict.hidden() is not None


def _speaker_note(les: L.Lesson, n: int, where, room: bool) -> None:
    """The speaker note: in the sidebar beside the chart (the explorer), or a popover in
    presentation mode's row: never above the chart. While the class's question is up it is
    collapsed and says nothing (its text names the answers)."""
    up = _question_up()
    box = (where.popover("Speaker note", icon=":material/description:") if room else
           where.expander("Speaker note", expanded=not up, icon=":material/description:"))
    with box:
        if up:
            st.caption("Hidden while the class's question is up: the note may name its "
                       "answer. It is back once the question is closed.")
            return
        try:
            st.markdown(note(les, n).replace("\n", "  \n"))
        except ValueError as exc:
            st.error(f"Lesson: {exc}")


def _bar(name: str, row=None, said: bool = False) -> None:
    """The bar (`row`: presentation mode's compact row); `said`: this run already showed the
    lesson's error, which is not repeated."""
    try:
        les = load(name)
    except ValueError as exc:
        if not said:
            st.error(f"Lesson: {exc}. The page works on without it.", icon=":material/error:")
        return
    total = len(les.scenes)
    n = int(S["kv"].get("scene", 0) or 0)
    if not 1 <= n <= total:
        if not said:
            st.error(f"Lesson: scene {n} is not a scene of {les.path.name} (scenes 1–{total}); "
                     "press next scene for scene 1.", icon=":material/error:")
        n = 0
    pupil = student()
    if n:
        s = les.scene(n)
    if row is not None:  # presentation mode: a few items of the one compact row
        if not pupil:
            row.button("«", key="lesson.prev", on_click=go, args=(name, n - 1),
                       disabled=n <= 1, shortcut=PREV_KEY, help=f"previous scene (key {PREV_KEY})")
        row.markdown(f"**Scene {n}/{total}**: {s.title}" if n else f"**{les.title}**",
                     width="content")
        if not pupil:
            row.button("»", key="lesson.next", on_click=go, args=(name, n + 1),
                       disabled=n >= total, shortcut=NEXT_KEY, help=f"next scene (key {NEXT_KEY})")
            if n:
                _speaker_note(les, n, row, room=True)
        return
    # one wrapping line, no frame: the chart stays on the first screen at 1024x768
    line = st.container(horizontal=True, wrap=True, vertical_alignment="center", gap="small",
                        key="lesson-bar")
    head = f"**{les.title}** ({les.minutes:g} min)"
    if n:
        head += f" · **Scene {n} of {total}: {s.title}** · {s.minutes:g} min"
    line.markdown(head, width="content")
    if pupil:  # a student's page: the lecturer moves the scenes
        return
    line.button("previous scene", key="lesson.prev", on_click=go, args=(name, n - 1),
                disabled=n <= 1, width="content", help=f"previous scene (key {PREV_KEY})",
                shortcut=PREV_KEY)
    line.button("next scene", key="lesson.next", on_click=go, args=(name, n + 1),
                disabled=n >= total, width="content", help=f"next scene (key {NEXT_KEY})",
                shortcut=NEXT_KEY)
    if n:  # beside the chart, not above it, with the scene's short link
        st.sidebar.markdown(f"link `{L.link(name, n)}`")
        _speaker_note(les, n, st.sidebar, room=False)
