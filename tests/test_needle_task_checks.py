"""The needle tasks without a model: the answer checks on hand-written answers, the option
refusals that need no tokenizer, the results columns and the full-cache gate on hand-built
runs, and the reminder-attention arithmetic on hand-made attention."""
import json

import numpy as np
import pytest

from kvviz.__main__ import main
from kvviz.model.needle import load_results
from kvviz.model.needle.results import gate, layer_table, run_id, save_run, write_tables
from kvviz.model.needle.tasks import (
    Task,
    distractor_depths,
    draw_phrase,
    draw_things,
    score_distractors,
    score_key,
    score_phrase,
)
from lab.reminder_attention import key_attention, query_rows

NAMES, KEYS = ["Hugo", "Nora"], ["53407", "33040"]


@pytest.mark.parametrize("answer, outcome, detail", [
    (" 42400. The", "right", ""),
    (" 33040. Remember", "distractor", "Nora"),
    (" 53407 or 42400", "distractor", "Hugo"),     # the first key said decides
    (" 42400, not 53407", "right", ""),
    (" 4240. The pass", "no key", ""),
    (" the pass key of", "no key", ""),
])
def test_distractor_check(answer, outcome, detail):
    s = score_distractors(answer, "42400", NAMES, KEYS)
    assert (s.outcome, s.detail, s.correct) == (outcome, detail, outcome == "right")


@pytest.mark.parametrize("answer, outcome, detail", [
    (" thunder falcon amber maple. The", "whole", "thunder falcon amber maple"),
    (" Thunder, falcon, amber, maple!", "whole", "thunder falcon amber maple"),
    (" thunder falcon maple. The pass", "partial", "thunder falcon maple"),
    (" amber thunder maple", "partial", "thunder maple"),  # in order: amber comes before thunder
    (" maple amber falcon thunder", "partial", "thunder"),
    (" thunder falcon amber", "partial", "thunder falcon amber"),
    (" thunder falcon river amber maple", "partial", "thunder falcon amber maple"),  # not consecutive
    (" the pass phrase is", "lost", ""),
])
def test_phrase_check(answer, outcome, detail):
    s = score_phrase(answer, "thunder falcon amber maple")
    assert (s.outcome, s.detail, s.correct) == (outcome, detail, outcome == "whole")


def test_key_check():
    assert score_key(" 42400. Remember", "42400").outcome == "right"
    assert score_key(" 4240", "42400") .outcome == "wrong" and not score_key(" 4240", "42400").correct


def test_draws_are_seeded_and_distinct():
    assert draw_phrase(3, 4) == draw_phrase(3, 4) and len(set(draw_phrase(3, 6))) == 6
    assert draw_phrase(3, 4) != draw_phrase(4, 4)
    names, keys = draw_things(7, 3)
    assert (names, keys) == draw_things(7, 3) and len(set(names)) == len(set(keys)) == 4
    assert all(len(k) == 5 and k[0] != "0" for k in keys)


def test_distractor_depths():
    assert distractor_depths(10, 2) == pytest.approx([100 / 3, 200 / 3])
    assert distractor_depths(50, 3) == [25, 62.5, 75]   # 50 shares the asked key's place: half a gap (12.5) on
    assert distractor_depths(80, 3) == [25, 50, 92.5]   # |75 - 80| < 12.5
    assert distractor_depths(60, 1) == [85]
    assert distractor_depths(90, 1) == [50]


@pytest.mark.parametrize("argv, message", [
    (["--task", "needles"], "--task: unknown task 'needles'; known: passkey, recall, distractors, phrase"),
    (["--task", "recall", "--reminder-every", "0"], "--reminder-every must be an integer >= 1, got 0"),
    (["--task", "phrase", "--phrase-words", "0"], "--phrase-words must be an integer >= 1, got 0"),
    (["--task", "distractors", "--distractors", "-1"], "--distractors must be an integer >= 0, got -1"),
    (["--task", "phrase", "--reminder-every", "5"], "--reminder-every: only --task recall takes it, not --task phrase"),
    (["--distractors", "2"], "--distractors: only --task distractors takes it, not --task passkey"),
    (["--task", "recall", "--phrase-words", "3"], "--phrase-words: only --task phrase takes it, not --task recall"),
    (["--task", "phrase", "--phrase-words", "31"], "--phrase-words 31: the phrase's words are drawn without repeats"),
    (["--task", "distractors", "--distractors", "16"], "--distractors 16: the keys belong to 16 names, so at most 15"),
])
def test_task_refusals_before_anything_loads(tmp_path, capsys, monkeypatch, argv, message):
    import kvviz.model.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: pytest.fail("the tokenizer loaded"))
    code = main(["needle", "--out", str(tmp_path / "out"), "--policies", "tova", "--budgets", "64", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_task_defaults_and_ids():
    assert Task().prefix == "" and Task().option is None
    assert Task("recall").reminder_every == 20 and Task("recall", reminder_every=5).prefix == "recall5-"
    assert Task("distractors").option == 2 and Task("phrase").prefix == "phrase4-"


def _save(out, task: dict, answers, ev, key="42400", length=20, seed=0):
    """T0 = 20, question at 16, key at 3..4; 2 layers, 1 head; full, then tova@8."""
    prefix = "" if task["task"] == "passkey" else f"{task['task']}x-"
    meta = {"id": prefix + run_id(length, 50, seed, "prefill", "layer"), "length": length, "depth": 50,
            "seed": seed, "prompt_mode": "prefill", "granularity": "layer", "key": key,
            "key_positions": [3, 4], "question_start": 16, "prompt_len": 20, "max_new_tokens": 2,
            "configs": [{"policy": "full", "params": {}, "budget": None, "label": "full"},
                        {"policy": "tova", "params": {}, "budget": 8, "label": "tova@8"}],
            "answers": answers, "correct": [False, False], "layers": 2, "kv_heads": 1,
            "model": {"model": "hand-built"}, **task}
    save_run(out, meta, np.arange(20), [str(i) for i in range(20)], np.zeros((2, 2)), ev)


def test_results_columns_for_each_task(tmp_path):
    ev = np.full((2, 2, 1, 22), -1, np.int32)
    ev[1, 0, 0, [3, 10, 11]] = 19   # tova: layer 0 loses a key token and Hugo's two key tokens
    dis = {"task": "distractors", "distractors": 2, "target": "Greta", "distractor_names": NAMES,
           "distractor_keys": KEYS, "distractor_positions": [[10, 11], [13, 14]]}
    _save(tmp_path, dis, [" 42400.", " 53407."], ev)
    rec = {"task": "recall", "reminder_every": 5, "reminders": [[6, 9], [12, 15]]}
    _save(tmp_path, rec, [" 42400.", " 4240"], ev)
    phr = {"task": "phrase", "phrase_words": 2}
    _save(tmp_path, phr, [" amber maple.", " maple."], ev, key="amber maple")
    write_tables(tmp_path)
    df = load_results(tmp_path).set_index(["task", "label"])
    d = df.loc[("distractors", "tova@8")]
    assert (d.outcome, d.detail, d.correct, d.target) == ("distractor", "Hugo", False, "Greta")
    assert d.distractors == 2 and d.reminder_every == -1 and d.phrase_words == -1
    assert d.distractor_positions == [[10, 11], [13, 14]] and d.distractor_keys == KEYS
    assert d.distractors_held_end == pytest.approx(1 - 2 / 8)  # 2 of 4 positions x 2 layers lost
    assert df.loc[("distractors", "full")].outcome == "right" and df.loc[("distractors", "full")].correct
    r = df.loc[("recall", "tova@8")]
    assert (r.outcome, r.reminders, r.reminder_positions, r.reminder_every) == ("wrong", 2, [6, 12], 5)
    assert r.distractors_held_end == -1 and r.key_positions == [3, 4]
    p = df.loc[("phrase", "tova@8")]
    assert (p.outcome, p.detail, p.held_end) == ("partial", "maple", 0.75)
    assert df.loc[("phrase", "tova@8")].held_end_by_layer == [0.5, 1.0]
    assert set(layer_table(tmp_path).task) == {"distractors", "recall", "phrase"}
    from lab import needle_report

    kept, _ = needle_report.gated(tmp_path, "distractors")
    t = needle_report.task_outcome_table(needle_report.prepare(kept)).set_index("name")
    assert t.loc["tova", "distractor"] == 1 and t.loc["tova", "right"] == 0
    assert t.loc["tova", "distractors held"] == pytest.approx(0.75) and t.loc["tova", "whole span"] == 0
    assert t.loc["full cache", "right"] == 1
    _, doc = needle_report.report(tmp_path, "phrase")
    assert "## The phrase task's answer check" in doc and "A run is right when the whole phrase appears" in doc


def test_an_old_results_file_loads_as_the_pass_key(tmp_path):
    old = ("id,length,depth,seed,prompt_mode,granularity,policy,label,params,budget,key,answer,correct,agreement,"
           "held_question,held_end,layers_whole,first_lost,held_by_layer,held_end_by_layer,first_lost_by_layer,"
           "held_by_head\nL10-d50-s0-decode-layer,10,50,0,decode,layer,full,full,{},-1,12,12,True,1.0,1.0,1.0,"
           "2,-1,\"[1.0]\",\"[1.0]\",\"[-1]\",\"[[1.0]]\"\n")
    (tmp_path / "results.csv").write_text(old)
    df = load_results(tmp_path)
    assert df.task.tolist() == ["passkey"] and df.held_by_layer[0] == [1.0]


def test_gate_keeps_the_lengths_the_full_cache_answers():
    import pandas as pd

    rows = []
    # recall at 256: full right in 4 of 5 prompts (80 %: kept); at 512: 3 of 5 (60 %: left out)
    for length, right in ((256, 4), (512, 3)):
        for i in range(5):
            rows += [{"task": "recall", "length": length, "policy": "full", "correct": i < right},
                     {"task": "recall", "length": length, "policy": "tova", "correct": False}]
    rows += [{"task": "passkey", "length": 512, "policy": "full", "correct": True}]
    kept, acc = gate(pd.DataFrame(rows))
    acc = acc.set_index(["task", "length"])
    assert acc.loc[("recall", 256)].full_accuracy == 0.8 and acc.loc[("recall", 256)].kept
    assert acc.loc[("recall", 512)].full_accuracy == 0.6 and not acc.loc[("recall", 512)].kept
    assert acc.loc[("passkey", 512)].kept and acc.loc[("recall", 256)].prompts == 5
    assert sorted(set(zip(kept.task, kept.length))) == [("passkey", 512), ("recall", 256)]
    assert len(kept) == 11


def test_report_leaves_out_a_length_the_full_cache_fails(tmp_path):
    from lab import needle_report

    ev = np.full((2, 2, 1, 22), -1, np.int32)
    for seed in range(5):  # 20 tokens: full right in all 5; 30 tokens: in 1 of 5
        _save(tmp_path, {"task": "passkey"}, [" 42400", " 1"], ev, length=20, seed=seed)
        _save(tmp_path, {"task": "passkey"}, [" 42400" if seed == 0 else " 7", " 1"], ev, length=30, seed=seed)
    write_tables(tmp_path)
    _, doc = needle_report.report(tmp_path)
    assert "- 20 tokens: full cache 100 % of 5 prompts, kept" in doc
    assert "- 30 tokens: full cache 20 % of 5 prompts, left out" in doc
    assert "Left out of every table and answer below: 30 tokens" in doc
    assert "What ran: 5 prompts (20 tokens;" in doc


def test_reminder_rows_and_key_attention_by_hand():
    inside, between = query_rows([(12, 14), (6, 8), (18, 20)], 24)
    assert inside == [6, 7, 12, 13, 18, 19] and between == [8, 9, 10, 11, 14, 15, 16, 17]
    with pytest.raises(ValueError, match="1 reminder"):
        query_rows([(6, 8)], 24)
    attn = np.zeros((2, 2, 6, 6))
    attn[0, :, 4, 1] = 0.5    # layer 0: row 4 gives the key (1, 2) 0.5 + 0.25 in both heads
    attn[0, :, 4, 2] = 0.25
    attn[0, 0, 5, 1] = 0.2    # row 5: 0.2 in head 0 only
    attn[1, 1, 5, 2] = 1.0
    assert key_attention(attn, [1, 2], [4]).tolist() == [0.75, 0.0]
    assert key_attention(attn, [1, 2], [4, 5]).tolist() == pytest.approx([(0.75 + 0.75 + 0.2 + 0) / 4, 0.25])
    assert json.dumps(key_attention(attn, [1, 2], [5]).tolist()) == "[0.1, 0.5]"


def test_reminder_study_refuses_a_bad_option_before_loading(capsys, monkeypatch):
    import kvviz.model.models as models
    from lab.reminder_attention import main as study

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert study(["--reminder-every", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --reminder-every must be an integer >= 1, got 0"]
