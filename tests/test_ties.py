"""Victims a tie-break chose, not a score: every lesson scene and the default page are read
through the facts module (kvviz.app.explain.tie_facts), and a tie-decided victim must be
announced by the text before anything else is said about it."""
import re
import textwrap

import numpy as np
import pytest
from apphelp import app, ok

from kvviz.app import explain
from kvviz.app.engine import Engine
from kvviz.app.figures.states import divergence_steps
from kvviz.app.teach import lesson as L
from kvviz.app.teach.notes import Facts
from kvviz.app.teach.question import asked_at
from kvviz.core.policies import defaults
from kvviz.core.trace import canonical

TRACE_VIEWS = {"cache", "scores", "divergence", "survival", "metrics", "compare", "tokens"}


def unannounced(text: str, ties) -> list:
    """The ties whose victim is named in `text` first by a sentence that does not say a tie
    decided it. A sentence ends at '. ' (numbers like 0.25 do not split it), ' · ' or a
    line break."""
    sentences = re.split(r"(?<=\.)\s+|\s+·\s+|\n", text)
    missing = []
    for t in ties:
        named = [s for s in sentences if re.search(rf"(?<![\d.]){t.position}(?!\d|\.\d)", s)]
        if not named or "tie" not in named[0].lower():
            missing.append(t)
    return missing


def steps_said(scene, facts: Facts) -> list[int]:
    """The steps whose victims the scene's note talks about: its own step, and the answer
    step of a {next.*} question."""
    steps = [facts.step]
    if "{next." in scene.note:
        for w in ("a", "b"):
            q = asked_at(facts.engine(w).evicted_at, facts.step)
            if q is not None:
                steps.append(q.answer_step)
    return sorted(set(steps))


# --- the facts -----------------------------------------------------------------------------
def _panel(values, victims, candidate=None):
    kept = np.array([0, 1, 2, 3])
    scores = {"last": np.array(values, float),
              "candidate": np.array(candidate or [True] * 4)}
    return dict(kept=kept, scores=scores, victims=np.array(victims), policy="tova",
                label="A: tova")


def test_a_tie_is_a_victim_scored_as_a_candidate_that_stays():
    (t,) = explain.tie_facts("A", _panel([0.1, 0.0, 0.0, 0.5], [1]))
    assert (t.who, t.position, t.score, t.kept) == ("A", 1, 0.0, (2,))
    # below every candidate that stays: its score chose it
    assert explain.tie_facts("A", _panel([0.1, 0.0, 0.2, 0.5], [1])) == []
    # equal only to another victim: both go, the score chose them
    assert explain.tie_facts("A", _panel([0.1, 0.0, 0.0, 0.5], [1, 2])) == []
    # equal to a slot that is no candidate (protected): no tie-break was needed
    assert explain.tie_facts("A", _panel([0.1, 0.0, 0.0, 0.5], [1],
                                         [True, True, False, True])) == []


def test_the_evictions_text_says_the_tie_first():
    text = explain.evictions_text("A", _panel([0.1, 0.0, 0.0, 0.5], [1]))
    assert text.startswith("A tie decides this: A's victim, position 1, has the current-step "
                           "weight 0, exactly as 1 candidate A keeps (2)"), text
    assert not unannounced(text, explain.tie_facts("A", _panel([0.1, 0.0, 0.0, 0.5], [1])))
    plain = explain.evictions_text("A", _panel([0.1, 0.0, 0.2, 0.5], [1]))
    assert "tie" not in plain.lower()


def test_the_check_catches_a_text_that_names_a_tied_victim_without_the_tie():
    ties = explain.tie_facts("A", _panel([0.1, 0.0, 0.0, 0.5], [1]))
    assert unannounced("A evicts position 1.", ties) == ties
    assert unannounced("A evicts position 1. It was a tie.", ties) == ties


# --- every scene of every shipped lesson ------------------------------------------------
# the scenes that replay a trace (a model-run view, loop or needle, has no replayed step)
SCENES = [(name, n) for name in L.names() for n in range(1, len(L.load(name).scenes) + 1)
          if L.load(name).scene(n).state.view in TRACE_VIEWS]


def test_only_model_run_scenes_are_left_out_of_the_tie_check():
    left = [(name, n) for name in L.names() for n in range(1, len(L.load(name).scenes) + 1)
            if (name, n) not in SCENES]
    assert {L.load(name).scene(n).state.view for name, n in left} <= {"loop", "needle"}
    assert len(SCENES) > len(left)


@pytest.mark.parametrize("name,n", SCENES)
def test_every_scene_lands_on_victims_its_scores_decide(name, n):
    les = L.load(name)
    scene = les.scene(n)
    facts = Facts(scene)
    ties = [t for s in steps_said(scene, facts) for w in ("a", "b")
            for t in explain.tie_facts(w.upper(), facts.panel(w, s))]
    note = L.note_text(les, n)
    assert not unannounced(note, ties), (n, note)
    assert ties == [], f"scene {n} ({scene.title}): victims chosen by a tie-break: {ties}"


def test_a_scene_on_a_tie_says_so_in_its_note(tmp_path):
    """The toy trace at step 6 with this SnapKV: B's victim ties with a slot it keeps."""
    path = tmp_path / "t.toml"
    path.write_text(textwrap.dedent('''\
        title = "T"
        minutes = 2
        [[scene]]
        title = "S"
        minutes = 2
        note = "A evicts {victims.a}; B evicts {victims.b}. {evictions.b} {why}"
        [scene.state]
        trace = "file:toy.npz"
        layer = 0
        budget = 4
        a = "tova"
        b = "snapkv"
        "b.obsWindow" = 4
        "b.poolKernel" = 3
        "b.recentWindow" = 1
        step = 6
        view = "scores"
        '''))
    les = L.load(path)
    facts = Facts(les.scene(1))
    ties = explain.tie_facts("B", facts.panel("b", 6))
    assert [t.position for t in ties] == [2], ties
    note = L.note_text(les, 1)
    assert "B evicts position 2 (not chosen by its score but by the tie-break" in note, note
    for part in note.split("B evicts", 1)[1:]:
        assert not unannounced(part, ties), part


# --- the default page ------------------------------------------------------------------------
def test_the_default_page_says_its_tie_with_its_victims(apptest):
    """The canonical trace's current-step weights are mostly exact zeros, so no step of
    TOVA's at budget 512 is decided by its score: the page must say so first."""
    trace = canonical()
    ea, eb = (Engine(trace, n, 512, defaults(n)) for n in ("tova", "snapkv"))
    step = int(divergence_steps(ea.evicted_at, eb.evicted_at)[0])
    ties = []
    for who, e in (("A", ea), ("B", eb)):
        kept, scores = e.peek(step)
        ties += explain.tie_facts(who, dict(kept=kept, scores=scores, victims=e.victims(step),
                                            policy=e.name))
    assert ties  # what makes this page the case to check
    at = app()
    ok(at)
    line = next(m.value for m in at.markdown if f"evicted at step {step}" in m.value)
    assert not unannounced(line, ties), line
    for t in ties:  # said with the victim, in the same clause
        said = f"{t.position} (a tie-break: scored as {len(t.kept)} held positions)"
        assert f"position {said}" in line or f", {said}" in line, line
