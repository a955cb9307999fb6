"""The lesson bar under AppTest: every scene of the shipped lesson opens with its view drawn
and no warning, next/previous scene, a scene's short link, the picker, a bad lesson file,
the speaker note for the lecturer only (collapsed in presentation mode), and the note's
numbers parsed off the page and recomputed here from a fresh Replay and the loop JSON."""
import json
import re
from pathlib import Path

import pytest
from apphelp import app, ok

from kvviz.app.teach import lesson as L
from kvviz.core.policies import make_policy
from kvviz.core.replay import Replay
from kvviz.core.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
LESSON = L.load(ROOT / "lessons" / "tova-vs-snapkv.toml")
N = len(LESSON.scenes)


@pytest.fixture(autouse=True)
def _here(monkeypatch):
    monkeypatch.chdir(ROOT)
    for k in ("KVVIZ_LESSONS_DIR", "KVVIZ_TRACES_DIR", "KVVIZ_LOOP_DIR", "KVVIZ_NEEDLE_DIR"):
        monkeypatch.delenv(k, raising=False)


def clean(at):
    ok(at)
    assert not at.warning, [w.value for w in at.warning]
    assert not at.error, [e.value for e in at.error]


def bar(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("**TOVA against SnapKV**"))


def note(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("Say:"))


def shows_scene(at, n):
    s = LESSON.scene(n)
    kv = at.session_state["kv"]
    assert kv["scene"] == n and kv["lesson"] == "tova-vs-snapkv"
    assert f"Scene {n} of {N}: {s.title}" in bar(at)
    assert any(m.value == f"link `?lesson=tova-vs-snapkv&scene={n}`" for m in at.markdown)
    assert kv["view"] == s.state.view
    if s.state.view not in ("loop", "needle"):
        assert (kv["trace"], kv["budget"], kv["step"]) == (s.state.trace, s.state.budget, s.state.step)
    drawn = at.table if s.state.view == "metrics" else at.get("plotly_chart")
    assert drawn, f"scene {n}: its view ({s.state.view}) drew nothing"
    q = dict(at.query_params)
    assert q["lesson"] == ["tova-vs-snapkv"] or q["lesson"] == "tova-vs-snapkv"


def test_every_scene_loads_clean_and_next_previous_move(monkeypatch, apptest):
    at = app(timeout=180, lesson="tova-vs-snapkv", scene=1)
    clean(at)
    shows_scene(at, 1)
    assert at.button(key="lesson.prev").disabled
    for n in range(2, N + 1):
        at.button(key="lesson.next").click().run(timeout=180)
        clean(at)
        shows_scene(at, n)
    assert at.button(key="lesson.next").disabled
    at.button(key="lesson.prev").click().run(timeout=180)
    clean(at)
    shows_scene(at, N - 1)


def test_a_short_link_opens_its_scene_and_a_full_link_keeps_its_state(apptest):
    at = app(lesson="tova-vs-snapkv", scene=7)
    clean(at)
    shows_scene(at, 7)
    # the address bar after drawing: the scene's state plus lesson/scene; a moved step stays
    q = {k: (v[0] if isinstance(v, list) else v) for k, v in dict(at.query_params).items()}
    q["step"] = "600"
    again = app(**{k.replace(".", "__"): v for k, v in q.items()})
    clean(again)
    assert again.session_state["kv"]["step"] == 600 and again.session_state["kv"]["scene"] == 7


def numbers_of_scene_1(text):
    m = re.search(r"after step (\d+) A \(tova\) holds (\d+) and B \(.*?\) holds (\d+)", text)
    r = re.search(r"Reveal: A evicts position (\d+) at step (\d+); B evicts position (\d+) "
                  r"at step (\d+)", text)
    assert m and r, text
    return [int(x) for x in m.groups()], [int(x) for x in r.groups()]


def test_the_speaker_notes_numbers_are_the_librarys(apptest):
    at = app(lesson="tova-vs-snapkv", scene=1)
    clean(at)
    (step, held_a, held_b), (va, sa, vb, sb) = numbers_of_scene_1(note(at))
    s = LESSON.scene(1).state
    trace = load_trace(ROOT / "traces" / "toy.npz")
    for which, held, victim, when in (("a", held_a, va, sa), ("b", held_b, vb, sb)):
        rp = Replay(trace, make_policy(getattr(s, which), budget=s.budget, **s.params(which)))
        out = [sorted(int(v) for v in rp.step()) for _ in range(trace.steps)]
        gone = {p for t in range(step + 1) for p in out[t]}
        assert held == sum(1 for p in range(step + 1) if p not in gone)
        first = next(t for t in range(step, trace.steps) if out[t])
        assert (when, [victim]) == (first, out[first])
    # the real-text scene: the first evictions on prose at the scene's step
    at.button(key="lesson.next").click().run()
    for _ in range(3):
        at.button(key="lesson.next").click().run()
    clean(at)
    m = re.search(r"A \(tova\) evicts position (\d+); B \(snapkv\) evicts position (\d+)", note(at))
    assert m, note(at)
    s = LESSON.scene(5).state
    prose = load_trace(ROOT / "traces" / "prose.npz", layer=s.layer)
    for which, got in zip("ab", m.groups()):
        rp = Replay(prose, make_policy(getattr(s, which), budget=s.budget))
        rp.seek(s.step - 1)
        assert [int(got)] == sorted(int(v) for v in rp.step())


def test_the_loop_scenes_note_matches_the_results_json_and_the_view(apptest):
    n = next(s.number for s in LESSON.scenes if s.state.view == "loop")
    at = app(lesson="tova-vs-snapkv", scene=n)
    clean(at)
    m = re.search(r"perplexity ([\d.]+) against ([\d.]+) with the full cache; top-1 agreement "
                  r"([\d.]+)%", note(at))
    assert m, note(at)
    s = LESSON.scene(n).state
    data = json.loads((ROOT / "traces" / "loop" / f"{s.loop}.json").read_text())
    full = next(r for r in data["results"] if r["policy"] == "full")
    row = next(r for r in data["results"] if r["policy"] == s.loop_policy and not r["params"]
               and r["budget"] == s.loop_budget)
    assert float(m.group(1)) == pytest.approx(row["perplexity"], abs=5e-4)
    assert float(m.group(2)) == pytest.approx(full["perplexity"], abs=5e-4)
    assert float(m.group(3)) == pytest.approx(100 * row["top1_agreement"], abs=0.05)
    # the view shows the same run (its caption states the same perplexities)
    assert any(f"perplexity {m.group(1)} against {m.group(2)}" in c.value for c in at.caption)


def popovers(at) -> list[str]:
    """The labels of every popover on the page (AppTest has no accessor for them)."""
    out, todo = [], [at._tree]
    while todo:
        node = todo.pop()
        if getattr(node, "type", None) == "popover":
            out.append(node.proto.popover.label)
        todo.extend(getattr(node, "children", {}).values())
    return out


def test_the_note_is_the_lecturers_and_collapsed_in_presentation_mode(apptest):
    from kvviz.app.ui.classroom import REGISTRY

    at = app(lesson="tova-vs-snapkv", scene=2)
    (side,) = [e for e in at.sidebar.expander if e.label == "Speaker note"]  # beside the chart
    assert side.proto.expanded and not [e for e in at.main.expander if e.label == "Speaker note"]
    shown = app(lesson="tova-vs-snapkv", scene=2, present=1)
    assert not shown.expander and "Speaker note" in popovers(shown)  # opened on demand
    assert [m for m in shown.markdown if m.value.startswith("Say:")]
    c = REGISTRY.open("lecturer-token-for-the-test")
    from apphelp import APP
    from streamlit.testing.v1 import AppTest

    student = AppTest.from_file(APP, default_timeout=120)
    student.session_state["class.follows"] = c.code  # what ?follow=CODE sets (ui/classroom)
    student.query_params["lesson"] = "tova-vs-snapkv"
    student.query_params["scene"] = "2"
    student.run()
    ok(student)
    assert "Scene 2 of" in bar(student)
    assert not [e for e in student.expander if e.label == "Speaker note"]
    assert not [m for m in student.markdown if m.value.startswith("Say:")]
    # a student moves no scenes: no buttons (and so no keys: a key is a button's shortcut)
    assert not {"lesson.prev", "lesson.next"} & {b.key for b in student.button}
    student.button(key="class.leave").click().run()  # stops following: still a student's page
    ok(student)
    assert not student.session_state["class.follows"]
    assert not [m for m in student.markdown if m.value.startswith("Say:")]
    assert not {"lesson.prev", "lesson.next"} & {b.key for b in student.button}


def test_the_note_says_nothing_while_a_question_is_up(apptest):
    from kvviz.app.ui.classroom import LEADS, REGISTRY, TOKEN

    at = app(lesson="tova-vs-snapkv", scene=1)
    tok = "lecturer-token-for-the-note"
    c = REGISTRY.open(tok)
    at.session_state[TOKEN], at.session_state[LEADS] = tok, c.code
    at.run()
    (side,) = [e for e in at.sidebar.expander if e.label == "Speaker note"]
    assert side.proto.expanded and any("Reveal:" in m.value for m in at.markdown)
    at.button(key="predict.ask.a").click().run()
    ok(at)
    assert c.round is not None
    (side,) = [e for e in at.sidebar.expander if e.label == "Speaker note"]
    assert not side.proto.expanded
    assert not [m for m in at.markdown if "Reveal:" in m.value or m.value.startswith("Say:")]
    assert any("Hidden while the class's question is up" in t.value for t in at.caption)


def test_the_picker_opens_scene_1_and_no_lesson_leaves_the_state(tmp_path, apptest):
    at = app(trace="file:prose.npz", budget=64)
    clean(at)
    assert at.selectbox(key="lesson").options == ["no lesson", "tova-vs-snapkv"]
    at.selectbox(key="lesson").set_value("tova-vs-snapkv").run()
    clean(at)
    shows_scene(at, 1)
    at.selectbox(key="lesson").set_value("").run()
    clean(at)
    assert at.session_state["kv"]["lesson"] == "" and at.session_state["kv"]["scene"] == 0
    assert at.session_state["kv"]["trace"] == "file:toy.npz"  # scene 1's state stays
    assert not [m for m in at.markdown if m.value.startswith("**TOVA against SnapKV**")]


def test_a_bad_lesson_file_is_an_error_and_the_page_works_on(tmp_path, monkeypatch, apptest):
    (tmp_path / "broken.toml").write_text('title = "B"\nminutes = 5\n[[scene]]\ntitle = "S"\n'
                                          'minutes = 5\nnote = "{nope}"\n')
    monkeypatch.setenv("KVVIZ_LESSONS_DIR", str(tmp_path))
    at = app(lesson="broken", scene=1)
    ok(at)
    errs = [e.value for e in at.error]
    assert any("broken.toml: scene 1: note: unknown placeholder {nope}" in e for e in errs), errs
    assert at.get("plotly_chart")  # the cache heatmap is drawn all the same
    missing = app(lesson="nope", scene=2)
    ok(missing)
    # one box, naming the lesson and what there is, and no server path
    assert [e.value for e in missing.error] == [
        "Lesson: lesson 'nope': no file nope.toml in the lessons folder (lessons: broken)"]
    assert str(tmp_path) not in missing.error[0].value
    monkeypatch.delenv("KVVIZ_LESSONS_DIR")
    far = app(lesson="tova-vs-snapkv", scene=99)
    ok(far)
    assert len(far.error) == 1, [e.value for e in far.error]
    assert "scene 99" in far.error[0].value and f"scenes 1–{N}" in far.error[0].value
    assert "/" not in far.error[0].value
    zero = app(lesson="tova-vs-snapkv", scene=0)  # never scene 1 in silence
    ok(zero)
    assert len(zero.error) == 1, [e.value for e in zero.error]
    assert "scene 0" in zero.error[0].value and f"scenes 1–{N}" in zero.error[0].value
    assert at.get("plotly_chart")


def test_a_slides_scene_after_another_trace_keeps_its_own_slides(tmp_path, monkeypatch, apptest):
    """The slides view resets its range when the trace changes; a scene's own range stays."""
    (tmp_path / "s.toml").write_text(
        'title = "Slides"\nminutes = 2\n'
        '[[scene]]\ntitle = "prose"\nminutes = 1\nnote = "Say: {step}"\n'
        '[scene.state]\ntrace = "file:prose.npz"\nbudget = 64\nstep = 100\nview = "slides"\n'
        '[[scene]]\ntitle = "toy"\nminutes = 1\nnote = "Say: {victims.a}"\n'
        '[scene.state]\ntrace = "file:toy.npz"\nbudget = 4\nb = "tova"\nstep = 9\n'
        'view = "slides"\n"slides.kind" = "tokens"\n"slides.steps" = "4,12"\n"slides.frames" = 5\n')
    monkeypatch.setenv("KVVIZ_LESSONS_DIR", str(tmp_path))
    at = app(lesson="s", scene=1)
    clean(at)
    assert at.session_state["kv"]["view"] == "slides" and at.slider(key="slides.steps").value == (0, 1023)
    at.button(key="lesson.next").click().run()
    clean(at)
    kv = at.session_state["kv"]
    assert (kv["trace"], kv["slides_kind"], tuple(kv["slides_steps"]), kv["slides_frames"]) == (
        "file:toy.npz", "tokens", (4, 12), 5)
    q = dict(at.query_params)
    first = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731
    assert (first(q["slides.steps"]), first(q["slides.kind"]), first(q["scene"])) == ("4,12", "tokens", "2")
