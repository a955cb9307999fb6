"""The page's state under AppTest: what a shared link keeps, what a trace switch
keeps, one budget per trace, the link's fallbacks, and the loop view's own controls. Each
test opens a second, fresh session on the first one's address where the defect was a lost
choice: the link alone must reproduce it."""
import shutil

import numpy as np
import pytest
from apphelp import APP, REPO, app, ok, softmax_rows, traces_dir
from streamlit.testing.v1 import AppTest

from kvviz.core.trace import save_trace

FIX = REPO / "tests" / "fixtures" / "loop"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    rng = np.random.default_rng(3)
    save_trace(d / "long.npz", softmax_rows(rng, 400, 1), tokens=[" a", " b"] * 200,
               meta={"name": "long"})
    save_trace(d / "short.npz", softmax_rows(rng, 120, 1), meta={"name": "short"})
    with traces_dir(d):
        yield d


def qp(at) -> dict:
    return {k: at.query_params[k][0] if isinstance(at.query_params[k], list)
            else at.query_params[k] for k in at.query_params}


def reopen(at) -> AppTest:
    """A second browser on the first one's address."""
    return app(**{k.replace(".", "__"): v for k, v in qp(at).items()})


def warnings(at) -> str:
    return " ".join(w.value for w in at.warning)


# --- shared links keep every choice -----------------------------------------------------------
def test_loop_choice_is_in_the_link(monkeypatch, apptest):
    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(FIX))
    at = app(view="loop")
    ok(at)
    src = at.selectbox(key="loop.source")
    at.selectbox(key="loop.source").set_value(next(o for o in src.options if "kv-head" in o))
    at.run()
    at.selectbox(key="loop.policy").set_value("streaming-llm").run()
    at.selectbox(key="loop.budget").set_value(16).run()
    ok(at)
    q = qp(at)
    assert (q["loop"], q["loop.policy"], q["loop.budget"]) == ("prose64_kv-head",
                                                                 "streaming-llm", "16")
    again = reopen(at)
    ok(again)
    assert "kv-head" in again.selectbox(key="loop.source").value
    assert again.selectbox(key="loop.policy").value == "streaming-llm"
    assert again.selectbox(key="loop.budget").value == 16
    assert any("streaming-llm @ 16" in c.value for c in again.caption)
    # a name the results do not have falls back to the first, said
    odd = app(view="loop", loop="nope", loop__budget=999)
    ok(odd)
    assert "loop=nope: no such result here" in warnings(odd)
    assert "loop.budget=999: no such budget" in warnings(odd)


def test_slides_settings_are_in_the_link(traces, apptest):
    at = app(trace="file:long.npz", view="slides")
    ok(at)
    assert at.number_input(key="slides.frames").value == 48  # automatic: not in the link
    assert "slides.frames" not in qp(at)
    at.slider(key="slides.steps").set_value((100, 130)).run()
    at.number_input(key="slides.frames").set_value(12).run()
    at.segmented_control(key="slides.kind").set_value("tokens").run()
    ok(at)
    q = qp(at)
    assert (q["slides.steps"], q["slides.frames"], q["slides.kind"]) == ("100,130", "12",
                                                                        "tokens")
    again = reopen(at)
    ok(again)
    assert again.slider(key="slides.steps").value == (100, 130)
    assert again.number_input(key="slides.frames").value == 12
    assert any(b.proto.label.startswith("animated GIF: 12 frames, steps 100–130")
               for b in again.get("download_button"))
    # the frames left automatic follow a shorter range (31 steps -> 31 frames)
    fresh = app(trace="file:long.npz", view="slides", slides__steps="10,40")
    ok(fresh)
    assert fresh.number_input(key="slides.frames").value == 31
    bad = app(trace="file:long.npz", view="slides", slides__steps="ten")
    assert "slides.steps='ten' is not two integers S0,S1" in warnings(bad)


# --- trace switch, budget ----------------------------------------------------------------------
def test_switching_trace_keeps_the_step(traces, apptest):
    at = app(step=300, view="scores")
    ok(at)
    at.selectbox(key="w.trace").set_value("file:long.npz").run()  # 400 steps: 300 exists
    ok(at)
    assert qp(at)["step"] == "300" and at.slider(key="w.step").value == 300
    status = next(m.value for m in at.markdown if "holds" in m.value)
    assert "evicted at step 300" in status and "holds **1**" not in status
    at.selectbox(key="w.trace").set_value("file:short.npz").run()  # 120 steps: its last
    ok(at)
    assert qp(at)["step"] == "119"


def test_one_budget_per_trace(traces, apptest):
    # the budget a link without one opens at is the one picking the trace gives
    linked = app(trace="file:long.npz")
    ok(linked)
    picked = app()
    picked.selectbox(key="w.trace").set_value("file:long.npz").run()
    ok(picked)
    assert qp(linked)["budget"] == qp(picked)["budget"] == "100"  # a quarter of 400 steps
    assert "nothing is ever evicted" not in warnings(linked)


# --- link values that lead nowhere -------------------------------------------------------
def test_out_of_range_budget_falls_back_to_the_default(traces, apptest):
    at = app(budget=-3)
    ok(at)
    assert "budget=-3 is outside 1–4096; using this trace's default, 512" in warnings(at)
    assert qp(at)["budget"] == "512" and not at.error  # SnapKV does not refuse


def test_experiment_link(traces, apptest):
    shutil.copy(REPO / "traces" / "prose.npz", traces / "prose.npz")
    at = app(exp="pool-defends")  # only the experiment: it opens, as its button would
    ok(at)
    q = qp(at)
    assert (q["exp"], q["trace"], q["view"]) == ("pool-defends", "file:prose.npz", "scores")
    assert any("Experiment: Pooling defends" in m.value for m in at.markdown)
    # with settings that are not the experiment's: not shown, and said
    at = app(exp="pool-defends", budget=100)
    ok(at)
    assert "exp=pool-defends: this link's settings are not the experiment's" in warnings(at)
    assert "exp" not in qp(at)


def test_position_not_yet_generated_is_said(traces, apptest):
    at = app(focus=4000, step=600, view="scores")
    ok(at)
    assert "focus=4000 is not generated until step 4000 (this link shows step 600)" in \
        warnings(at)
    assert qp(at)["focus"] == "-1"
    assert not any("around position 4000" in str(c.proto.spec) for c in at.get("plotly_chart"))


def test_repeated_key_is_said(traces, apptest):
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["budget"] = ["64", "128"]
    at.run()
    ok(at)
    assert "budget is given 2 times ('64', '128'); using the first, '64'" in warnings(at)
    assert qp(at)["budget"] == "64"


# --- the loop view shows only its own controls ------------------------------------------------
def test_loop_view_has_one_step_slider_and_no_page_budget(monkeypatch, apptest):
    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(FIX))
    at = app(view="loop", step=700, budget=256)
    ok(at)
    assert [s.key for s in at.slider] == ["loop.step"]
    assert not [n for n in at.number_input if n.key == "w.budget"]
    assert not any("A Δ B" in m.value for m in at.markdown)  # no page-wide status line
    assert any("carry their own policies and budgets" in c.value for c in at.sidebar.caption)
    # the page's own settings are kept for the other views
    at.segmented_control(key="w.view").set_value("cache").run()
    ok(at)
    assert at.slider(key="w.step").value == 700 and at.number_input(key="w.budget").value == 256


# --- waiting -----------------------------------------------------------------------------
def test_a_sweep_says_what_it_is_doing(traces, apptest):
    at = app(trace="file:short.npz", view="metrics")
    ok(at)
    at.button(key="sweep.obs").click().run()
    ok(at)
    labels = [s.label for s in at.status]
    assert any(lab.startswith("Swept 8 settings in ") for lab in labels), labels


def test_memory_has_a_thousands_separator(traces, apptest):
    at = app(view="metrics")  # 512 slots: tens of thousands of bytes
    ok(at)
    body = at.table[0].proto.arrow_data.styler.display_values.hex()  # the Styler's shown text
    memory = at.table[0].value["memory (bytes)"].iloc[0]
    assert memory >= 1000 and f"{memory:,}".encode().hex() in body


# --- the session keys are gathered ------------------------------------------------------------
def test_every_session_key_is_a_widget_or_a_listed_page_key(traces, monkeypatch, apptest):
    """After every view, each session key is a widget's, the page state's, or one of
    kvviz.app.ui.session.PAGE_KEYS: no ad-hoc key elsewhere."""
    from kvviz.app.state import VIEWS
    from kvviz.app.ui import session

    monkeypatch.setenv("KVVIZ_LOOP_DIR", str(FIX))
    at = app(trace="file:long.npz")
    for view in VIEWS:
        at.segmented_control(key="w.view").set_value(view).run()
        ok(at)
    at.segmented_control(key="w.view").set_value("metrics").run()
    at.button(key="sweep.obs").click().run()
    ok(at)
    keys = set(at.session_state.keys())
    prefixes = ("w.", "loop.", "slides.", "nav.", "exp.", "chart.", "dl.", "sweep.", "why.",
                "class.", "$$")
    stray = {k for k in keys if not k.startswith(prefixes)
             and not any(k == p or (p.endswith(".") and k.startswith(p))
                         for p in session.PAGE_KEYS)}
    assert not stray, stray
    assert session.KV in keys and any(k.startswith(session.SWEEP_ON) for k in keys)


def test_one_registry_of_views_feeds_the_url_the_lessons_and_the_page():
    """The URL check, the lessons' check, the selector's labels and the page's dispatch
    read kvviz.app.state.REGISTRY: a view in one is in all, in the same order."""
    from kvviz.app.state import REGISTRY, VIEW_LABELS, VIEWS
    from kvviz.app.ui import panels

    names = [v.name for v in REGISTRY]
    assert len(set(names)) == len(names) and list(VIEWS) == names
    assert list(VIEW_LABELS) == names and all(VIEW_LABELS[v.name] == v.label for v in REGISTRY)
    assert list(panels.RENDER) == names and all(callable(f) for f in panels.RENDER.values())


def test_each_view_owns_its_slice_of_the_link():
    """Every URL key has one owner, the page or one view's slice; a view's plain key
    round-trips through the link on its own, in its slice, and a crafted value is a note
    naming the key and the rule, never an exception."""
    from kvviz.app import slices
    from kvviz.app.state import KNOWN_KEYS, PAGE_QUERY_KEYS, VIEWS, ViewState, from_query, to_query

    seen = set(PAGE_QUERY_KEYS)
    for cls in slices.SLICES:
        keys = set(cls.url_keys())
        assert keys and not keys & seen, cls.NAME  # no key read by two owners
        seen |= keys
    assert seen == KNOWN_KEYS
    assert {c.NAME for c in slices.SLICES} - set(VIEWS) == {"nav", "present", "lesson"}
    samples = {tuple: ((3, 9), "two integers S0,S1"), float: (0.25, "a number"),
               int: (7, "an integer"), str: ("x", None)}
    for cls in slices.SLICES:
        for key, name in cls.KEYS.items():
            value, rule = samples[type(getattr(cls(), name))]
            vs = ViewState(**{name: value})
            assert vs.slice(cls) != cls() and getattr(vs, name) == value
            others = {c.NAME: c() for c in slices.SLICES if c is not cls}
            assert all(vs.views[n] == blank for n, blank in others.items())
            q = to_query(vs)
            assert q[key] == slices.plain_text(value)
            back, notes = from_query(q)
            assert not notes and back.views == vs.views and to_query(back) == q
            if rule:
                back, notes = from_query({key: "oops"})
                assert notes == [f"{key}='oops' is not {rule}; ignored"]
                assert back.slice(cls) == cls()
    with pytest.raises(TypeError, match="no field 'colour'|no field colour"):
        ViewState(colour="red")
