"""A class's moves reach its students' pages from the server: no student's page polls.

Every run of a student's page says what it drew (`track`: the class, the lecturer's version
it applied, the question it showed). One thread per server process, started with the first
student, reads each watched class from the class store every WATCH_S seconds (one read per
class, however many students) and, when the class moved past what a page drew, asks that
page to run again: Streamlit's server-side rerun (`AppSession.request_rerun`, the one a saved
source file triggers). A page that follows the lecturer reruns on the lecturer's moves and
on its question (a new one, the reveal, the close); a student exploring on their own only
on the question. A vote alone reruns nobody (the lecturer's histogram polls on its own).

The same thread says which pages are still open (`Class.here`, every HEARD_S), so the
lecturer's count is of connected pages; a closed tab's session leaves Streamlit's list of
active sessions and stops being counted. Many pages rerunning at once take turns in the
page (kvviz.app.ui.follow.turn).

This is the one place the app reaches into Streamlit's runtime (`Runtime.get_app_session`):
Streamlit has no public call to rerun another session.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

WATCH_S = 0.2   # how often the process reads its watched classes
HEARD_S = 2.0   # how often it says its pages are open (classroom.HERE_SECONDS counts them)
RETRY_S = 5.0   # a page asked to rerun that has not drawn the new state by then is asked again


@dataclass
class Page:
    """What one session's page last drew, as its run reported it."""
    code: str
    token: str
    version: int | None   # the lecturer's version it applied; None: exploring on its own
    marker: tuple         # its question's (number, revealed); (0, False): none
    asked: float = 0.0    # when the watcher last asked it to rerun (0: not since it drew)


class Watcher:
    """The process's watched pages (session id -> Page) and the thread that moves them.

    `registry` is the class registry (kvviz.app.teach.classroom.Registry or anything with its
    `get`); `rerun(session_id) -> bool` asks a page to run again (False: the session is gone);
    `alive(session_id) -> bool` says whether it is still connected. Both are Streamlit's in
    the page (`streamlit_rerun`, `streamlit_alive`); tests give their own."""

    def __init__(self, registry, rerun, alive, marker, *, watch_s: float = WATCH_S,
                 heard_s: float = HEARD_S, clock=time.monotonic):
        self.registry, self._rerun, self._alive, self._marker = registry, rerun, alive, marker
        self.watch_s, self.heard_s, self.clock = watch_s, heard_s, clock
        self.pages: dict[str, Page] = {}
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._heard = 0.0
        self.reruns = 0  # asked so far (for tests and the load test's figures)

    # --- the pages' side --------------------------------------------------------------------
    def track(self, session_id: str, page: Page | None) -> None:
        """A page's run ends: what it drew (None: it is in no class now)."""
        with self.lock:
            if page is None:
                self.pages.pop(session_id, None)
                return
            self.pages[session_id] = page
        self._start()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="kvviz-class-watch",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.watch_s)
            try:
                if not self.tick():
                    return  # nobody to watch: the next page's run starts it again
            except Exception:  # noqa: BLE001 (a store hiccup must not stop the class)
                time.sleep(1.0)

    # --- one pass ---------------------------------------------------------------------------
    def tick(self) -> bool:
        """Read each watched class once, ask the pages behind it to rerun, say who is here.
        False when no page is watched (the thread ends)."""
        from kvviz.app.teach.classroom import Refused

        now = self.clock()
        with self.lock:
            pages = dict(self.pages)
        if not pages:
            with self.lock:
                if not self.pages:
                    self._thread = None
                    return False
            return True
        heard = now - self._heard >= self.heard_s
        if heard:
            self._heard = now
        for code in {p.code for p in pages.values()}:
            mine = {sid: p for sid, p in pages.items() if p.code == code}
            try:
                c = self.registry.get(code)
            except Refused:  # closed: each page's run says so and leaves
                c = None
            if c is None:
                due = list(mine)
            else:
                version, _ = c.poll()
                marker = self._marker(c)
                due = [sid for sid, p in mine.items()
                       if (p.version is not None and p.version != version)
                       or p.marker != marker]
            for sid in due:
                p = mine[sid]
                if p.asked and now - p.asked < RETRY_S:
                    continue
                p.asked = now
                self.reruns += 1
                if not self._rerun(sid):
                    self.track(sid, None)
            if heard and c is not None:
                for sid, p in mine.items():
                    if self._alive(sid):
                        c.here(p.token)
                    else:
                        self.track(sid, None)
        return True


def streamlit_rerun(session_id: str) -> bool:
    """Ask session `session_id`'s page to run again, as a saved source file would."""
    from streamlit.runtime import Runtime

    if not Runtime.exists():
        return False
    session = Runtime.instance().get_app_session(session_id)
    if session is None:
        return False
    session.request_rerun(None)  # None: the session's own widget values, a whole-page run
    return True


def streamlit_alive(session_id: str) -> bool:
    from streamlit.runtime import Runtime

    return Runtime.exists() and Runtime.instance().is_active_session(session_id)


def session_id() -> str | None:
    """This run's session id (None outside a Streamlit run)."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return None if ctx is None else ctx.session_id
