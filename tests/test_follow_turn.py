"""A class's students take turns drawing their pages (kvviz.app.ui.follow.turn): never two at
once, never a wait past TURN_WAIT_S, and no turn for a page that is not following."""
import threading
import time

import pytest

from kvviz.app.teach.classroom import Registry
from kvviz.app.ui import follow


@pytest.fixture
def klass(monkeypatch):
    reg = Registry()
    c = reg.open("lect")
    state = {follow.classroom.FOLLOWS: c.code}
    monkeypatch.setattr(follow, "S", state)
    monkeypatch.setattr(follow.classroom, "REGISTRY", reg)
    return c, state


def _pages(n, hold_s):
    """n page runs entering turn() at once; returns (start, end) of each one's drawing."""
    spans, go = [], threading.Barrier(n)

    def page():
        go.wait()
        with follow.turn():
            t0 = time.perf_counter()
            time.sleep(hold_s)
            spans.append((t0, time.perf_counter()))

    threads = [threading.Thread(target=page) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return sorted(spans)


def test_followers_draw_one_at_a_time(klass):
    spans = _pages(6, 0.05)
    assert len(spans) == 6
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert not klass[0].turn.locked()  # every turn given back


def test_a_turn_is_given_back_when_the_run_stops_early(klass):
    class Stop(Exception):  # st.stop() / a rerun interrupt the page run with an exception
        pass

    with pytest.raises(Stop):
        with follow.turn():
            raise Stop
    assert not klass[0].turn.locked()


def test_a_page_waits_no_longer_than_turn_wait(klass, monkeypatch):
    monkeypatch.setattr(follow, "TURN_WAIT_S", 0.2)
    klass[0].turn.acquire()  # a turn never given back
    t0 = time.perf_counter()
    with follow.turn():
        waited = time.perf_counter() - t0
    assert 0.15 <= waited < 2
    assert klass[0].turn.locked()  # still the other's: this page did not take or free it
    klass[0].turn.release()


@pytest.mark.parametrize("who", ["exploring on their own", "in no class", "in a closed class"])
def test_no_turn_outside_following(klass, who):
    c, state = klass
    if who == "exploring on their own":
        state[follow.OWN] = True
    elif who == "in no class":
        state[follow.classroom.FOLLOWS] = ""
    else:
        follow.classroom.REGISTRY.close(c.code, "lect")
    spans = _pages(3, 0.1)
    assert len(spans) == 3
    assert spans[0][1] > spans[-1][0]  # they overlap: nobody waited
    assert not c.turn.locked()


def test_a_closed_class_is_left_for_the_page_to_say(klass):
    """turn() forgets nothing: the page run (follow.sync) says the class closed."""
    c, state = klass
    follow.classroom.REGISTRY.close(c.code, "lect")
    with follow.turn():
        pass
    assert state[follow.classroom.FOLLOWS] == c.code
