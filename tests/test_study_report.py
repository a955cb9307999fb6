"""lab.study_report on a synthetic study whose 2 x 2 tables are built by hand: the primary
contrast per claim, the full-cache gate, secondaries Holm-corrected (the hand-worked values),
every result marked, and no tracked file written without --write."""
from __future__ import annotations

import json
import math
import subprocess

import pandas as pd
import pytest

from lab import study_report as R

PREREG = """
study = "synth"
title = "A synthetic study"
alpha = 0.05
[[claim]]
name = "forgets"
card = "a card's sentence"
by = "policy"
gap = 0.2
power = 0.8
[claim.primary]
a = "tova"
b = "h2o"
where = { task = "recall", budget = 64 }
[[claim.secondary]]
a = "tova"
b = "h2o"
where = { task = "recall" }
vary = ["budget"]
"""


def rows_for(budget: int, a: int, b: int, c: int, d: int, wrong: int = 0) -> list[tuple]:
    """Prompts of one cell: a both right, b TOVA only, c H2O only, d neither, and `wrong`
    prompts the full cache got wrong (TOVA and H2O wrong there too). Each cell's prompts are
    its own (ids b<budget>-p<i>)."""
    out, i = [], 0
    for n, (t, h) in ((a, (1, 1)), (b, (1, 0)), (c, (0, 1)), (d, (0, 0))):
        for _ in range(n):
            out += [(f"b{budget}-p{i}", "full", -1, True), (f"b{budget}-p{i}", "tova", budget, bool(t)),
                    (f"b{budget}-p{i}", "h2o", budget, bool(h))]
            i += 1
    for _ in range(wrong):
        out += [(f"b{budget}-p{i}", "full", -1, False), (f"b{budget}-p{i}", "tova", budget, False),
                (f"b{budget}-p{i}", "h2o", budget, False)]
        i += 1
    return out


@pytest.fixture
def study(tmp_path):
    rows = []
    for budget, cell in ((64, (5, 2, 12, 9, 2)), (128, (10, 1, 6, 13, 0)), (256, (20, 3, 3, 4, 0))):
        rows += rows_for(budget, *cell)
    df = pd.DataFrame(rows, columns=["id", "policy", "budget", "correct"])
    df["task"] = "recall"
    df["label"] = df["policy"] + "@" + df["budget"].astype(str)
    folder = tmp_path / "synth"
    folder.mkdir()
    df.to_csv(folder / "results.csv", index=False)
    (folder / R.PREREG).write_text(PREREG)
    return folder


def two_sided(b, c):
    m = b + c
    return min(1.0, 2 * sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2 ** m)


def test_primary_and_holm_marked_secondaries(study):
    ans = R.analyse(study)
    res = ans["claims"]["forgets"]["results"]
    prim, secs = res[0], res[1:]
    assert prim["status"] == "primary" and prim["id"] == "forgets"
    # the two prompts the full cache got wrong are set apart, not TOVA's or H2O's failures
    assert prim["table"] == [5, 2, 12, 9] and prim["full_cache_wrong"] == 2 and prim["n"] == 28
    assert prim["p"] == pytest.approx(two_sided(2, 12))  # 2 * 106 / 2^14
    assert prim["accuracy"]["a"][:2] == [7, 28] and prim["accuracy"]["b"][:2] == [17, 28]
    assert prim["diff"] == pytest.approx(-10 / 28)
    # secondaries: the other budgets, one family of two; Holm by hand: p(1, 6) = 2 * 8 / 128 =
    # 0.125 and p(3, 3) = 1: sorted 0.125 x 2 = 0.25, then max(0.25, 1 x 1) = 1
    assert [s["where"]["budget"] for s in secs] == [128, 256]
    assert [s["status"] for s in secs] == ["secondary", "secondary"]
    assert secs[0]["p"] == pytest.approx(0.125) and secs[0]["holm_p"] == pytest.approx(0.25)
    assert secs[1]["holm_p"] == pytest.approx(1.0)
    assert [s["id"] for s in secs] == ["forgets.1", "forgets.2"]
    assert "not committed" in ans["registered"]


def test_page_marks_every_result(study):
    ans = R.analyse(study)
    doc = R.page(ans)
    assert "**Primary.** [primary] tova against h2o at task recall, budget 64" in doc
    assert doc.count("[secondary (Holm p = 0.25)]") == 1 and doc.count("[secondary (Holm p = 1)]") == 1
    assert "the full cache got 2 prompts wrong (set apart)" in doc
    assert "Prompts needed for 80 % power" in doc


def test_report_writes_no_tracked_file_without_write(study, tmp_path, monkeypatch, capsys):
    status = ["git", "status", "--porcelain", "--untracked-files=all"]
    before = subprocess.run(status, cwd=R.REPO, capture_output=True, text=True).stdout
    monkeypatch.chdir(tmp_path)
    assert R.main([str(study)]) == 0
    after = subprocess.run(status, cwd=R.REPO, capture_output=True, text=True).stdout
    assert before == after
    assert json.loads((tmp_path / "out/studies/synth/answers.json").read_text())["study"] == "synth"
    assert not (study / "answers.json").exists()
    printed = capsys.readouterr().out
    assert "forgets: contradicted" in printed and "[primary] tova against h2o" in printed
    assert "95 % interval" in printed


def test_write_goes_to_the_study_and_docs(study, tmp_path, monkeypatch):
    monkeypatch.setattr(R, "REPO", tmp_path)
    assert R.main([str(study), "--write"]) == 0
    assert (tmp_path / "docs/studies/synth.md").read_text().startswith("# A synthetic study")
    assert (study / "answers.json").is_file()


def test_bad_preregistration_is_named(study, capsys):
    (study / R.PREREG).write_text(PREREG.replace("[claim.primary]", "[claim.primaryx]"))
    assert R.main([str(study)]) == 2
    assert "synth" not in capsys.readouterr().out
    (study / R.PREREG).write_text(PREREG.replace('where = { task = "recall", budget = 64 }',
                                                 'where = { task = "recall", depth = 5 }'))
    with pytest.raises(ValueError, match="where.depth: the results have no column 'depth'"):
        R.analyse(study)
    (study / R.PREREG).unlink()
    with pytest.raises(ValueError, match="no preregistration.toml"):
        R.analyse(study)


VARIANTS = """
study = "var"
least_full = 0.5
[[claim]]
name = "returns"
by = "policy"
control = "S1.1"
[claim.primary]
name = "P1"
a = "h2o"
b = "tova"
where = { returns = 3 }
pair = ["haystack"]
[[claim.secondary]]
name = "S1.1 positive control"
a = { policy = "h2o", returns = 3 }
b = { policy = "h2o", returns = 0 }
pair = ["haystack"]
[[claim.secondary]]
name = "S1.5 not run"
a = "h2o"
b = "tova"
where = { returns = 9 }
pair = ["haystack"]
[[claim.secondary]]
name = "S2.2 interaction"
kind = "interaction"
a = "h2o"
b = "tova"
across = { returns = [3, 0] }
pair = ["haystack"]
[[describe]]
title = "Accuracy per variant"
group = ["returns", "policy"]
values = ["correct"]
[[describe]]
title = "A column the table lacks"
group = ["returns"]
values = ["neighbours_held_end"]
"""


def variant_rows():
    """Two variants of each of six haystacks' prompt (returns 3 and 0); the full cache wrong
    on haystack f's returns-0 prompt. Verdicts (h2o, tova):
        returns 3: a (1, 0), b (1, 0), c (1, 1), d (0, 0), e (1, 0), f (0, 1)
        returns 0: a (0, 0), b (1, 0), c (0, 1), d (0, 0), e (0, 0), f (gated out)"""
    v3 = {"a": (1, 0), "b": (1, 0), "c": (1, 1), "d": (0, 0), "e": (1, 0), "f": (0, 1)}
    v0 = {"a": (0, 0), "b": (1, 0), "c": (0, 1), "d": (0, 0), "e": (0, 0), "f": (1, 1)}
    rows = []
    for k, verdicts in ((3, v3), (0, v0)):
        for h, (h2o, tova) in verdicts.items():
            pid = f"returns{k}-{h}"
            rows += [(pid, h, k, "full", not (k == 0 and h == "f")), (pid, h, k, "h2o", bool(h2o)),
                     (pid, h, k, "tova", bool(tova))]
    df = pd.DataFrame(rows, columns=["id", "haystack", "returns", "policy", "correct"])
    return df.assign(label=df["policy"])


def test_variants_pairs_not_run_and_interaction(tmp_path):
    folder = tmp_path / "var"
    folder.mkdir()
    variant_rows().to_csv(folder / "results.csv", index=False)
    (folder / R.PREREG).write_text(VARIANTS)
    res = R.analyse(folder)["claims"]["returns"]["results"]
    prim, control, missing, inter = res
    assert prim["name"] == "P1" and prim["table"] == [1, 3, 1, 1] and prim["full_cache_wrong"] == 0
    # the positive control pairs H2O's returns-3 prompt with its returns-0 twin: a (1, 0),
    # b (1, 1), c (1, 0), d (0, 0), e (1, 0); f set apart (its returns-0 prompt failed the gate)
    assert control["table"] == [1, 3, 0, 1] and control["full_cache_wrong"] == 1
    assert control["p"] == pytest.approx(2 / 8)  # 3 against 0: 2 x (1/2)^3
    assert "not_run" in missing and "not run" in missing["text"] and "holm_p" not in missing
    # gains (h2o - tova) at returns 3 minus at returns 0: a 1-0, b 1-1, c 0-(-1), d 0-0, e 1-0
    assert (inter["positive"], inter["negative"], inter["n"]) == (3, 0, 5)
    assert inter["p"] == pytest.approx(0.25)
    # Holm over the two secondaries that ran: 0.25 and 0.25 -> 0.5 each
    assert control["holm_p"] == pytest.approx(0.5) and inter["holm_p"] == pytest.approx(0.5)
    ans = R.analyse(folder)
    assert "Holm-corrected over the 2 that ran" in R.page(ans)
    assert ans["set_apart"] == {"prompts": 12, "wrong": 1, "by": {"f": 1}}
    assert ans["claims"]["returns"]["control"].startswith(
        "Its positive control (S1.1) does not show the expected gain (Holm p = 0.5)")
    # descriptive means over the gated prompts: returns 0 leaves out haystack f's prompt
    acc, lacking = ans["described"]
    means = {(r["returns"], r["policy"]): (r["correct"], r["rows"]) for r in acc["rows"]}
    assert means[(3, "h2o")] == (round(4 / 6, 3), 6) and means[(0, "tova")] == (round(1 / 5, 3), 5)
    assert lacking["not_run"] == "the results have no column 'neighbours_held_end'"
    assert "## Accuracy per variant (descriptive, no test)" in R.page(ans)


def test_the_answer_follows_the_primary_contrast(study):
    ans = R.analyse(study)
    # budget 64: TOVA (A) 7/28 against H2O (B) 17/28, p = 2 * 106 / 2^14 < 0.05: the
    # hypothesis (A answers more often) is contradicted
    assert R.verdict(ans["claims"]["forgets"]["results"][0], 0.05).startswith(
        "contradicted: h2o answered more often than tova")
    low_power = dict(ans["claims"]["forgets"]["results"][1])  # budget 128: 1 against 6, p = 0.125
    assert R.verdict(low_power, 0.05).startswith("not shown: paired gap -17 points")
    assert "could have been missed" in R.verdict(low_power, 0.05)


def test_a_missing_table_is_named(study):
    (study / "results.csv").unlink()
    with pytest.raises(ValueError, match="results: none of results.csv exists .*has not run yet"):
        R.analyse(study)


def test_an_unfinished_cell_is_descriptive_until_it_has_enough_pairs(study):
    (study / R.PREREG).write_text(PREREG.replace('alpha = 0.05', 'alpha = 0.05\nleast_pairs = 30')
                                  .replace('gap = 0.2', 'gap = 0.2\nprompts = 40'))
    prim = R.analyse(study)["claims"]["forgets"]["results"][0]
    # 30 of 40 planned prompts run, 28 gated: under 30 pairs, so no test
    assert prim["partial"] and not prim["testable"]
    assert "[primary, partial: descriptive, no test]" in prim["text"] and "30 of 40 planned" in prim["text"]
    assert R.verdict(prim, 0.05).startswith("not answered yet")
    (study / R.PREREG).write_text(PREREG.replace('alpha = 0.05', 'alpha = 0.05\nleast_pairs = 28')
                                  .replace('gap = 0.2', 'gap = 0.2\nprompts = 40'))
    assert R.analyse(study)["claims"]["forgets"]["results"][0]["testable"]


def test_the_horizon_is_the_median_over_prompts_of_the_median_over_layers():
    rows = pd.DataFrame({
        "id": ["p1", "p1", "p2", "p2", "p3", "p3"],
        "label": ["full", "tova", "full", "tova", "full", "tova"],
        "returns": 0, "full_cache_correct": [True, True, True, True, False, False],
        # start 10, end 20: p1's layers survive 2, 4 and 10 (never lost) steps -> median 4;
        # p2's 0, 1, 1 -> 1; p3 is set apart (the full cache got it wrong)
        "first_lost_by_layer": ["[-1, -1, -1]", "[12, 14, -1]", "[-1, -1, -1]", "[10, 11, 11]",
                                "[-1, -1, -1]", "[10, 10, 10]"],
        "quiet": [1, 1, 5, 5, 0, 0]})
    d = {"title": "h", "kind": "horizon", "label": "tova", "where": {"returns": 0}, "start": 10,
         "end": 20, "quiet_where": {"returns": 0}, "answer_tokens": 1}
    out = R.describe(rows, d, "p.toml")["rows"][0]
    # median of 4 and 1 is 2.5; quiet + answer is 2 (p1) and 6 (p2): longer on p2 only
    assert out["horizon (median steps)"] == 2.5 and out["quiet + answer (steps)"] == "2–6"
    assert out["prompts where it is longer"] == "1 of 2" and out["prompts"] == 2


def test_a_cell_at_the_floor_gives_no_evidence_either_way():
    floor = {"table": [0, 0, 0, 30], "n": 30, "testable": True, "interval": [-0.11, 0.11], "diff": 0.0,
             "p": 1.0, "a": "x", "b": "y", "power": 0.6, "gap": 0.2}
    assert R.verdict(floor, 0.05).startswith("no evidence either way: both at the floor")
    ceiling = dict(floor, table=[30, 0, 0, 0])
    assert "both at the ceiling" in R.verdict(ceiling, 0.05)


def test_a_supported_primary_with_a_failed_positive_control_is_not_the_claim():
    prim = {"table": [5, 38, 1, 14], "n": 58, "testable": True, "interval": [0.48, 0.75], "diff": 37 / 58,
            "p": 1.5e-10, "a": "h2o", "b": "tova", "power": 0.4, "gap": 0.2}
    failed = {"name": "S1.1", "testable": True, "holm_p": 0.33, "diff": -0.12}
    text = R.answer(prim, failed, "S1.1", 0.05)
    assert text.startswith("not shown as claimed: the primary contrast favours A (h2o answered more often")
    assert "its positive control (S1.1) does not show the expected gain (Holm p = 0.33)" in text
    passed = dict(failed, holm_p=0.01, diff=0.2)
    assert R.answer(prim, passed, "S1.1", 0.05).startswith("supported: h2o answered more often")
    assert "has not run" in R.answer(prim, None, "S1.1", 0.05)
