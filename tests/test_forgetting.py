"""The Forgetting view speaks of what it shows: the guided experiment quotes the grid on
screen and TOVA's card, "Shown" names the prompt on screen, and in prefill mode the heatmap
and the key's fate are the one eviction at the end of the prompt. Checked against the
shipped run files, read without kvviz."""
from pathlib import Path

import numpy as np
import pytest
from apphelp import arr, ok
from test_app_needle import SHIPPED, answers, charts, correct_of, page, raw_runs

from kvviz.app.figures import needle as NV
from kvviz.studies import forgetting as FS

ROOT = Path(__file__).resolve().parents[1]
CARD = ROOT.parent / "shared" / "seeds" / "002_9b5c0d27c4126eb1.txt"  # TOVA's card
SCENE = dict(nbudget=128, nmode="prefill", ngran="layer", nlen=512, ndepth=10, nseed=0,
             npol="snapkv", nvs="tova")


def plain(m, policy, budget):
    """Whether `policy` at its default parameters ran at `budget` in run meta `m`."""
    return any(c["policy"] == policy and c["budget"] == budget and not c["params"].get("sinks")
               for c in m["configs"])


def grid_counts(mode, gran, budget, one_on_one=None):
    """(prompts, TOVA right, H2O right, Scissorhands right, TOVA wrong with both right, the
    reverse) over the shipped runs of one grid; `one_on_one` (a dict) gets, per other policy,
    [TOVA wrong where it is right, TOVA right where it is wrong]."""
    n = t = h = s = claim = rev = 0
    pair = {"h2o": [0, 0], "scissorhands": [0, 0]}
    for m, _, _ in raw_runs(SHIPPED).values():
        if (m["prompt_mode"], m["granularity"]) != (mode, gran):
            continue
        if not all(plain(m, p, budget) for p in ("tova", "h2o", "scissorhands")):
            continue
        a, b, c = (correct_of(m, p, budget) for p in ("tova", "h2o", "scissorhands"))
        n, t, h, s = n + 1, t + a, h + b, s + c
        claim += (not a) and b and c
        rev += a and not b and not c
        for other, o in (("h2o", b), ("scissorhands", c)):
            pair[other][0] += (not a) and o
            pair[other][1] += a and not o
    if one_on_one is not None:
        one_on_one.update(pair)
    return n, t, h, s, claim, rev


def test_the_warning_is_quoted_from_the_card():
    if not CARD.is_file():
        pytest.skip(f"{CARD} is not beside this checkout")
    text = " ".join(CARD.read_text(encoding="utf-8").split())
    assert FS.TOVA_WARNING in text


@pytest.mark.parametrize("mode,budget", [("prefill", 128), ("decode", 128)])
def test_the_guided_box_quotes_the_grid_on_screen(mode, budget, apptest):
    at = page(**{**SCENE, "nmode": mode, "nbudget": budget})
    ok(at)
    box = next(m.value for m in at.markdown if m.value.startswith("**Guided experiment**"))
    pair = {}
    n, t, h, s, claim, rev = grid_counts(mode, "layer", budget, pair)
    assert n > 0
    assert f"“{FS.TOVA_WARNING}”" in box
    assert (f"**The grid above** (budget {budget}, {mode} prompt, layer granularity): of {n} "
            f"prompts TOVA answered right {t}, H2O {h}, Scissorhands {s}; TOVA wrong while "
            f"H2O and Scissorhands were both right: {claim} (the reverse: {rev}); one on one, TOVA "
            f"wrong where H2O right: {pair['h2o'][0]} (the reverse: {pair['h2o'][1]}), where "
            f"Scissorhands right: {pair['scissorhands'][0]} (the reverse: {pair['scissorhands'][1]}).") in box
    assert "Shown:" not in box  # the box describes the grid; the prompt is named below it
    needle = next(v for k, v in charts(at).items() if k.startswith("Pass-key accuracy"))
    assert f"budget {budget}" in needle["layout"]["title"]["text"]
    assert mode in needle["layout"]["title"]["text"]


def test_shown_names_the_prompt_on_screen(apptest):
    at = page(**{**SCENE, "nlen": 256, "ndepth": 50, "nseed": 10})
    ok(at)
    shown = [c.value for c in at.caption if c.value.startswith("Shown below:")]
    assert shown == ["Shown below: the prompt of 256 tokens with the key at 50 % depth, seed 10 "
                     "(prefill prompt, layer granularity, budget 128)."]
    prompt = next(m.value for m in at.markdown if m.value.startswith("**The prompt**"))
    assert prompt.startswith("**The prompt** (256 tokens;")


def test_prefill_shows_the_one_eviction_at_the_end_of_the_prompt(apptest):
    at = page(**SCENE)
    ok(at)
    meta, ev, _ = raw_runs(SHIPPED)["L512-d10-s0-prefill-layer"]
    T0, kp = meta["prompt_len"], meta["key_positions"]
    ia = next(i for i, c in enumerate(meta["configs"]) if c["label"].startswith("snapkv(")
              and c["params"].get("pool_kernel") == 5 and c["budget"] == 128)
    ib = next(i for i, c in enumerate(meta["configs"]) if c["label"] == "tova@128")
    layer = int(at.selectbox(key="needle.nlayer").value)
    kept = {w: (ev[i, layer, 0, :T0] < 0) | (ev[i, layer, 0, :T0] > T0 - 1)
            for w, i in (("A", ia), ("B", ib))}
    fig = next(v for k, v in charts(at).items() if k.startswith("What each kept of the prompt"))
    assert f"(step {T0 - 1})" in fig["layout"]["title"]["text"]
    z = arr(fig["data"][0]["z"])
    assert np.array_equal(z[0] > 0, kept["A"]) and np.array_equal(z[1] > 0, kept["B"])
    ka, kb = (int(kept[w][kp].sum()) for w in "AB")
    caption = next(c.value for c in at.caption if c.value.startswith("Prefill:"))
    assert f"Layer {layer}: snapkv kept {ka} of the key's {len(kp)} tokens; tova kept {kb}" \
        in caption
    table = answers(at)
    assert FS.LOST not in table.columns and FS.KEPT in table.columns
    e = ev[ib][..., kp]
    fewest = int(((e < 0) | (e > T0 - 1)).sum(-1).min())
    assert table[table["configuration"] == "tova"].iloc[0][FS.KEPT] == f"{fewest} of {len(kp)}"


def test_the_needle_page_has_no_status_line_about_another_trace(apptest):
    at = page(**SCENE)
    ok(at)
    assert not [m for m in at.markdown if "holds" in m.value and "|A Δ B|" in m.value]


def test_a_and_b_lost_the_key_labels_sit_apart():
    ev = np.full(40, -1)
    ev[5] = 20
    fig = NV.key_cache_figure(ev, ev.copy(), key_positions=[5, 6], prompt_len=30,
                              label_a="tova", label_b="h2o").to_dict()
    pos = {t["name"][0]: t["textposition"] for t in fig["data"]
           if str(t.get("name", "")).endswith("loses the key (step 20)")}
    assert pos == {"A": "top left", "B": "bottom right"}


def test_trio_table_counts_by_hand():
    """The trio pivot the view and the reports share: prompts where all three ran, paired."""
    import pandas as pd

    verdicts = {"a": (False, True, True), "b": (True, False, False), "c": (True, True, True),
                "d": (False, True, None)}  # d: Scissorhands did not run, so d is left out
    rows = pd.DataFrame([{"id": i, "name": n, "correct": v} for i, vs in verdicts.items()
                         for n, v in zip(FS.TRIO, vs) if v is not None]
                        + [{"id": "a", "name": "snapkv", "correct": True}])
    wide = FS.trio_table(rows, "id", column="name", value="correct").set_index("id")
    assert list(wide.index) == ["a", "b", "c"]
    assert wide.claim.tolist() == [True, False, False] and wide.reverse.tolist() == [False, True, False]
    assert wide.all_same.tolist() == [False, False, True]
    assert wide.behind_h2o.tolist() == [True, False, False] and wide.ahead_scissorhands.tolist() == [False, True, False]
    assert FS.trio_table(rows[rows.name != "scissorhands"], "id", column="name", value="correct") is None


def test_the_tasks_answers_reader_names_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"answers.json: no such file .*lab/tasks_study.sh report"):
        FS.load_answers(tmp_path)
    (tmp_path / "answers.json").write_text("[1]")
    with pytest.raises(ValueError, match="answers.json: not a JSON object"):
        FS.load_answers(tmp_path)
    (tmp_path / "answers.json").write_text("{")
    with pytest.raises(ValueError, match="answers.json: not readable JSON"):
        FS.load_answers(tmp_path)
    (tmp_path / "answers.json").write_text('{"prompts": 3}')
    assert FS.load_answers(tmp_path) == {"prompts": 3}
