"""The tasks study's report on hand-built runs: every count below is worked out by hand from
the runs written here, not read from the report's output."""
import json

import numpy as np
import pandas as pd
import pytest

from kvviz.model.needle.results import load_results, run_id, save_run, write_tables
from kvviz.studies.forgetting import load_answers
from lab import tasks_report as R

T0, L = 20, 2
PK = {5: {"pool_kernel": 5, "obs_window": 16}, 1: {"pool_kernel": 1, "obs_window": 16}}


def _save(out, task: dict, mode: str, configs, answers, ev, key="42400", seed=0, key_positions=(3, 4), length=T0):
    opt = task.get("reminder_every") or task.get("phrase_words") or task.get("distractors")
    prefix = f"{task['task']}{opt}-"
    configs = [{"policy": "full", "params": {}, "budget": None, "label": "full"}] + [
        {"policy": p, "params": q, "budget": b, "label": f"{p}{q}@{b}"} for p, q, b in configs]
    meta = {"id": prefix + run_id(length, 10, seed, mode, "layer"), "length": length, "depth": 10, "seed": seed,
            "prompt_mode": mode, "granularity": "layer", "key": key, "key_positions": list(key_positions),
            "question_start": length - 3, "prompt_len": length, "max_new_tokens": 2, "configs": configs,
            "answers": answers, "correct": [False] * len(configs), "layers": L, "kv_heads": 1,
            "model": {"model": "hand-built"}, "seconds": 2.0, **task}
    save_run(out, meta, np.arange(length), [str(i) for i in range(length)], np.zeros((len(configs), 2)), ev)


TRIO = [("tova", {}, 8), ("h2o", {}, 8), ("scissorhands", {}, 8)]
RIGHT, WRONG = " 42400.", " 4240"


def _recall(out):
    """K = 5, reminders at steps 8-9 and 14-15, three decode prompts:
    seed 0: TOVA wrong, H2O and Scissorhands right; seed 1: TOVA right, both wrong; seed 2: all right.
    TOVA loses a key token in layer 0 at step 12 (quiet) and in layer 1 at step 15 (a reminder's)."""
    rec = {"task": "recall", "reminder_every": 5, "reminders": [[8, 10], [14, 16]]}
    ev = np.full((4, L, 1, T0 + 2), -1, np.int32)
    ev[1, 0, 0, 3] = 12
    ev[1, 1, 0, 4] = 15
    for seed, (t, h, s) in enumerate([(WRONG, RIGHT, RIGHT), (RIGHT, WRONG, WRONG), (RIGHT, RIGHT, RIGHT)]):
        _save(out, rec, "decode", TRIO, [RIGHT, t, h, s], ev, seed=seed)
        # the same prompt in prefill mode: all three right on seed 0 only
        _save(out, rec, "prefill", TRIO, [RIGHT] + [RIGHT if seed == 0 else WRONG] * 3,
              np.full((4, L, 1, T0 + 2), -1, np.int32), seed=seed)
    # K = 20: no reminders; everyone wrong; a variant the full cache cannot do at all
    none = {"task": "recall", "reminder_every": 20, "reminders": []}
    _save(out, none, "decode", TRIO, [RIGHT, WRONG, WRONG, WRONG], ev, seed=0)
    bad = {"task": "recall", "reminder_every": 2, "reminders": [[8, 10]]}
    _save(out, bad, "decode", TRIO, [WRONG, WRONG, WRONG, WRONG], ev, seed=0)


def _phrase(out):
    """Two prompts; pk 5 holds the phrase whole and answers it; pk 1 loses one position in
    layer 1 and answers part of it on seed 0, all of it on seed 1."""
    phr = {"task": "phrase", "phrase_words": 2}
    ev = np.full((3, L, 1, T0 + 2), -1, np.int32)
    ev[2, 1, 0, 4] = T0 - 1
    cfg = [("snapkv", PK[5], 8), ("snapkv", PK[1], 8)]
    _save(out, phr, "prefill", cfg, [" amber maple", " amber maple", " maple"], ev, key="amber maple", seed=0)
    _save(out, phr, "prefill", cfg, [" amber maple", " amber maple", " amber maple"], ev, key="amber maple", seed=1)


def _distractors(out):
    """TOVA answers Hugo's key and held less of the asked key than of Hugo's; H2O answers none."""
    dis = {"task": "distractors", "distractors": 1, "target": "Greta", "distractor_names": ["Hugo"],
           "distractor_keys": ["53407"], "distractor_positions": [[10, 11]]}
    ev = np.full((3, L, 1, T0 + 2), -1, np.int32)
    ev[1, :, 0, 3] = T0 - 1
    _save(out, dis, "prefill", [("tova", {}, 8), ("h2o", {}, 8)], [RIGHT, " 53407.", " none"], ev)


@pytest.fixture()
def study(tmp_path):
    _recall(tmp_path)
    _phrase(tmp_path)
    _distractors(tmp_path)
    write_tables(tmp_path)
    return tmp_path


def test_gate_leaves_out_the_variant_the_full_cache_fails(study):
    df, acc = R.load(study)
    assert "recall2" not in set(df.variant)
    row = acc[(acc.task == "recall") & (acc.reminder_every == 2)].iloc[0]
    assert row.full_accuracy == 0 and not row.kept
    assert {"recall5", "recall20", "phrase2", "distractors1"} <= set(df.variant)


def test_recall_pairs_by_k(study):
    df, _ = R.load(study)
    rows = {r["reminder_every"]: r for r in R.recall_by_k(df, "decode", T0, 8)}
    k5 = rows[5]
    assert k5["prompts"] == 3 and k5["reminders"] == 2
    assert k5["accuracy"] == {"tova": [2, 3], "h2o": [2, 3], "scissorhands": [2, 3]}
    assert (k5["tova_lost_both_kept"], k5["tova_kept_both_lost"], k5["all_same"]) == (1, 1, 1)
    assert k5["against"] == {"h2o": [1, 1], "scissorhands": [1, 1]}
    said = R.recall_answer(list(rows.values()), "here")
    assert "H2O's accuracy minus TOVA's by reminder spacing: K = 20: +0 points, K = 5: +0 points" in said
    assert "TOVA was wrong where H2O was right more often than the reverse at no K" in said
    assert rows[20]["accuracy"]["tova"] == [0, 1] and rows[20]["all_same"] == 1
    assert list(rows) == [20, 5]  # no reminders first
    assert R.shown_budget({8: list(rows.values())}) == 8


def test_losses_on_quiet_steps(study):
    df, _ = R.load(study)
    lost = R.lost_steps(df, R.spans_of(study))
    tova = lost[lost.name == "tova"]
    # three K = 5 prompts x (layer 0 at step 12, layer 1 at step 15); K = 20 has no reminders
    assert len(tova) == 6 and set(lost.name) == {"tova"}
    assert sorted(set(zip(tova.layer, tova.step, tova.quiet))) == [(0, 12, True), (1, 15, False)]
    # steps 8..19 could lose it; 8, 9, 14, 15 read a reminder
    assert tova.quiet_base.iloc[0] == pytest.approx(8 / 12)
    q = R.quiet_table(lost).set_index("policy").loc["tova"]
    assert q["on a quiet step"] == 3 and q["share quiet"] == pytest.approx(0.5)
    lay = R.quiet_layers(lost, df)
    assert lay.layer.tolist() == [0] and lay["h2o holds it whole there"].tolist() == [3]


def test_phrase_whole_span_and_answers(study):
    df, _ = R.load(study)
    t = R.phrase_table(df).iloc[0]
    assert t["whole span, pk 5"] == 1.0 and t["whole span, pk 1"] == 0.0
    assert t["held, pk 1"] == pytest.approx(1 - 1 / 4)   # 1 of 2 positions in 1 of 2 layers
    assert (t["pk 5 right, pk 1 wrong"], t["pk 5 wrong, pk 1 right"]) == (1, 0)
    said = R.phrase_answer(df)
    # pk 5 holds it in both layers of both prompts; pk 1 in layer 0 only
    assert t["layers whole, pk 5"] == 1.0 and t["layers whole, pk 1"] == 0.5
    assert "in 100 % of the layers against 50 % for poolKernel 1 (more)" in said
    assert "every layer at once in 100 % of runs against 0 % (more often)" in said
    assert "2/2, 100 % [34–100] against 1/2, 50 % [9–91]" in said
    s = R.span_to_answer(df).set_index(["runs", "phrase held whole"])
    assert s.loc[("every policy", "yes"), "n"] == 2 and s.loc[("every policy", "no"), "n"] == 2


def test_distractor_forgets_the_asked_key(study):
    df, _ = R.load(study)
    t = R.distractor_table(df).set_index("policy")
    assert t.loc["tova", "a distractor's key"] == 1 and t.loc["tova", "distractor answered, asked key held less"] == 1
    assert t.loc["h2o", "no key"] == 1 and t.loc["h2o", "a distractor's key"] == 0
    said = R.distractor_answer(df)
    assert "tova 1 of 1 (1 holding less" in said and "Never a distractor's key: h2o" in said


def test_modes_compare_the_same_prompts(study):
    df, _ = R.load(study)
    t = R.modes_table(df).set_index("policy")
    # K = 5: decode TOVA wrong, right, right; prefill right, wrong, wrong: no verdict the same.
    # H2O: decode right, wrong, right; prefill right, wrong, wrong: two of three. K = 20: no prefill run.
    assert t.loc["tova", "prompts"] == 3 and t.loc["tova", "same verdict"] == 0
    assert t.loc["h2o", "same verdict"] == pytest.approx(2 / 3)
    said = R.modes_answer(df, R.recall_by_k(df, "decode", T0, 8), R.recall_by_k(df, "prefill", T0, 8))
    # 9 pairs: TOVA 0, H2O 2, Scissorhands 2 of 3 the same; each is right on 2 of 3 in decode mode
    # and 1 of 3 in prefill mode
    assert "over 9 paired runs" in said and "the same in 4 (44 %)" in said
    assert "more often in 0 of 3 policy x budget pairs, decode-time eviction in 3" in said
    # K = 5: TOVA against H2O one wrong-right and one right-wrong in decode mode, none of either in
    # prefill mode: even in both, so the same way
    assert "TOVA against H2O one by one" in said and "in both modes at 1 of 1 reminder spacings." in said
    assert "it turns" not in said
    # hand-made counts: H2O ahead in decode mode at K = 3, TOVA ahead in prefill mode there
    dec = [{"reminder_every": 20, "against": {"h2o": [3, 8], "scissorhands": [0, 16]}},
           {"reminder_every": 3, "against": {"h2o": [8, 1], "scissorhands": [0, 4]}}]
    pre = [{"reminder_every": 20, "against": {"h2o": [0, 21], "scissorhands": [0, 30]}},
           {"reminder_every": 3, "against": {"h2o": [0, 19], "scissorhands": [0, 30]}}]
    said = R.modes_answer(df, dec, pre)
    assert ("TOVA against H2O one by one (prompts where TOVA was wrong and H2O right, against the reverse) "
            "leans the same way in both modes at 1 of 2 reminder spacings; it turns at K = 3 (8 against 1 in "
            "decode mode, 0 against 19 in prefill mode).") in said
    assert "TOVA against Scissorhands one by one" in said and "at 2 of 2 reminder spacings." in said


def test_sign_test_on_hand_counts():
    # 8 against 1: P(X <= 1) for X ~ Bin(9, 1/2) is (1 + 9) / 512; two-sided doubles it
    assert R.sign_test(8, 1) == pytest.approx(20 / 512)
    assert R.sign_test(1, 8) == R.sign_test(8, 1)
    assert R.sign_test(0, 5) == pytest.approx(2 / 32)
    assert R.sign_test(3, 3) == 1.0 and R.sign_test(0, 0) == 1.0


def test_recall_answer_gives_the_sign_test_where_tova_is_behind():
    rows = [{"reminder_every": 3, "reminders": 7, "prompts": 30, "tova_lost_both_kept": 0,
             "tova_kept_both_lost": 1, "accuracy": {"tova": [4, 30], "h2o": [11, 30], "scissorhands": [0, 30]},
             "against": {"h2o": [8, 1], "scissorhands": [0, 4]}}]
    said = R.recall_answer(rows, "here")
    assert "more often than the reverse at K = 3 (8 against 1, exact sign test p = 0.039)" in said
    assert "K = 3: +23 points" in said


def test_scorer_note_counts_adakv_answering_as_tova():
    df = pd.DataFrame({"id": ["a", "a", "b", "b", "c"], "budget": [8] * 5,
                       "name": ["tova", "adakv (scorer=tova)"] * 2 + ["tova"],
                       "answer": [" 1", " 1", " 2", " 3", " 4"]})
    assert "on 1 of 2 runs with the same prompt and budget" in R.scorer_note(df)
    assert R.scorer_note(df[df.name == "tova"]) == ""


def test_write_fills_the_files(study, tmp_path_factory, monkeypatch):
    doc, answers, summary = R.report(study)
    monkeypatch.setattr(R, "REPO", tmp_path_factory.mktemp("repo"))
    index = R.REPO / "docs" / "studies" / "README.md"  # the studies' index holds the summary
    index.parent.mkdir(parents=True)
    index.write_text(f"# x\n\n{R.SUMMARY[0]}\nSTALE-SUMMARY\n{R.SUMMARY[1]}\n\nafter\n")
    R.write(study, doc, answers, summary)
    text = index.read_text()
    assert "STALE-SUMMARY" not in text and text.endswith("after\n") and "1. **A key the text returns to" in text
    assert "([tasks.md](tasks.md)," in text  # the index links its neighbour
    got = json.loads((study / "answers.json").read_text())
    assert got["recall"]["budget"] == 8 and got["recall"]["by_k"][1]["reminder_every"] == 5
    assert load_answers(study)["prompts"] == got["prompts"]
    s = pd.read_csv(study / "summary.csv")
    row = s[(s.task == "recall") & (s.option == 5) & (s.prompt_mode == "decode") & (s.policy == "tova")].iloc[0]
    assert (row.prompts, row.right) == (3, 2) and row.low < 2 / 3 < row.high
    assert (R.REPO / "docs" / "studies" / "tasks.md").read_text() == doc
    assert len(load_results(study)) == len(pd.read_csv(study / "results.csv"))


def test_missing_answers_file_names_it(tmp_path):
    with pytest.raises(ValueError, match="answers.json"):
        load_answers(tmp_path)


def test_gap_in_points_rounds_the_difference():
    assert R._points({"accuracy": {"h2o": [7, 30], "tova": [2, 30]}}, "h2o") == "+17 points"
    assert R._points({"accuracy": {"h2o": [0, 30], "tova": [16, 30]}}, "h2o") == "-53 points"


def test_reminder_draw_compares_the_reminders_rows_with_the_rows_between(study):
    from kvviz.studies.key_attention import attention_path

    df, _ = R.load(study)
    spans = R.spans_of(study)
    assert R.reminder_draw(study, df, spans).empty  # no attention files yet
    # K = 5's reminders are rows 8-9 and 14-15, the rows between them 10-13. Layer 0: the
    # reminders pay the key 0.4, the rows between 0.2 (ratio 2); layer 1: 0.1 against 0.2 (0.5)
    att = np.full((L, T0), 0.9, np.float32)  # rows outside both sets must not count
    att[0, [8, 9, 14, 15]], att[0, 10:14] = 0.4, 0.2
    att[1, [8, 9, 14, 15]], att[1, 10:14] = 0.1, 0.2
    for seed in range(3):
        path = attention_path(study, "recall5-" + run_id(T0, 10, seed, "decode", "layer"))
        path.parent.mkdir(exist_ok=True)
        np.savez(path, attention=att)
    draw = R.reminder_draw(study, df, spans)
    try:
        r = draw.set_index("K").loc[5]
        assert (r["runs"], r["layers"], r["layers where reminders pay more"]) == (3, 2, 1)
        assert r["ratio, lowest layer"] == pytest.approx(0.5) and r["ratio, highest layer"] == pytest.approx(2.0)
        assert r["ratio, median layer"] == pytest.approx(1.25)
        assert list(draw.K) == [5] and list(draw.length) == [T0]  # K = 20: no reminder to compare
        said = R.draw_sentence(draw)
        assert f"at {T0} tokens, K = 5 in 1 of 2 layers (median ratio over the layers 1.25, 3 prompts)" in said
        assert "not in most layers" in said
        att[1, [8, 9, 14, 15]] = 0.3
        for seed in range(3):
            np.savez(attention_path(study, "recall5-" + run_id(T0, 10, seed, "decode", "layer")), attention=att)
        assert "in most layers everywhere" in R.draw_sentence(R.reminder_draw(study, df, spans))
    finally:
        for f in (study / "attention").glob("*.npz"):
            f.unlink()


def test_a_longer_decode_cell_is_answered_on_its_own(study):
    # K = 5 at twice the length, decode mode, budget 8: TOVA wrong and H2O right on both prompts,
    # Scissorhands wrong on both
    rec = {"task": "recall", "reminder_every": 5, "reminders": [[8, 10], [14, 16]]}
    ev = np.full((4, L, 1, 2 * T0 + 2), -1, np.int32)
    for seed in (0, 1):
        _save(study, rec, "decode", TRIO, [RIGHT, WRONG, RIGHT, WRONG], ev, seed=seed, length=2 * T0)
    write_tables(study)
    doc, answers, _ = R.report(study)
    rows = answers["recall"]["longer"][f"{2 * T0}@8"]
    assert [r["reminder_every"] for r in rows] == [5] and rows[0]["against"]["h2o"] == [2, 0]
    assert f"Decode mode, {2 * T0} tokens, budget 8:" in doc
    said = answers["recall"]["answer"]
    assert f"In decode mode at {2 * T0} tokens (budget 8): over 2 prompts" in said
    assert "more often than the reverse at K = 5 (2 against 0, exact sign test p = 0.5, uncorrected; " in said
    tests = pd.DataFrame(answers["recall"]["decode_tests"])
    assert len(tests) == 6 and f"Holm-corrected over the {len(tests)} decode-mode sign tests p = 1)" in said
    # the shorter cell is still the one the by-K table and the lesson's line read
    assert answers["recall"]["length"] == T0 and answers["recall"]["budget"] == 8


def test_holm_on_hand_values():
    # sorted 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, then max(0.06, 0.04); order kept
    assert R.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert R.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_sign_power_at_its_closed_forms():
    # 5 of 5 one way gives p = 2/32 > 0.05, so 5 prompts can never reach significance
    assert R.sign_power(5, 1.0, 0.0) == 0.0
    # 6 of 6 gives p = 2/64 < 0.05 and 5 of 6 does not: power is the chance all six go TOVA's way against
    assert R.sign_power(6, 1.0, 0.0) == pytest.approx(1.0)
    assert R.sign_power(6, 0.5, 0.0) == pytest.approx(0.5 ** 6)
    assert R.sign_power(30, 0.25, 0.05) < R.sign_power(60, 0.25, 0.05)
