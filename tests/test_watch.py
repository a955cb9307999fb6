"""The class watcher (kvviz.app.ui.watch): which students' pages the server runs again, when.

A fake class and a fake Streamlit (its rerun and its list of connected sessions) stand in,
and the clock is the test's: each rule is checked on one `tick`.
"""
from kvviz.app.teach.classroom import Refused
from kvviz.app.ui.watch import RETRY_S, Page, Watcher


class FakeClass:
    def __init__(self):
        self.version, self.round_version, self.marker = 1, 0, (0, False)
        self.heard = []

    def poll(self):
        return self.version, self.round_version

    def here(self, token):
        self.heard.append(token)


class FakeRegistry:
    def __init__(self, **classes):
        self.classes = classes

    def get(self, code):
        if code not in self.classes:
            raise Refused(f"class code {code!r} is not open on this server")
        return self.classes[code]


class World:
    """The watcher with a clock, a class ABC, and sessions that are connected until closed."""

    def __init__(self):
        self.now = 100.0
        self.c = FakeClass()
        self.reg = FakeRegistry(ABC=self.c)
        self.asked, self.closed = [], set()
        self.w = Watcher(self.reg, self.rerun, lambda sid: sid not in self.closed,
                         lambda c: c.marker, clock=lambda: self.now)

    def rerun(self, sid):
        self.asked.append(sid)
        return sid not in self.closed

    def tick(self, dt=0.2):
        self.now += dt
        self.asked.clear()
        self.w.tick()
        return sorted(self.asked)


def test_a_move_reruns_the_followers_and_not_the_students_exploring_alone():
    W = World()
    W.w.track("s1", Page("ABC", "t1", version=1, marker=(0, False)))
    W.w.track("s2", Page("ABC", "t2", version=None, marker=(0, False)))  # on their own
    assert W.tick() == []  # nothing moved
    W.c.version = 2
    assert W.tick() == ["s1"]
    assert W.tick() == []  # asked once: not again while its run is under way
    W.w.track("s1", Page("ABC", "t1", version=2, marker=(0, False)))  # its run drew version 2
    assert W.tick() == []


def test_a_question_reruns_every_page_of_the_class_and_a_vote_none():
    W = World()
    W.w.track("s1", Page("ABC", "t1", version=1, marker=(0, False)))
    W.w.track("s2", Page("ABC", "t2", version=None, marker=(0, False)))
    W.c.round_version += 1  # a vote: the question's marker is unchanged
    assert W.tick() == []
    W.c.marker = (1, False)  # a question opened
    assert W.tick() == ["s1", "s2"]
    W.w.track("s1", Page("ABC", "t1", version=1, marker=(1, False)))
    W.w.track("s2", Page("ABC", "t2", version=None, marker=(1, False)))
    W.c.marker = (1, True)  # revealed
    assert W.tick() == ["s1", "s2"]


def test_a_page_that_did_not_draw_the_move_is_asked_again_after_the_retry_wait():
    W = World()
    W.w.track("s1", Page("ABC", "t1", version=1, marker=(0, False)))
    W.c.version = 2
    assert W.tick() == ["s1"]
    assert W.tick(RETRY_S / 2) == []
    assert W.tick(RETRY_S / 2 + 0.01) == ["s1"]


def test_a_closed_class_reruns_its_pages_once_and_forgets_them():
    W = World()
    W.w.track("s1", Page("ABC", "t1", version=1, marker=(0, False)))
    del W.reg.classes["ABC"]
    assert W.tick() == ["s1"]
    W.w.track("s1", None)  # its run found the class closed and left
    assert W.tick() == [] and W.w.pages == {}


def test_open_pages_are_heard_and_a_closed_tab_is_dropped():
    W = World()
    W.w.track("s1", Page("ABC", "t1", version=1, marker=(0, False)))
    W.w.track("s2", Page("ABC", "t2", version=1, marker=(0, False)))
    W.tick(W.w.heard_s)
    assert sorted(W.c.heard) == ["t1", "t2"]
    W.closed.add("s2")
    W.c.heard.clear()
    W.tick(W.w.heard_s)
    assert W.c.heard == ["t1"] and set(W.w.pages) == {"s1"}
    W.c.heard.clear()
    W.tick(0.2)  # between two hearings nobody is written
    assert W.c.heard == []


def test_a_rerun_refused_for_a_gone_session_drops_it():
    W = World()
    W.w.track("s1", Page("ABC", "t1", version=1, marker=(0, False)))
    W.closed.add("s1")
    W.c.version = 2
    assert W.tick() == ["s1"]
    assert W.w.pages == {}


def test_the_thread_ends_when_nobody_is_watched():
    W = World()
    assert W.w.tick() is False
    W.w.track("s1", Page("ABC", "t1", version=1, marker=(0, False)))  # starts the thread
    thread = W.w._thread
    assert thread is not None and thread.is_alive()
    W.w.track("s1", None)
    thread.join(timeout=5)
    assert not thread.is_alive() and W.w._thread is None
