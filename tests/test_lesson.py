"""Lessons (kvviz.app.teach.lesson): every validation rule with the file, scene, field and rule
named; the placeholders against the library computed independently here (a fresh
kvviz.core.replay.Replay stepped by hand, the trace's rows, the loop result's JSON sidecar, the
needle results CSV read with the csv module); the shipped lesson; `kvviz lesson`."""
import csv
import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvviz.__main__ import main
from kvviz.app.teach import lesson as L
from kvviz.core.policies import defaults, make_policy
from kvviz.core.replay import Replay
from kvviz.core.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "lessons" / "tova-vs-snapkv.toml"
TOY = """trace = "file:toy.npz"
layer = 0
budget = 4
a = "tova"
b = "snapkv"
"b.obsWindow" = 4
"b.poolKernel" = 3
"b.recentWindow" = 1
step = {step}
"""


def write(tmp_path, scenes, title='"T"', minutes=None, name="t.toml"):
    """A lesson file: scenes = [(minutes, note, state TOML lines)]."""
    total = sum(m for m, _, _ in scenes) if minutes is None else minutes
    text = f"title = {title}\nminutes = {total}\n"
    for m, note, state in scenes:
        text += (f"\n[[scene]]\ntitle = \"S\"\nminutes = {m}\nnote = '''{note}'''\n"
                 f"[scene.state]\n{textwrap.dedent(state)}\n")
    path = tmp_path / name
    path.write_text(text)
    return path


def toy(step=6):
    return TOY.format(step=step)


def refused(path, *words):
    with pytest.raises(ValueError) as e:
        L.load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path.name}: "), msg
    for w in words:
        assert w in msg, msg
    return msg


# --- validation ----------------------------------------------------------------------
def test_a_valid_file_loads_with_its_scenes_and_state(tmp_path):
    p = write(tmp_path, [(2, "A evicts {victims.a}.", toy(4)), (1.5, "plain", 'view = "metrics"')])
    les = L.load(p)
    assert (les.name, les.title, les.minutes, len(les.scenes)) == ("t", "T", 3.5, 2)
    s = les.scenes[0]
    assert (s.number, s.state.trace, s.state.budget, s.state.step, s.state.pb["pool_kernel"]) == (
        1, "file:toy.npz", 4, 4, 3)
    assert les.scenes[1].state.view == "metrics"


def test_not_toml_and_unreadable(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("title = \n")
    refused(p, "not valid TOML")
    refused(tmp_path / "missing.toml", "cannot read")


def test_titles_are_required(tmp_path):
    refused(write(tmp_path, [(1, "n", "")], title='""'), "lesson", "title is missing")
    p = tmp_path / "s.toml"
    p.write_text('title = "T"\nminutes = 1\n[[scene]]\nminutes = 1\nnote = "n"\n')
    refused(p, "scene 1", "title is missing")


@pytest.mark.parametrize("bad", ["0", "-2", '"5"', "true"])
def test_minutes_must_be_a_positive_number(tmp_path, bad):
    refused(write(tmp_path, [(1, "n", "")], minutes=bad), "lesson", "minutes must be a positive number")
    p = tmp_path / "s.toml"
    p.write_text(f'title = "T"\nminutes = 1\n[[scene]]\ntitle = "S"\nminutes = {bad}\nnote = "n"\n')
    refused(p, "scene 1", "minutes must be a positive number")


def test_scene_minutes_must_sum_to_the_lessons(tmp_path):
    refused(write(tmp_path, [(2, "n", ""), (3, "n", "")], minutes=6), "lesson",
            "the scenes' minutes sum to 5, not the lesson's 6")


def test_no_scenes_unknown_fields_and_missing_note(tmp_path):
    p = tmp_path / "e.toml"
    p.write_text('title = "T"\nminutes = 1\n')
    refused(p, "no scenes")
    p.write_text('title = "T"\nminutes = 1\nauthor = "me"\n')
    refused(p, "unknown field 'author'")
    p.write_text('title = "T"\nminutes = 1\n[[scene]]\ntitle = "S"\nminutes = 1\n')
    refused(p, "scene 1", "note is missing")
    p.write_text('title = "T"\nminutes = 1\n[[scene]]\ntitle = "S"\nminutes = 1\nnote = "n"\n'
                 'speaker = "x"\n')
    refused(p, "scene 1", "unknown field 'speaker'")


def test_an_unknown_query_key_names_the_scene(tmp_path):
    p = write(tmp_path, [(1, "n", ""), (1, "n", 'colour = "red"')])
    refused(p, "scene 2", "unknown query key 'colour'")


@pytest.mark.parametrize("state, words", [
    ('step = "soon"', ["step='soon' is not an integer"]),
    ('a = "lru"', ["unknown policy 'lru' for a"]),
    ("zoom = 7", ["zoom=7 is not one of"]),
    ('b = "snapkv"\n"b.poolKernel" = 99', ["poolKernel=99 is outside"]),
    ('b = "snapkv"\n"b.colour" = 1', ["has no parameter 'colour'"]),
    ('"slides.steps" = "1"', ["slides.steps='1' is not two integers"]),
])
def test_any_value_from_query_drops_or_changes_is_an_error(tmp_path, state, words):
    refused(write(tmp_path, [(1, "n", state)]), "scene 1", "exactly as written", *words)


def test_state_values_are_strings_or_numbers_and_not_the_bars_keys(tmp_path):
    refused(write(tmp_path, [(1, "n", "step = [1, 2]")]), "state.step", "a string or a number")
    for key in ("lesson", "scene", "follow", "present"):
        refused(write(tmp_path, [(1, "n", f'{key} = "1"')]), f"state.{key}", "set by the lesson bar")


def test_unknown_view_trace_and_a_refused_budget(tmp_path):
    refused(write(tmp_path, [(1, "n", 'view = "pie"')]), "state.view", "unknown view 'pie'")
    refused(write(tmp_path, [(1, "n", 'trace = "file:nope.npz"')]), "state.trace",
            "unknown trace 'file:nope.npz'", "toy.npz")
    refused(write(tmp_path, [(1, "n", 'trace = "upload:abc"')]), "unknown trace 'upload:abc'")
    refused(write(tmp_path, [(1, "n", 'trace = "file:toy.npz"\nbudget = 4\nb = "snapkv"')]),
            "state.b", "snapkv refuses budget 4", "recent_window")


@pytest.mark.parametrize("state, words", [
    ('trace = "file:prose.npz"\nlayer = 5', ["state.layer", "layer 5 is not stored", "0, 14, 29"]),
    ('trace = "file:prose.npz"\nhead = "kv9"', ["state.head", "kv9"]),
    ('trace = "file:toy.npz"\nb = "tova"\nbudget = 17', ["state.budget: 17 is outside 1–16"]),
    ('trace = "file:toy.npz"\nstep = 16', ["state.step: 16 is not a step of file:toy.npz (0–15)"]),
    ('trace = "file:toy.npz"\ntrack = 20', ["state.track: 20 is not a position"]),
    ('trace = "file:toy.npz"\nstep = 3\nfocus = 5', ["state.focus: position 5 is not generated "
                                                     "until step 5 (the scene shows step 3)"]),
    ('view = "tokens"', ["state.view: canonical has no tokens"]),
    ('trace = "file:toy.npz"\n"slides.steps" = "3,16"', ["state.slides.steps: 3,16 is not a range"]),
    ('trace = "file:toy.npz"\n"slides.steps" = "9,3"', ["state.slides.steps: 9,3 is not a range"]),
    ('"slides.kind" = "tokens"', ["state.slides.kind: 'tokens' is not one of heatmap"]),
    ('"slides.frames" = 999', ["state.slides.frames: 999 is outside 0–240"]),
])
def test_what_the_page_would_change_on_the_trace_is_an_error(tmp_path, state, words):
    refused(write(tmp_path, [(1, "n", state)]), "scene 1", *words)


def test_unknown_loop_result_policy_line_and_budget(tmp_path):
    refused(write(tmp_path, [(1, "n", 'view = "loop"\nloop = "nope"')]), "state.loop",
            "unknown loop result 'nope'", "prose-layer")
    refused(write(tmp_path, [(1, "n", 'view = "loop"\nloop = "prose-layer"\n"loop.policy" = "lru"')]),
            "state.loop.policy", "'lru' is not a policy line of prose-layer")
    refused(write(tmp_path, [(1, "n", 'view = "loop"\nloop = "prose-layer"\n"loop.policy" = "tova"\n'
                                      '"loop.budget" = 65')]),
            "state.loop.budget", "65 is not a budget of tova in prose-layer (64, 128, 256)")


def test_needle_values_must_be_the_results(tmp_path):
    refused(write(tmp_path, [(1, "n", 'view = "needle"\nnbudget = 100')]), "state.nbudget",
            "'100' is not one of the needle results' values")
    refused(write(tmp_path, [(1, "n", 'view = "needle"\nnpol = "lru"')]), "state.npol",
            "'lru' is not a policy line")


def test_placeholders_unknown_formatted_or_without_their_state(tmp_path):
    refused(write(tmp_path, [(1, "A drops {victim.a}", toy())]), "scene 1",
            "unknown placeholder {victim.a}", "{victims.a}")
    refused(write(tmp_path, [(1, "{step:>5}", toy())]), "{step} takes no format")
    refused(write(tmp_path, [(1, "a { b", toy())]), "scene 1", "note:", "literal brace")
    refused(write(tmp_path, [(1, "{victims.a}", 'trace = "file:toy.npz"\nbudget = 4\nb = "tova"')]),
            "placeholder {victims.a} needs state.step")
    refused(write(tmp_path, [(1, "{loop.ppl}", 'view = "loop"\nloop = "prose-layer"')]),
            "{loop.ppl} needs state.loop.policy")
    refused(write(tmp_path, [(1, "{needle.right}", 'view = "needle"\nnbudget = 128')]),
            "{needle.right} needs state.nmode")
    # doubled braces are literal text
    les = L.load(write(tmp_path, [(1, "{{step}} is {step}", toy(4))]))
    assert L.note_text(les, 1) == "{step} is 4"


def test_every_placeholder_has_a_docstring_and_a_kind():
    assert {"victims.a", "victims.b", "held.a", "held.b", "retained.a", "retained.b", "why",
            "pooling", "next.a", "loop.ppl", "needle.right"} <= set(L.PLACEHOLDERS)
    for name, ph in L.PLACEHOLDERS.items():
        assert ph.doc and ph.kind in L.NEEDS, name


def test_a_note_that_cannot_be_computed_names_the_scene_and_placeholder(tmp_path):
    les = L.load(write(tmp_path, [(1, "{pooling}", toy(4))]))  # nothing defended at step 4
    with pytest.raises(ValueError, match=r"t.toml: scene 1: \{pooling\}: .*no slot is defended "
                                         r"by pooling at step 4"):
        L.note_text(les, 1)
    les = L.load(write(tmp_path, [(1, "{why}", 'trace = "file:toy.npz"\nbudget = 4\n'
                                                'b = "tova"\nstep = 9')]))
    with pytest.raises(ValueError, match=r"scene 1: \{why\}: .*A and B never evict differently"):
        L.note_text(les, 1)


# --- placeholders against the library, computed here --------------------------------------
def stepped(trace, name, budget, params):
    """victims per step from a fresh Replay stepped one step at a time."""
    rp = Replay(trace, make_policy(name, budget=budget, **params))
    return [sorted(int(v) for v in rp.step()) for _ in range(trace.steps)]


def words(ps):
    return ("nothing" if not ps else f"position {ps[0]}" if len(ps) == 1 else
            "positions " + ", ".join(map(str, ps[:-1])) + f" and {ps[-1]}")


def held_after(victims, step):
    gone = {p for s in range(step + 1) for p in victims[s]}
    return [p for p in range(step + 1) if p not in gone]


_FACTS: dict = {}


def value(les, n, name):
    """A placeholder's value on scene n; one Facts per scene (each builds the scene's replays)."""
    key = (id(les), n)
    if key not in _FACTS:
        _FACTS[key] = (les, L.Facts(les.scene(n)))  # the lesson kept, so its id stays its own
    return L.PLACEHOLDERS[name].fn(_FACTS[key][1])


@pytest.fixture(scope="module")
def shipped():
    return L.load(SHIPPED)


def test_trace_placeholders_equal_a_fresh_replay(shipped):
    for n in range(1, len(shipped.scenes) + 1):
        s = shipped.scene(n)
        if s.state.view in ("loop", "needle"):
            continue
        trace = load_trace(ROOT / "traces" / s.state.trace[5:], layer=s.state.layer)
        step, budget = s.state.step, s.state.budget
        vic = {w: stepped(trace, getattr(s.state, w), budget, s.state.params(w)) for w in "ab"}
        for w in "ab":
            # a victim the tie-break chose is said to be one after its position (test_ties)
            said = value(shipped, n, f"victims.{w}").split(" (not chosen by its score", 1)[0]
            assert said == words(vic[w][step]), (n, w)
            assert value(shipped, n, f"held.{w}") == str(len(held_after(vic[w], step)))
            # what the page's ask button asks at this step: the first eviction after it
            nxt = next(((t, vic[w][t]) for t in range(step + 1, trace.steps) if vic[w][t]), None)
            assert value(shipped, n, f"next.{w}").split(" (not chosen by its score", 1)[0] == (
                f"{words(nxt[1])} at step {nxt[0]}" if nxt else
                "nothing (it evicts nothing from here on)")
        ha, hb = set(held_after(vic["a"], step)), set(held_after(vic["b"], step))
        assert value(shipped, n, "diff") == str(len(ha ^ hb))
        first = next((t for t in range(trace.steps) if vic["a"][t] != vic["b"][t]), None)
        assert value(shipped, n, "first_divergence") == str(first)
        assert value(shipped, n, "budget") == str(budget) and value(shipped, n, "step") == str(step)


def retained_by_hand(trace, victims):
    """Mean over steps after the first eviction of row t's mass on positions held when
    query t was made (after step t-1), from the rows themselves."""
    first = next(t for t in range(trace.steps) if victims[t])
    shares = []
    for t in range(first + 1, trace.steps):
        row = trace.row(t).astype(np.float64)
        held = held_after(victims, t - 1)
        shares.append(row[held].sum() / row.sum())
    return float(np.mean(shares))


def test_retained_is_the_rows_mass_on_what_is_held(shipped):
    n = next(s.number for s in shipped.scenes if s.state.view == "metrics")
    s = shipped.scene(n)
    trace = load_trace(ROOT / "traces" / s.state.trace[5:], layer=s.state.layer)
    for w in "ab":
        vic = stepped(trace, getattr(s.state, w), s.state.budget, s.state.params(w))
        assert abs(float(value(shipped, n, f"retained.{w}")) - retained_by_hand(trace, vic)) <= 5e-4
        assert s.note.count(f"{{retained.{w}}}")


def test_pooling_and_why_are_the_explanations_at_the_scenes_step(shipped):
    from kvviz.app import explain

    for n in (3, 7):
        s = shipped.scene(n)
        trace = load_trace(ROOT / "traces" / s.state.trace[5:], layer=s.state.layer)
        rp = Replay(trace, make_policy("snapkv", budget=s.state.budget, **s.state.params("b")))
        rp.seek(s.state.step - 1)
        kept, scores = rp.peek(s.state.step)
        victims = rp.step()
        d = explain.defended(kept, scores, victims)
        pos = s.state.focus if s.state.focus in set(d.tolist()) else int(d[0])
        f = explain.pooling_facts(kept, scores, victims, pos, s.state.params("b"), s.state.step)
        assert value(shipped, n, "pooling") == explain.pooling_text(f)
        assert value(shipped, n, "defended") == words(sorted(d.tolist()))
    text = value(shipped, 4, "why")
    assert text.startswith("Position ") and "A evicted it" in text


def test_loop_placeholders_are_the_results_json(shipped):
    for n in [s.number for s in shipped.scenes if s.state.view == "loop"]:
        st = shipped.scene(n).state
        data = json.loads((ROOT / "traces" / "loop" / f"{st.loop}.json").read_text())
        full = next(r for r in data["results"] if r["policy"] == "full")
        # the scene's line is the policy at its card's defaults (stored in full here)
        row = next(r for r in data["results"] if r["policy"] == st.loop_policy
                   and all(r["params"].get(k, v) == v for k, v in defaults(st.loop_policy).items())
                   and r["budget"] == st.loop_budget)
        assert value(shipped, n, "loop.ppl") == f"{row['perplexity']:.3f}"
        assert value(shipped, n, "loop.full_ppl") == f"{full['perplexity']:.3f}"
        assert value(shipped, n, "loop.top1") == f"{100 * row['top1_agreement']:.1f}%"
        assert value(shipped, n, "loop.kl") == f"{row['kl']:.4f}"
        assert value(shipped, n, "loop.first_eviction") == str(row["first_eviction"])


def test_needle_placeholders_are_the_results_csv(shipped):
    n = next(s.number for s in shipped.scenes if s.state.view == "needle")
    c = shipped.scene(n).state.needle
    with open(ROOT / "traces" / "needle" / "results.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if int(r["length"]) == int(c["nlen"])
                and float(r["depth"]) == float(c["ndepth"]) and int(r["seed"]) == int(c["nseed"])
                and r["prompt_mode"] == c["nmode"] and r["granularity"] == c["ngran"]]
    at = [r for r in rows if int(r["budget"]) == int(c["nbudget"])]

    def line(r):  # the page's name for a row (the facts, right or wrong, are the CSV's)
        from kvviz.studies.forgetting import line_label

        return line_label(r["policy"], r["params"])

    right = sorted({line(r) for r in at if r["correct"] == "True"})
    wrong = sorted({line(r) for r in at if r["correct"] != "True"})
    assert value(shipped, n, "needle.right") == (", ".join(right) or "none")
    assert value(shipped, n, "needle.wrong") == (", ".join(wrong) or "none")
    assert value(shipped, n, "needle.key") == rows[0]["key"]
    full = next(r for r in rows if r["policy"] == "full")
    assert value(shipped, n, "needle.full") == ("right" if full["correct"] == "True" else "wrong")


# --- the shipped lesson ------------------------------------------------------------------
def test_the_shipped_lesson_walks_from_the_toy_to_the_forgetting_view(shipped):
    assert shipped.title == "TOVA against SnapKV" and shipped.minutes == 50
    assert 8 <= len(shipped.scenes) <= 14
    assert sum(s.minutes for s in shipped.scenes) == 50
    views = [s.state.view for s in shipped.scenes]
    traces = [s.state.trace for s in shipped.scenes]
    assert traces[0] == "file:toy.npz" and "file:prose.npz" in traces
    assert traces.index("file:prose.npz") > 0
    assert {"scores", "loop", "needle"} <= set(views)
    assert views.index("loop") < views.index("needle")
    pooled = [s for s in shipped.scenes if s.state.view == "scores" and s.state.b == "snapkv"]
    assert pooled and any("{pooling}" in s.note for s in pooled)
    for s in shipped.scenes:
        assert "Say:" in s.note and "Ask" in s.note, s.number
        assert L.note_text(shipped, s.number)  # every note computes
    assert L.link("tova-vs-snapkv", 3) == "?lesson=tova-vs-snapkv&scene=3"


def test_lessons_are_found_by_the_paths_rule(tmp_path, monkeypatch):
    from kvviz.core import paths

    monkeypatch.delenv("KVVIZ_LESSONS_DIR", raising=False)
    monkeypatch.chdir(ROOT)
    assert paths.lessons_dir() == ROOT / "lessons" and L.names() == ["tova-vs-snapkv"]
    write(tmp_path, [(1, "n", "")], name="mine.toml")
    monkeypatch.setenv("KVVIZ_LESSONS_DIR", str(tmp_path))
    assert paths.lessons_dir() == tmp_path and L.names() == ["mine"]
    assert L.load("mine").title == "T"
    with pytest.raises(ValueError, match=r"lesson 'nope': no file nope.toml in the lessons "
                                         r"folder \(lessons: mine\)$") as refusal:
        L.load("nope")
    assert str(tmp_path) not in str(refusal.value)


def test_the_page_lists_lessons_as_the_library_does(tmp_path):
    """The page's picker reads a folder's listing through kvviz.app.ui.compute.listing (listed
    again when the folder changes); its lesson names are the library's rule over those."""
    from kvviz.app.ui.compute import listing

    for name in ("b.toml", "a.toml", "notes.txt"):
        (tmp_path / name).write_text("")
    other = tmp_path / "other"
    other.mkdir()
    (other / "c.toml").write_text("")
    assert L.names(listing(str(tmp_path), "*.toml")) == ["a", "b"]
    assert L.names(listing(str(other), "*.toml")) == ["c"]  # one listing per folder
    assert L.names([p.name for p in tmp_path.iterdir()]) == ["a", "b"]
    (tmp_path / "d.toml").write_text("")  # seen at once: the folder changed
    assert L.names(listing(str(tmp_path), "*.toml")) == ["a", "b", "d"]
    (tmp_path / "a.toml").rename(tmp_path / "e.toml")
    assert L.names(listing(tmp_path, "*.toml")) == ["b", "d", "e"]
    assert listing(str(tmp_path / "none"), "*.toml") == []
    with pytest.raises(ValueError, match="not a lesson name"):
        L.path_of("../x")


# --- the CLI -----------------------------------------------------------------------------
def test_cli_list_and_check(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("KVVIZ_LESSONS_DIR", raising=False)
    assert main(["lesson", "list"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"tova-vs-snapkv · {len(L.load(SHIPPED).scenes)} scenes · 50 min · TOVA against SnapKV")
    assert main(["lesson", "check", str(SHIPPED)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == len(L.load(SHIPPED).scenes) + 1
    assert out[0].startswith("scene  1 · 3 min · cache · file:toy.npz · ")
    assert out[-1] == (f"tova-vs-snapkv.toml: TOVA against SnapKV, "
                       f"{len(L.load(SHIPPED).scenes)} scenes, 50 min: ok")
    bad = write(tmp_path, [(1, "{victim.a}", toy())])
    assert main(["lesson", "check", str(bad)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1
    assert cap.err.startswith("error: t.toml: scene 1: note: unknown placeholder {victim.a}")


# --- questions decided by evidence -----------------------------------------------------------
def _margin_by_hand(row, kept, evicted):
    """TOVA's evidence from the trace's row alone: its score is the current step's weight of
    each earlier position (the new token has none and is no candidate)."""
    w = np.asarray(row, np.float64)
    gone = [w[p] for p in evicted]
    rest = sorted((w[p], p) for p in kept if p not in evicted and p < len(w))
    return max(gone), rest[0]


def test_a_question_within_five_percent_of_its_runner_up_is_refused(tmp_path):
    """The prose trace, SnapKV without pooling against SnapKV, at step 299: A's next victim
    (step 300) scores within 0.1 % of the slot it keeps with the lowest score."""
    state = ('trace = "file:prose.npz"\nlayer = 0\nbudget = 128\na = "snapkv"\n'
             '"a.poolKernel" = 1\nb = "snapkv"\nstep = {step}\nview = "cache"\n')
    bad = L.load(write(tmp_path, [(1, "Ask: {next.a}", state.format(step=299))]))
    with pytest.raises(ValueError) as e:
        L.check_evidence(bad)
    msg = str(e.value)
    assert msg.startswith("t.toml: scene 1: question \"which position will A evict next?"), msg
    assert "position 176 at step 300" in msg and "position 232" in msg and "5 % below" in msg
    ev = L.question_evidence(L.Facts(bad.scene(1)), "a")
    assert 0 < ev.margin < 0.05 and ev.answer == (176,) and ev.runner_up == 232
    # the same scene ten steps earlier: clear evidence on both sides
    good = L.load(write(tmp_path, [(1, "Ask: {next.a}", state.format(step=289))], name="g.toml"))
    L.check_evidence(good)
    for w in "ab":
        assert L.question_evidence(L.Facts(good.scene(1)), w).margin >= L.CLEAR


def test_a_tied_question_is_refused(tmp_path):
    """The prose trace at step 131: SnapKV's next victim, 14, scores exactly as 15 (pooled)."""
    state = ('trace = "file:prose.npz"\nlayer = 0\nbudget = 128\na = "tova"\nb = "snapkv"\n'
             'step = 131\nview = "cache"\n')
    les = L.load(write(tmp_path, [(1, "Say.", state)]))
    with pytest.raises(ValueError, match=r"scene 1: question \"which position will B evict next"
                       r"\? \(asked at step 131\)\": the answer, position 14 at step 132 "
                       r"\(.*\), ties with position 15"):
        L.check_evidence(les)


def test_evidence_is_the_policys_own_scores(tmp_path):
    """TOVA's evidence, against the toy trace's own row: the answer's weight and the lowest
    weight among the other positions it holds at the answer's step."""
    les = L.load(write(tmp_path, [(1, "Say.", toy(3))]))
    facts = L.Facts(les.scene(1))
    ev = L.question_evidence(facts, "a")
    row = load_trace(ROOT / "traces" / "toy.npz").row(ev.answer_step)
    held = [p for p in range(ev.answer_step + 1)
            if facts.engine("a").evicted_at[p] >= ev.answer_step]
    score, (rscore, rpos) = _margin_by_hand(row, held, ev.answer)
    assert ev.runner_up == rpos
    # the same margin whatever the scores' normalisation
    assert ev.margin == pytest.approx((rscore - score) / rscore)
    assert ev.score / ev.runner_score == pytest.approx(score / rscore)


def _tied_by_hand(panel, victim) -> bool:
    """Whether `victim` scores exactly as a candidate the policy keeps at the panel's step, by
    the policy's ranking key read straight from its scores."""
    from kvviz.core.policies import rank_of

    vals = np.asarray(panel["scores"][rank_of(panel["policy"]).key], np.float64)
    kept = np.asarray(panel["kept"])
    cand = np.asarray(panel["scores"].get("candidate", np.ones(len(kept), bool)), bool)
    stays = cand & ~np.isin(kept, panel["victims"])
    return bool((vals[stays] == vals[kept == victim][0]).any())


PROSE = ('trace = "file:prose.npz"\nlayer = 0\nbudget = 128\na = "tova"\nb = "snapkv"\n'
         'step = {step}\nview = "cache"\n')


def test_a_scene_opening_on_a_tie_break_is_refused(tmp_path):
    """The prose trace at step 130: SnapKV evicts position 2 there, scored exactly as a slot it
    keeps, so the page opens on an eviction the tie-break decided (both questions asked from
    there are clear, so only the opening is at fault)."""
    les = L.load(write(tmp_path, [(1, "Say.", PROSE.format(step=130))]))
    facts = L.Facts(les.scene(1))
    panel = facts.panel("b", 130)
    assert list(panel["victims"]) == [2] and _tied_by_hand(panel, 2)
    for w in "ab":
        assert L.question_evidence(facts, w).margin >= L.CLEAR
    with pytest.raises(ValueError, match=r"^t\.toml: scene 1: the first eviction the page shows "
                       r"is a tie: B \(snapkv\) evicts position 2 at step 130 with "
                       r"pooled window sum .*; its score did not choose it"):
        L.check_evidence(les)
    # the shipped scene's step on the same trace opens on evictions their scores decided
    good = L.load(write(tmp_path, [(1, "Say.", PROSE.format(step=158))], name="g.toml"))
    L.check_evidence(good)
    for w in "ab":
        step, ties = L.opening_eviction(L.Facts(good.scene(1)), w)
        assert step == 158 and ties == []
        panel = L.Facts(good.scene(1)).panel(w, 158)
        assert not any(_tied_by_hand(panel, v) for v in panel["victims"])


def test_a_scene_before_its_first_eviction_is_read_at_that_eviction(tmp_path):
    """Opened at step 3 of the toy trace (budget 4: nothing evicted yet), a page's first
    eviction is each policy's first: step 4, the first step with more tokens than slots."""
    les = L.load(write(tmp_path, [(1, "Say.", toy(3))]))
    for w in "ab":
        step, ties = L.opening_eviction(L.Facts(les.scene(1)), w)
        assert step == 4 and ties == []


def test_the_default_page_opens_on_a_tie_break():
    """The known exception: a link with no keys opens the canonical trace at budget 512 on
    TOVA and SnapKV, whose first evictions (step 512, the first step with more tokens than
    slots) both went to the tie-break; the check says so for the default page."""
    page = L.default_page()
    assert (page.state.trace, page.state.budget, page.state.a, page.state.b) == (
        "canonical", 512, "tova", "snapkv")
    facts = L.Facts(page)
    for w in "ab":
        step, ties = L.opening_eviction(facts, w)
        panel = facts.panel(w, step)
        assert step == 512 and ties and all(_tied_by_hand(panel, t.position) for t in ties)
    with pytest.raises(ValueError, match=r"the default page: the first eviction the page shows "
                       r"is a tie: A \(tova\) evicts position \d+ at step 512"):
        L.check_opening(Path("default"), "the default page", facts)


def test_the_shipped_lessons_questions_are_clear():
    for name in L.names():
        L.check_evidence(L.load(name))


def test_the_teaching_guide_says_the_lessons_own_numbers():
    """docs/teaching.md walks the shipped lesson: its minutes, its number of scenes, each
    scene's minutes and the steps it names are the lesson file's."""
    les = L.load(SHIPPED)
    doc = (ROOT / "docs" / "teaching.md").read_text()
    n, total = len(les.scenes), les.minutes
    assert f"({total:g} minutes, {n} scenes)" in doc
    assert f"they add up to {total:g}" in doc
    assert f"{n} scenes, {total:g} min: ok" in doc
    said = {int(m) for m in re.findall(r"Scene 1 of (\d+)", doc)}
    assert said == {n}, said
    rows = [r for r in doc.splitlines() if re.match(r"\| \d+ \| [\d.]+ \|", r)]
    assert [int(r.split("|")[1]) for r in rows] == list(range(1, n + 1))
    for r, s in zip(rows, les.scenes):
        cells = [c.strip() for c in r.split("|")]
        assert float(cells[2]) == s.minutes, (s.number, cells[2])
        for step in re.findall(r"\bstep (\d+)\b", cells[3]):
            assert int(step) == s.state.step, (s.number, cells[3])
