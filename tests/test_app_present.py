"""Presentation mode under AppTest: `present=1` from the link or the page's
button draws no sidebar, no view selector and no view settings' values lost: the same trace,
budget, policies and step as the explorer, one view, the step navigator; every view draws in
it without an exception or a warning, with its chart text at the room's floor."""
import json
import sys

import needle_fixture as NF
import pytest
from apphelp import REPO, app, ok
from test_room import font_sizes

from kvviz.app.figures.room import FLOOR

LOOP = REPO / "tests" / "fixtures" / "loop"
NAV = {"nav.prev", "nav.next", "nav.left", "nav.right"}


def qp(at) -> dict:
    return {k: at.query_params[k][0] if isinstance(at.query_params[k], list)
            else at.query_params[k] for k in at.query_params}


def sidebar_widgets(at) -> list:
    """Everything drawn in the sidebar (AppTest's tree under it)."""
    out, todo = [], list(at.sidebar.children.values())
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(getattr(node, "children", {}).values())
    return out


def charts(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def problems(at) -> list[str]:
    return [e.value for e in at.exception] + [w.value for w in at.warning] + [
        e.value for e in at.error]


def test_the_link_presents_the_same_page_without_its_controls(apptest):
    link = dict(budget=256, a="h2o", b__poolKernel=3, step=900, view="divergence", track=40)
    normal = app(**link)
    ok(normal)
    assert sidebar_widgets(normal) and normal.segmented_control(key="w.view")
    room = app(present=1, **link)
    ok(room)
    assert not problems(room), problems(room)
    assert sidebar_widgets(room) == []
    assert "w.view" not in [s.key for s in room.segmented_control]
    assert room.slider(key="w.step").value == 900
    keys = {b.key for b in room.button}
    assert NAV <= keys and {"nav.div", "nav.track", "nav.leave"} <= keys
    assert "nav.present" not in keys
    # the page works on what the sidebar would hold: the link it writes is the explorer's
    assert qp(room) == {**qp(normal), "present": "1"}
    assert len(charts(room)) == len(charts(normal)) > 0  # the one view, whole
    titles = [c["layout"]["title"]["text"].replace("<br>", " ") for c in charts(room)]  # wrapped
    assert titles == [c["layout"]["title"]["text"] for c in charts(normal)]
    # the charts are the room's only in the presenting session: a later explorer's are as before
    assert charts(app(**link)) == charts(normal)
    assert all(c["layout"]["font"]["size"] >= FLOOR for c in charts(room))
    status = " ".join(m.value for m in room.markdown)  # one short line: the chart names A, B
    assert "evicted at step 900: " in status and "first\u00a0divergence:\u00a0" in status
    assert "holds" not in status
    caption = " ".join(c.value for c in room.caption)
    for key in ("**K or →**", "**J or ←**", "**D**", "**P** leave presentation"):
        assert key in caption


def test_the_button_enters_and_leaves_and_the_link_says_so(apptest):
    at = app(view="scores")
    ok(at)
    at.number_input(key="w.budget").set_value(300).run()
    at.button(key="nav.present").click().run()
    ok(at)
    assert qp(at)["present"] == "1" and qp(at)["budget"] == "300"
    assert sidebar_widgets(at) == []
    assert "w.view" not in [s.key for s in at.segmented_control]
    before = at.slider(key="w.step").value
    at.button(key="nav.right").click().run()  # the → key's button
    assert at.slider(key="w.step").value == before + 1
    at.button(key="nav.left").click().run()
    assert at.slider(key="w.step").value == before
    at.button(key="nav.leave").click().run()
    ok(at)
    assert "present" not in qp(at)
    assert at.number_input(key="w.budget").value == 300  # the explorer's controls are back
    assert at.segmented_control(key="w.view").value == "scores"
    assert "nav.left" not in {b.key for b in at.button}


def test_a_bad_link_value_is_still_said(apptest):
    at = app(present=1, budget=99999, zoom=7)
    ok(at)
    said = " ".join(w.value for w in at.warning)
    assert "budget=99999 is outside" in said and "zoom=7" in said
    assert sidebar_widgets(at) == []


@pytest.fixture
def view_env(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(LOOP))
    for name in ("torch", "transformers"):  # the needle/loop views' run forms: not drawn
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setenv("KVVIZ_NEEDLE_DIR",
                       str(NF.write_results(tmp_path_factory.mktemp("needle"))))


@pytest.mark.parametrize("view,extra", [
    ("cache", {}), ("cache", {"zoom": 32}), ("scores", {}), ("divergence", {}),
    ("survival", {}), ("compare", {}), ("tokens", {"trace": "file:prose.npz"}),
    ("cache", {"trace": "file:toy.npz", "budget": 4, "b__recentWindow": 1, "b__obsWindow": 2,
               "b__poolKernel": 3}),
    ("loop", {}), ("needle", {}), ("metrics", {}), ("slides", {}), ("export", {}),
])
def test_every_view_presents_at_the_room_floor(view_env, view, extra, apptest):
    at = app(present=1, view=view, **extra)
    assert not problems(at), problems(at)
    assert sidebar_widgets(at) == []
    assert qp(at)["view"] == view and qp(at)["present"] == "1"
    figs = charts(at)
    # slides and export show images and files, metrics its table (a sweep only once asked)
    assert figs or view in ("slides", "export", "metrics"), view
    for fig in figs:
        small = [(w, v) for w, v in font_sizes(fig) if v < FLOOR]
        assert not small, (view, fig["layout"].get("title"), small)
