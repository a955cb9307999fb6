"""The class registry (kvviz.app.teach.classroom) and the question (kvviz.app.teach.question)."""
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvviz.app.teach import classroom as cr
from kvviz.app.teach.question import next_eviction
from kvviz.core.policies import make_policy
from kvviz.core.replay import NEVER, Replay
from kvviz.core.trace import ArrayTrace, pack_rows


def test_codes_are_distinct_and_only_reach_their_own_class():
    reg = cr.Registry()
    a, b = reg.open("ta"), reg.open("tb")
    assert a.code != b.code and len(a.code) == cr.CODE_LEN
    assert set(a.code) <= set(cr.ALPHABET)
    a.publish("ta", {"step": "5"})
    assert reg.get(b.code).snapshot() == (0, {})
    assert reg.get(a.code.lower()).snapshot() == (1, {"step": "5"})  # typed in lower case
    with pytest.raises(cr.Refused, match="'NOPE00' is not open"):
        reg.get("nope00")


def test_only_the_lecturer_moves_asks_and_reveals():
    c = cr.Registry().open("lect")
    for call in (lambda: c.publish("stud", {"step": "1"}),
                 lambda: c.ask("stud", step=1, who="a", label="A", held=[1, 2], answer=[1],
                               answer_step=1),
                 lambda: c.reveal("stud")):
        with pytest.raises(cr.Refused, match="only the lecturer"):
            call()
    assert c.snapshot() == (0, {})


def test_version_moves_only_on_change():
    c = cr.Registry().open("l")
    assert c.publish("l", {"step": 3}) == 1
    assert c.publish("l", {"step": "3"}) == 1  # same state, as text
    assert c.publish("l", {"step": 4}) == 2


def test_every_vote_refusal():
    c = cr.Registry().open("l")
    with pytest.raises(cr.Refused, match="no question is open"):
        c.vote("s1", 1, 3)
    r = c.ask("l", step=7, who="a", label="TOVA", held=[0, 3, 5], answer=[5], answer_step=8)
    with pytest.raises(cr.Refused, match="position 4 is not held by TOVA at step 7"):
        c.vote("s1", r.number, 4)
    with pytest.raises(cr.Refused, match="not a position number"):
        c.vote("s1", r.number, "five")
    c.vote("s1", r.number, 5)
    with pytest.raises(cr.Refused, match="already voted .position 5."):
        c.vote("s1", r.number, 3)
    c.vote("s2", r.number, 3)
    with pytest.raises(cr.Refused, match="no question is open"):
        c.vote("s3", r.number - 1, 3)  # a stale round's number
    c.reveal("l")
    with pytest.raises(cr.Refused, match="revealed"):
        c.vote("s3", r.number, 3)
    r = c.current_round()
    assert r.tally() == {5: 1, 3: 1} and r.right == 1 and r.share_right == 0.5
    # votes and rounds move the question panels, never the followers' pages
    assert c.poll() == (0, 4)  # ask, two votes, reveal


def test_answer_must_be_held():
    c = cr.Registry().open("l")
    with pytest.raises(cr.Refused, match="held positions"):
        c.ask("l", step=1, who="a", label="A", held=[1, 2], answer=[3], answer_step=1)


def test_concurrent_votes_are_all_counted_once():
    c = cr.Registry().open("l")
    r = c.ask("l", step=1, who="b", label="B", held=range(10), answer=[2], answer_step=1)
    def go(i):
        for _ in range(3):  # every student presses three times: one vote counts
            try:
                c.vote(f"s{i}", r.number, i % 10)
            except cr.Refused:
                pass
    ts = [threading.Thread(target=go, args=(i,)) for i in range(60)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    r = c.current_round()
    assert len(r.votes) == 60 and sum(r.tally().values()) == 60 and r.right == 6


def test_idle_and_overflow_classes_are_closed(monkeypatch):
    reg = cr.Registry()
    monkeypatch.setattr(cr, "MAX_CLASSES", 3)
    first = reg.open("t0")
    for i in range(1, 5):
        reg.open(f"t{i}")
    assert len(reg) == 3
    with pytest.raises(cr.Refused):
        reg.get(first.code)


def _ref_question(ev, step):
    """Brute force: walk the steps, rebuild the held set by the held rule."""
    T = len(ev)
    for s in range(step, T):
        victims = [p for p in range(T) if ev[p] == s]
        if victims:
            held = [p for p in range(T) if p <= s and (ev[p] == NEVER or ev[p] >= s)]
            return s, held, victims
    return None


@settings(max_examples=40, deadline=None)
@given(T=hs.integers(4, 40), budget=hs.integers(1, 8), seed=hs.integers(0, 10**6),
       name=hs.sampled_from(["tova", "h2o", "snapkv", "streaming-llm"]),
       step=hs.integers(0, 40))
def test_question_matches_brute_force_on_real_replays(T, budget, seed, name, step):
    rng = np.random.default_rng(seed)
    att = np.tril(rng.random((T, T)))
    att /= att.sum(1, keepdims=True)
    trace = ArrayTrace(pack_rows(att.astype(np.float32)), T)
    params = {"sinks": 1, "window": 1} if name == "streaming-llm" else {}
    try:
        pol = make_policy(name, budget=budget, **params)
    except ValueError:
        return
    ev = Replay(trace, pol).run().evicted_at
    step = min(step, T - 1)
    q, ref = next_eviction(ev, step), _ref_question(list(ev), step)
    if ref is None:
        assert q is None
        return
    assert (q.answer_step, list(q.held), list(q.answer)) == ref
    assert set(q.answer) <= set(q.held) and len(q.held) == budget + len(q.answer)


def test_a_page_counts_a_copy_of_the_votes():
    """Votes arrive from other sessions' threads while a page draws: it counts a copy."""
    c = cr.Registry().open("l")
    assert c.current_round() is None
    r = c.ask("l", step=9, who="a", label="tova", held=[0, 3, 5], answer=[5], answer_step=9)
    c.vote("s1", r.number, 3)
    snap = c.current_round()
    c.vote("s2", r.number, 5)
    assert snap.votes == {cr.digest("s1"): 3} and snap.mine("s1") == 3 and snap.tally() == {3: 1}
    assert len(c.round.votes) == 2
    assert (snap.number, snap.held, snap.answer) == (r.number, r.held, r.answer)


def test_students_are_counted_once_while_their_pages_are_heard_from():
    c = cr.Registry().open("lect")
    assert c.students() == 0
    c.here("lect", now=100.0)  # the lecturer is not a student
    for t in ("s1", "s2", "s1"):
        c.here(t, now=100.0)
    assert c.students(now=101.0) == 2
    c.here("s2", now=103.0)
    assert c.students(within=5, now=105.5) == 1  # s1 last heard 5.5 s ago: its tab closed
    c.here("s1", now=106.0)  # ... or it came back
    assert c.students(within=5, now=106.0) == 2
    assert c.students(within=5, now=200.0) == 0


def test_the_lecturer_key_takes_the_class_back_and_nothing_else_does():
    reg = cr.Registry()
    c = reg.open("old")
    assert len(c.key) == 8 and set(c.key) <= set(cr.ALPHABET) and c.key != c.code
    assert reg.open("x").key != c.key
    for wrong in ("", c.code, c.key[:7], c.key[::-1] if c.key[::-1] != c.key else "AAAAAAAA"):
        with pytest.raises(cr.Refused, match=f"not class {c.code}'s lecturer key"):
            c.take_back(wrong, "new")
    assert c.led_by("old") and not c.led_by("new")
    c.here("new")  # the new tab had joined as a student first
    c.take_back(f"{c.key[:4]}-{c.key[4:]}".lower(), "new")  # as read off the page
    assert c.led_by("new") and not c.led_by("old") and c.students() == 0
    c.publish("new", {"step": "3"})
    with pytest.raises(cr.Refused, match="only the lecturer's session"):
        c.publish("old", {"step": "4"})
