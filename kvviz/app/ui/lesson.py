"""The lesson bar: the lesson's title, "Scene 3 of 13: title", previous/next scene
(PageUp/PageDown, what presenter clickers send), the scene's short link and the speaker
note; and the lesson picker in the sidebar.

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
    if name:
        go(name, max(n, 1))


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


def bar(draw_picker: bool = True) -> None:
    """The lesson bar (when the page has a lesson), then the sidebar picker (not drawn in
    presentation mode, which has no sidebar)."""
    err = S.pop(ERROR, None)
    if err:
        st.error(f"Lesson: {err}", icon=":material/error:")
    name = str(S["kv"].get("lesson", ""))
    if name:
        _bar(name, said=bool(err))
    if draw_picker:
        picker()


def _bar(name: str, said: bool = False) -> None:
    """The bar; `said`: this run already showed the lesson's error, which is not repeated."""
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
    with st.container(border=True, key="lesson-bar"):
        head = f"**{les.title}** ({les.minutes:g} min)"
        if n:
            s = les.scene(n)
            head += f" · **Scene {n} of {total}: {s.title}** · {s.minutes:g} min"
        st.markdown(head)
        # the buttons on a row of their own: beside the title they were cut at 1024 px
        c = st.columns([2, 2, 3], vertical_alignment="center", gap="small")
        c[0].button("previous scene", key="lesson.prev", on_click=go, args=(name, n - 1),
                    disabled=n <= 1, icon=":material/skip_previous:", width="stretch",
                    help="previous scene (key PageUp)", shortcut="PageUp")
        c[1].button("next scene", key="lesson.next", on_click=go, args=(name, n + 1),
                    disabled=n >= total, icon=":material/skip_next:", width="stretch",
                    help="next scene (key PageDown)", shortcut="PageDown")
        if n:
            c[2].markdown(f"link `{L.link(name, n)}`")
        if n and classroom.follows() is None:  # the lecturer's, not a following student's
            present = bool(int(S["kv"].get("present", 0) or 0))
            with st.expander("Speaker note", expanded=not present):
                try:
                    st.markdown(note(les, n).replace("\n", "  \n"))
                except ValueError as exc:
                    st.error(f"Lesson: {exc}")
