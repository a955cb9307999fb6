"""Follow the lecturer under AppTest: several AppTest sessions in one process
share the page's class registry (kvviz.app.ui.classroom.REGISTRY, a module global), as the
sessions of one server do. Every AppTest has the same session id, so a session is told
apart by its member token in session state, as the page does."""
import re

import numpy as np
import pytest
from apphelp import REPO, app, ok, refused_port, softmax_rows, traces_dir

from kvviz.app.teach.classroom import Refused
from kvviz.app.ui.classroom import REGISTRY
from kvviz.core.trace import save_trace

CODE = re.compile(r"follow=([A-Z2-9]{6})")  # what the load-test helper looks for


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    save_trace(d / "small.npz", softmax_rows(np.random.default_rng(5), 160, 1),
               meta={"name": "small"})
    with traces_dir(d):
        yield d


def qp(at) -> dict:
    return {k: at.query_params[k][0] if isinstance(at.query_params[k], list)
            else at.query_params[k] for k in at.query_params}


def text(at, kind="markdown") -> str:
    return "\n".join(str(e.value) for e in getattr(at, kind))


def banner(at) -> str:
    """The follow banner (other info boxes are the views')."""
    return "\n".join(e.value for e in at.info if "lecturer" in e.value)


def step(at) -> int:
    return int(at.slider(key="w.step").value)


def shown_step(at) -> int:
    """The step the status line reports (what the student reads), not the widget's value."""
    return int(re.search(r"evicted at step (\d+)", text(at)).group(1))


def open_class(at):
    at.button(key="class.open").click().run()
    ok(at)
    codes = CODE.findall(text(at.sidebar))
    assert len(set(codes)) == 1, text(at.sidebar)
    return codes[0]


def lecturer(traces):
    """A lecturer who chose a trace, policies, a parameter, a view and a step, then opened
    a class: what a follower must see."""
    at = app(trace="file:small.npz")
    ok(at)
    at.selectbox(key="w.b").set_value("h2o").run()
    at.selectbox(key="w.a").set_value("snapkv").run()
    at.slider(key="w.pa.pool_kernel").set_value(9).run()
    at.segmented_control(key="w.view").set_value("scores").run()
    at.slider(key="w.step").set_value(77).run()
    ok(at)
    return at, open_class(at)


def shared(at) -> dict:
    return {k: v for k, v in qp(at).items() if k not in ("follow", "lead", "present")}


def test_a_follower_sees_the_lecturers_page_and_moves_with_it(traces, apptest):
    lect, code = lecturer(traces)
    assert "class.token" in lect.session_state
    version, state = REGISTRY.get(code).snapshot()
    assert state == shared(lect) and state["a.poolKernel"] == "9"
    stu = app(follow=code)
    ok(stu)
    assert not stu.error
    # the student is their browser's identity (class.me), never the lecturer's token
    assert stu.session_state["class.me"] != lect.session_state["class.token"]
    # while following, the sidebar says the lecturer's settings (no controls drawn)
    kv = stu.session_state["kv"]
    assert (kv["trace"], kv["a"], kv["b"], kv["w.pa.pool_kernel"]) == (
        "file:small.npz", "snapkv", "h2o", 9)
    said = text(stu.sidebar)
    assert f"**The lecturer's settings** (class **{code}**)" in said
    assert "- trace: traces/small.npz" in said and f"- budget: {qp(lect)['budget']}" in said
    assert "- A: snapkv (poolKernel=9)" in said and "- B: h2o" in said, said
    assert not stu.sidebar.selectbox and not stu.sidebar.slider
    assert stu.segmented_control(key="w.view").value == "scores"
    assert step(stu) == 77 and shown_step(stu) == 77
    assert shared(stu) == shared(lect)
    assert qp(stu)["follow"] == code  # a reload keeps following
    assert f"Following the lecturer of class **{code}**" in banner(stu)
    # the lecturer moves: step, view, a parameter; the follower's next run shows them
    lect.button(key="nav.next").click().run()
    lect.segmented_control(key="w.view").set_value("cache").run()
    lect.slider(key="w.pa.obs_window").set_value(4).run()
    ok(lect)
    assert REGISTRY.get(code).snapshot()[0] > version
    stu.run()
    ok(stu)
    assert step(stu) == shown_step(stu) == 78
    assert stu.segmented_control(key="w.view").value == "cache"
    assert stu.session_state["kv"]["w.pa.obs_window"] == 4
    assert "obsWindow=4" in text(stu.sidebar)
    assert shared(stu) == shared(lect)


def test_a_follower_explores_then_goes_back(traces, apptest):
    lect, code = lecturer(traces)
    stu = app(follow=code)
    stu.button(key="nav.prev").click().run()  # the student moves on their own
    ok(stu)
    assert step(stu) == 76 and "exploring on your own" in banner(stu)
    # the sidebar agrees with the banner: the student's own controls, no "Explore on my own"
    assert "The lecturer's settings" not in text(stu.sidebar)
    assert not [b for b in stu.button if b.key == "class.explore"] and stu.sidebar.selectbox
    lect.button(key="nav.next").click().run()
    lect.segmented_control(key="w.view").set_value("divergence").run()
    stu.run()
    assert step(stu) == 76 and stu.segmented_control(key="w.view").value == "scores"
    assert "exploring on your own" in banner(stu)
    stu.button(key="class.back").click().run()  # the lecturer's state now, and follow again
    ok(stu)
    assert step(stu) == shown_step(stu) == 78
    assert stu.segmented_control(key="w.view").value == "divergence"
    assert "Following the lecturer" in banner(stu) and shared(stu) == shared(lect)
    lect.button(key="nav.next").click().run()
    stu.run()
    assert step(stu) == 79


def test_a_follower_leaves_and_returns(traces, apptest):
    lect, code = lecturer(traces)
    stu = app(follow=code)
    stu.button(key="class.leave").click().run()
    ok(stu)
    assert not banner(stu) and "follow" not in qp(stu)
    assert step(stu) == 77  # the page keeps what it showed
    lect.button(key="nav.next").click().run()
    stu.run()
    assert step(stu) == 77  # no longer moved
    again = app(follow=code)  # the link again, in a new session
    ok(again)
    assert step(again) == 78 and shared(again) == shared(lect)
    assert "Following the lecturer" in banner(again)


def test_a_follower_cannot_move_the_class(traces, apptest):
    lect, code = lecturer(traces)
    stu = app(follow=code)
    c = REGISTRY.get(code)
    before = c.snapshot()
    with pytest.raises(Refused, match="only the lecturer's session"):
        c.publish(stu.session_state["class.me"], {**before[1], "step": "5"})
    stu.button(key="nav.next").click().run()  # the student's own moves stay theirs
    stu.segmented_control(key="w.view").set_value("cache").run()
    ok(stu)
    assert step(stu) == 78
    assert c.snapshot() == before
    assert "class.open" not in [b.key for b in stu.sidebar.button]  # a student opens none


def test_presentation_mode_is_each_screens_own(traces, apptest):
    lect = app(trace="file:small.npz")
    code = open_class(lect)  # opened before presenting: presentation mode has no sidebar
    lect.button(key="nav.present").click().run()
    assert f"Class **{code}**" in text(lect)  # the code stays on the projector, counted
    assert f"?follow={code}` · **0** students" in text(lect)
    assert "present" not in REGISTRY.get(code).snapshot()[1]
    assert qp(lect)["present"] == "1"
    stu = app(follow=code)
    assert "present" not in qp(stu)
    projector = app(follow=code, present=1)  # a second screen chooses it for itself
    assert qp(projector)["present"] == "1"
    lect.button(key="nav.next").click().run()
    projector.run()
    assert qp(projector)["present"] == "1" and "Following the lecturer" in banner(projector)


def test_unknown_code_is_refused_and_the_page_works(traces, apptest):
    at = app(follow="zzzzzz")
    ok(at)
    msg = text(at, "error")
    assert "'ZZZZZZ' is not open on this server" in msg and "plain explorer" in msg
    assert not banner(at) and "follow" not in qp(at)
    assert at.get("plotly_chart")  # the explorer is drawn
    at.run()
    assert not at.error  # said once


def test_a_closed_class_frees_its_followers(traces, apptest):
    lect, code = lecturer(traces)
    stu = app(follow=code)
    lect.button(key="class.close").click().run()
    ok(lect)
    assert not CODE.findall(text(lect.sidebar)) and lect.button(key="class.open")
    with pytest.raises(Refused):
        REGISTRY.get(code)
    stu.run()
    ok(stu)
    assert f"Class {code} has been closed" in text(stu, "warning")
    assert "follow" not in qp(stu) and step(stu) == 77


def test_every_view_keeps_its_follower_following(traces, monkeypatch, apptest):
    """A page that settles a view's own choices on its second run (frame counts, a loop
    result) must not take that for the student exploring."""
    from kvviz.app.state import VIEW_LABELS, VIEWS

    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(REPO / "tests" / "fixtures" / "loop"))
    lect = app(trace="file:small.npz")
    code = open_class(lect)
    stu = app(follow=code)
    seen = set()
    for view in VIEWS:
        if VIEW_LABELS[view] not in lect.segmented_control(key="w.view").options:
            continue  # tokens: this trace has none
        lect.segmented_control(key="w.view").set_value(view).run()
        ok(lect)
        seen.add(lect.segmented_control(key="w.view").value)
        stu.run()
        stu.run()  # nothing moved: still following, on the lecturer's view
        ok(stu)
        assert "Following the lecturer" in banner(stu), (view, banner(stu))
        assert stu.segmented_control(key="w.view").value == view
        assert shared(stu) == shared(lect), view
    assert len(seen) >= len(VIEWS) - 1


def test_a_class_with_nothing_published_yet_is_seen_once(traces, apptest):
    """A class whose lecturer has not published a page yet (a fresh class; the browser
    test's lecturer, which never does): the follower's page marks that version seen, so its
    poll (version != follow.applied) does not redraw the whole page every tick (it did, and a
    guess being typed was wiped by the redraw); the lecturer's first page then moves it."""
    from kvviz.app.teach.classroom import new_token

    tok = new_token()
    c = REGISTRY.open(tok)
    stu = app(follow=c.code)
    ok(stu)
    assert stu.session_state["follow.applied"] == c.snapshot()[0] == 0
    assert f"Following the lecturer of class **{c.code}**" in banner(stu)
    c.publish(tok, {"trace": "file:small.npz", "view": "scores", "step": "40"})
    stu.run()
    ok(stu)
    assert stu.session_state["follow.applied"] == 1
    assert stu.segmented_control(key="w.view").value == "scores" and step(stu) == 40


def test_the_lecturers_panel_counts_the_students(traces, apptest):
    from kvviz.app.ui.follow import students_line

    lect, code = lecturer(traces)
    assert students_line(0) in text(lect.sidebar, "caption")
    students = [app(follow=code) for _ in range(2)]
    for stu in students:
        ok(stu)
    lect.run()
    assert students_line(2) in text(lect.sidebar, "caption")
    assert REGISTRY.get(code).students() == 2
    assert students_line(1) == "**1** student in the class now"


def test_explore_on_my_own_draws_the_lecturers_controls(traces, apptest):
    lect, code = lecturer(traces)
    stu = app(follow=code)
    stu.button(key="class.explore").click().run()
    ok(stu)
    assert "exploring on your own" in banner(stu)
    assert stu.selectbox(key="w.trace").value == "file:small.npz"  # set as the lecturer's
    assert (stu.selectbox(key="w.a").value, stu.selectbox(key="w.b").value) == ("snapkv", "h2o")
    assert stu.slider(key="w.pa.pool_kernel").value == 9 and step(stu) == 77
    stu.selectbox(key="w.b").set_value("tova").run()  # their own now
    lect.button(key="nav.next").click().run()
    stu.run()
    assert step(stu) == 77 and stu.selectbox(key="w.b").value == "tova"
    stu.button(key="class.back").click().run()
    ok(stu)
    assert "Following the lecturer" in banner(stu) and shared(stu) == shared(lect)
    assert step(stu) == 78 and stu.session_state["kv"]["b"] == "h2o"
    assert not stu.sidebar.selectbox  # the summary again


KEY = re.compile(r"lecturer key: `([A-Z2-9]{4})-([A-Z2-9]{4})`")


def test_a_reloaded_lecturer_takes_the_class_back_with_its_key(traces, apptest):
    """A reload is a new session: with the code and the key the old tab showed, it leads the
    class again at the class's page, and the old tab no longer moves it."""
    lect, code = lecturer(traces)
    stu = app(follow=code)
    key = "-".join(KEY.search(text(lect.sidebar)).groups())
    assert key.replace("-", "") == lect.session_state["class.key"]  # the session's own
    assert REGISTRY.get(code).key is None  # the store keeps only its digest
    new = app(trace="file:small.npz")  # the reloaded tab: a new session, at its own page
    new.text_input(key="class.take.code").input(code.lower())
    new.text_input(key="class.take.key").input("WRONG-KEY")
    new.button(key="class.take").click().run()
    assert f"not class {code}'s lecturer key" in text(new, "error")
    assert "class.open" in [b.key for b in new.sidebar.button]  # still a plain page
    new.text_input(key="class.take.code").input(code)
    new.text_input(key="class.take.key").input(key)
    new.button(key="class.take").click().run()
    ok(new)
    assert KEY.search(text(new.sidebar))  # it leads: the panel, the key
    assert shared(new) == shared(lect) and step(new) == 77  # at the class's page
    new.button(key="nav.next").click().run()
    stu.run()
    assert step(stu) == 78  # the class moves with the new tab
    lect.run()  # the old tab: a plain page now, no error
    ok(lect)
    assert not KEY.search(text(lect.sidebar)) and not lect.error
    lect.button(key="nav.next").click().run()
    stu.run()
    assert step(stu) == 78  # ... and it does not move the class


def test_a_class_store_that_does_not_answer_is_said_in_one_sentence(traces, monkeypatch, apptest):
    """KVVIZ_CLASSES names a Redis server that is down: opening a class and following one say
    so on the page (no traceback), and the page works on as a plain explorer."""
    from kvviz.app.teach.classroom import Registry
    from kvviz.app.ui import classroom

    with refused_port() as port:  # nothing listens there
        monkeypatch.setattr(classroom, "REGISTRY", Registry(f"redis://127.0.0.1:{port}/0"))
        lect = app(trace="file:small.npz")
        lect.button(key="class.open").click().run()
        assert not lect.exception
        said = text(lect.sidebar, "error")
        assert f"redis://127.0.0.1:{port}/0 (KVVIZ_CLASSES) cannot be reached" in said
        assert lect.button(key="class.open") and not CODE.findall(text(lect.sidebar))
        stu = app(follow="ABCDEF")
        assert not stu.exception
        assert "cannot be reached" in text(stu, "error") and "plain explorer" in text(stu, "error")
        assert stu.get("plotly_chart")


def _cache_traces(at) -> list[str]:
    import json
    chart = next(c for c in at.get("plotly_chart") if c.proto.id and "chart.cache" in c.proto.id)
    return [t.get("name") for t in json.loads(chart.proto.spec)["data"]]


def test_a_following_students_heatmap_leaves_out_the_hover_layer_and_says_so(apptest):
    """Every follower's page is sent again after each move: the whole-run heatmap's hover
    layer (the exact shares, most of its bytes) is left out while following, said in the
    caption, and back when the student explores on their own."""
    lect = app(trace="canonical", budget=512, a="tova", b="snapkv", step=1300, view="cache")
    ok(lect)
    code = open_class(lect)
    assert "hover" in _cache_traces(lect)
    stu = app(follow=code)
    ok(stu)
    names = _cache_traces(stu)
    assert "hover" not in names and "cache states" in names
    said = text(stu, "caption")
    assert "exact shares of larger blocks are on hover when you explore on your own" in said
    assert "Hover for exact shares" not in said
    stu.button(key="class.explore").click().run()
    ok(stu)
    assert "hover" in _cache_traces(stu)
    assert "Hover for exact shares of larger blocks" in text(stu, "caption")
