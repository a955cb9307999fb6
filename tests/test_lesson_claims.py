"""What a lesson's scenes may claim: a study's result quoted with the mark its answers file
gives it (never a secondary result as primary), and "forgets" only where a prompt shows it
(the full cache answers, the key's returns inside the eviction window)."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from kvviz.app.teach import lesson as L
from kvviz.studies import stats

ROOT = Path(__file__).resolve().parents[1]
ANSWERS = {"study": "synth", "claims": {"forgets": {"results": [
    {"id": "forgets", "status": "primary", "text": "[primary] tova against h2o: 7/28 against 17/28"},
    {"id": "forgets.1", "status": "secondary", "holm_p": 0.62,
     "text": "[secondary (Holm p = 0.62)] tova against h2o at budget 192: 4/30 against 11/30"}]}}}
RECALL = """view = "needle"
ntask = "recall3"
nbudget = {budget}
nmode = "decode"
ngran = "layer"
nlen = 256
ndepth = 10
nseed = {seed}
npol = "tova"
nvs = "h2o"
"""


def write(tmp_path, scenes):
    """A lesson of (title, note, state TOML) scenes, a minute each."""
    text = f'title = "T"\nminutes = {len(scenes)}\n'
    for title, note, state in scenes:
        text += (f"\n[[scene]]\ntitle = \"{title}\"\nminutes = 1\nnote = '''{note}'''\n"
                 f"[scene.state]\n{textwrap.dedent(state)}\n")
    path = tmp_path / "t.toml"
    path.write_text(text)
    return L.load(path)


@pytest.fixture
def study(tmp_path, monkeypatch):
    (tmp_path / "synth").mkdir()
    (tmp_path / "synth" / "answers.json").write_text(json.dumps(ANSWERS))
    monkeypatch.setattr(stats, "studies_dir", lambda: tmp_path)
    monkeypatch.setenv("KVVIZ_TASKS_DIR", str(ROOT / "traces" / "tasks"))
    monkeypatch.setenv("KVVIZ_NEEDLE_DIR", str(ROOT / "traces" / "needle"))
    monkeypatch.chdir(ROOT)
    return tmp_path


def test_a_result_is_quoted_with_its_own_mark(study, tmp_path):
    les = write(tmp_path, [("S", "Read out: {primary.synth.forgets}. Also {secondary.synth.forgets.1}.",
                            'view = "metrics"')])
    note = L.note_text(les, 1)
    assert "[primary] tova against h2o: 7/28 against 17/28" in note
    assert "[secondary (Holm p = 0.62)] tova against h2o at budget 192" in note
    L.check_claims(les)


def test_a_secondary_result_quoted_as_primary_fails(study, tmp_path, capsys):
    les = write(tmp_path, [("S", "Read out: {primary.synth.forgets.1}.", 'view = "metrics"')])
    with pytest.raises(ValueError, match=r"scene 1: \{primary.synth.forgets.1\}: quotes a secondary result as "
                                         r"primary: .*answers.json marks forgets.1 secondary, Holm p = 0.62 "
                                         r"\(quote it as \{secondary.synth.forgets.1\}\)"):
        L.note_text(les, 1)
    from kvviz.__main__ import main

    assert main(["lesson", "check", str(tmp_path / "t.toml")]) == 2
    assert "quotes a secondary result as primary" in capsys.readouterr().err


def test_calling_a_secondary_quote_primary_in_words_fails(study, tmp_path):
    les = write(tmp_path, [("S", "Say: the primary finding is {secondary.synth.forgets.1}. Then go on.",
                            'view = "metrics"')])
    with pytest.raises(ValueError, match=r"scene 1: note: the sentence .* calls \{secondary.synth.forgets.1\} "
                                         r"primary, and that result is secondary"):
        L.check_claims(les)
    # the tasks study's answers were not pre-registered: not primary either
    les = write(tmp_path, [("S", "Say: our primary result: {tasks.recall}.", 'view = "metrics"')])
    with pytest.raises(ValueError, match=r"calls \{tasks.recall\} primary, and that result is not pre-registered"):
        L.check_claims(les)
    # another sentence of the note may say "primary"
    les = write(tmp_path, [("S", "Say: the primary contrast comes later.\nRead out: {secondary.synth.forgets.1}.",
                            'view = "metrics"')])
    L.check_claims(les)


def test_an_unknown_result_or_study_is_named(study, tmp_path):
    les = write(tmp_path, [("S", "{primary.synth.nothing}", 'view = "metrics"')])
    with pytest.raises(ValueError, match=r"no result 'nothing' \(results: forgets, forgets.1\)"):
        L.note_text(les, 1)
    les = write(tmp_path, [("S", "{primary.other.forgets}", 'view = "metrics"')])
    with pytest.raises(ValueError, match=r"other/answers.json: no such file .*lab.study_report"):
        L.note_text(les, 1)


def test_forgets_needs_returns_inside_the_eviction_window(study, tmp_path):
    # budget 192 at 256 tokens: eviction starts at step 192; of the 7 reminders (78 ... 207)
    # only the last comes after it
    les = write(tmp_path, [("TOVA forgets the key", "Look.", RECALL.format(budget=192, seed=3))])
    with pytest.raises(ValueError, match=r"scene 1: it claims a policy forgets .* tova first evicts at step 192: "
                                         r"1 of the key's 7 returns falls inside the eviction window"):
        L.check_claims(les)
    # budget 128: eviction from step 128, four reminders after it (142, 164, 185, 207)
    les = write(tmp_path, [("TOVA forgets the key", "Look.", RECALL.format(budget=128, seed=0))])
    L.check_claims(les)
    # the note's words claim it as well as a title
    les = write(tmp_path, [("S", "Say: TOVA forgot it.", RECALL.format(budget=192, seed=3))])
    with pytest.raises(ValueError, match="1 of the key's 7 returns falls"):
        L.check_claims(les)
    # the Forgetting view's name is not a claim
    les = write(tmp_path, [("S", "Open the Forgetting view.", RECALL.format(budget=192, seed=3))])
    L.check_claims(les)


def test_forgets_needs_a_prompt_the_full_cache_answers(study, tmp_path):
    state = RECALL.format(budget=128, seed=0).replace("recall3", "distractors2").replace(
        'nmode = "decode"', 'nmode = "prefill"').replace("nlen = 256", "nlen = 512")
    les = write(tmp_path, [("H2O forgets the key", "Look.", state.replace("nseed = 0", "nseed = 13"))])
    with pytest.raises(ValueError, match="on a prompt the full cache gets wrong: that is the model's error"):
        L.check_claims(les)
    les = write(tmp_path, [("H2O forgets the key", "Look.", state)])
    L.check_claims(les)
    les = write(tmp_path, [("TOVA forgets", "Look.", 'view = "metrics"')])
    with pytest.raises(ValueError, match="shows no prompt: a forgetting scene is a needle view"):
        L.check_claims(les)


def test_the_shipped_lesson_claims_only_what_it_shows(study):
    L.check_claims(L.load(ROOT / "lessons" / "tova-vs-snapkv.toml"))
