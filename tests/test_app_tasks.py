"""The Forgetting view's tasks (recall, distractors, phrase) on a synthetic tasks folder
(tests/tasks_fixture.py): the task choices, the prompt strip's marks, the answers under each
task's check, the recall task's key-attention chart, the tasks study's placeholders and the
lesson scene on recall; the page under AppTest. Expected values come from the fixture's raw
run files (np.load) or are written out here, not through the view's code."""
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import tasks_fixture as TF
from apphelp import APP, ok
from streamlit.testing.v1 import AppTest

from kvviz.app.figures import needle as NV
from kvviz.model.needle.results import load_results
from kvviz.studies import forgetting as FS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return TF.write_tasks(tmp_path_factory.mktemp("tasks"))


def raw(folder, id_):
    with np.load(folder / "runs" / f"{id_}.npz", allow_pickle=False) as z:
        return json.loads(str(z["meta"])), z["evicted_at"], list(z["tokens"])


RECALL = "recall3-L256-d10-s0-decode-layer"


# --- pure functions ------------------------------------------------------------------------
def test_task_choices_are_each_task_and_option_labelled(tasks):
    rows = load_results(tasks)
    assert FS.task_options(rows) == [("recall3", "recall: a reminder every 3 sentences"),
                                     ("distractors2", "distractors: 2 look-alikes"),
                                     ("phrase4", "phrase: 4 words")]
    ids = set(FS.task_rows(rows, "recall3")["id"])
    assert ids == {p.stem for p in (tasks / "runs").glob("recall3-*.npz")}
    assert FS.task_rows(rows, "phrase5").empty


def spans(html_text):
    """{position: css classes} of the strip's tokens (their tooltips name the position)."""
    return {int(p): cls.split() for cls, p in
            re.findall(r'<span class="kv-tok ?([^"]*)" title="position (\d+)', html_text)}


def test_strip_marks_reminders_and_distractors_keys_with_a_legend(tasks):
    meta, _, tokens = raw(tasks, RECALL)
    key_label, marks = NV.task_marks(meta)
    h = NV.key_strip_html(tokens, meta["key_positions"], meta["question_start"], marks, key_label)
    s = spans(h)
    rem = {p for a, b in TF.REMINDERS for p in range(a, b)}
    assert {p for p, c in s.items() if "kv-rem" in c} == rem
    assert {p for p, c in s.items() if "kv-key" in c} == set(TF.KEY_POS)
    assert 'data-testid="kv-needle-legend"' in h and ">a reminder<" in h
    meta, _, tokens = raw(tasks, "distractors2-L256-d10-s0-prefill-layer")
    key_label, marks = NV.task_marks(meta)
    h = NV.key_strip_html(tokens, meta["key_positions"], meta["question_start"], marks, key_label)
    s = spans(h)
    assert {p for p, c in s.items() if "kv-dis" in c} == {90, 91, 120, 121}
    assert 'title="position 90: Greta&#x27;s key (a distractor)"' in h
    assert "Anna&#x27;s key (asked)" in h and not any("kv-rem" in c for c in s.values())


def test_answers_are_scored_by_the_tasks_check(tasks):
    for id_, tova, h2o in (
            ("distractors2-L256-d10-s0-prefill-layer", "✗ distractor (Greta's key)", "✗ no key"),
            ("phrase4-L256-d10-s0-prefill-layer", "✗ partial: thunder amber", "✗ lost"),
            (RECALL, "✗ wrong", "✗ wrong")):
        meta, ev, _ = raw(tasks, id_)
        t = FS.answers_table(meta, 128, ev).set_index("configuration")[FS.CHECK]
        right = "✓ whole" if id_.startswith("phrase") else "✓ right"
        assert (t["tova"], t["h2o"], t["snapkv"], t["full cache"]) == (tova, h2o, right, right)


def test_attention_figure_shades_the_reminders_and_marks_each_loss():
    T = 256
    att = np.random.default_rng(0).random((TF.LAYERS, T)).astype(np.float32) / 4
    lost = {"tova": 27, "h2o": -1, "scissorhands": 62}
    fig = NV.key_attention_figure(att, reminders=TF.REMINDERS, key_positions=TF.KEY_POS, lost=lost,
                                  layer=1).to_plotly_json()
    shaded = sorted((s["x0"], s["x1"]) for s in fig["layout"]["shapes"] if s["name"] == "reminder")
    assert shaded == [(a - 0.5, b - 0.5) for a, b in TF.REMINDERS]
    # the quiet steps between two reminders lie under no shape but the key's
    covered = {x for s in fig["layout"]["shapes"] for x in range(T) if s["x0"] < x < s["x1"]}
    assert not covered & set(range(TF.REMINDERS[0][1], TF.REMINDERS[1][0]))
    curve = fig["data"][0]
    assert np.allclose(np.asarray(curve["y"], float), att[1])
    marks = {d["name"].split(" loses the key")[0]: d for d in fig["data"]
             if " loses the key" in (d.get("name") or "")}
    assert set(marks) == {"tova", "scissorhands"}  # h2o never lost it: no marker
    for name, d in marks.items():
        assert d["x"] == [lost[name]] and d["y"][0] == pytest.approx(float(att[1, lost[name]]))
        assert d["name"] == f"{name} loses the key (step {lost[name]})"
    # policies losing it at one step: each its own symbol, stacked, none on top of another
    same = {"tova": 70, "h2o": 70, "snapkv": 70, "scissorhands": 70}
    both = NV.key_attention_figure(att, reminders=TF.REMINDERS, key_positions=TF.KEY_POS,
                                   lost=same, layer=1).to_plotly_json()
    lost4 = [d for d in both["data"] if " loses the key" in (d.get("name") or "")]
    assert [d["x"] for d in lost4] == [[70]] * 4
    assert len({d["marker"]["symbol"] for d in lost4}) == 4
    ys = [d["y"][0] for d in lost4]
    top = both["layout"]["yaxis"]["range"][1]
    assert ys[0] == pytest.approx(float(att[1, 70]))
    assert all(b - a >= 0.05 * top for a, b in zip(ys, ys[1:])), ys  # apart on the screen
    mean = NV.key_attention_figure(att, reminders=[], key_positions=TF.KEY_POS, lost={},
                                   layer=None).to_plotly_json()
    assert np.allclose(np.asarray(mean["data"][0]["y"], float), att.mean(0), atol=1e-6)
    assert "mean over layers" in mean["layout"]["title"]["text"]


# --- the tasks study's placeholders ------------------------------------------------------
def test_recall_placeholders_read_answers_json(tmp_path, monkeypatch):
    from kvviz.app.teach.notes import PLACEHOLDERS

    monkeypatch.setenv("KVVIZ_TASKS_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "answers.json")) + ": no such file"):
        PLACEHOLDERS["tasks.recall"].fn(None)
    TF.write_answers(tmp_path)
    assert PLACEHOLDERS["tasks.recall"].fn(None) == TF.ANSWERS["recall"]["answer"]
    assert PLACEHOLDERS["tasks.modes"].fn(None) == "Modes: a test sentence."
    assert PLACEHOLDERS["tasks.recall_by_k"].fn(None) == (
        "decode, 256 tokens, budget 128: K=3: TOVA 4/30, H2O 10/30, Scissorhands 9/30 (TOVA wrong where H2O "
        "right: 7, the reverse: 1); K=20 (no reminder): TOVA 2/30, H2O 3/30, Scissorhands 1/30 (TOVA wrong where "
        "H2O right: 1, the reverse: 2); decode, 512 tokens, budget 384: K=20: TOVA 28/30, H2O 19/30, Scissorhands "
        "0/30 (TOVA wrong where H2O right: 0, the reverse: 9)")
    (tmp_path / "answers.json").write_text(json.dumps({"recall": {"by_k": [{"reminder_every": 3}]}}))
    with pytest.raises(ValueError, match="recall.by_k is not the study's table"):
        PLACEHOLDERS["tasks.recall_by_k"].fn(None)
    with pytest.raises(ValueError, match="no phrase.answer"):
        PLACEHOLDERS["tasks.phrase"].fn(None)


def test_the_recall_scene_quotes_the_card_and_the_measured_answer(tasks, tmp_path, monkeypatch):
    from kvviz.app.teach import lesson as L

    monkeypatch.setenv("KVVIZ_TASKS_DIR", str(tasks))
    monkeypatch.chdir(ROOT)
    les = L.load(ROOT / "lessons" / "tova-vs-snapkv.toml")
    n = next(s.number for s in les.scenes if s.title.startswith("A key the text returns to"))
    scene = les.scene(n)
    assert scene.state.view == "needle" and scene.state.needle["ntask"] == "recall3"
    assert scene.state.needle["nmode"] == "decode"
    (tasks / "answers.json").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"scene \d+: \{tasks.recall_by_k\}: .*answers.json: no such file"):
        L.note_text(les, n)
    TF.write_answers(tasks)
    note = L.note_text(les, n)
    assert ("When a token matters intermittently. One quiet step is enough to lose it. A position that the "
            "model returns to every fifty steps looks worthless on the forty-nine in between, and this policy "
            "has no memory to say otherwise. h2o and scissorhands exist for exactly that.") in note
    assert "K=3: TOVA 4/30, H2O 10/30" in note and "decode, 512 tokens, budget 384: K=20: TOVA 28/30" in note
    # the cell's own answers (the fixture: tova and h2o wrong, scissorhands and snapkv right)
    assert "right: scissorhands, snapkv; wrong: h2o, tova" in note


# --- the page ----------------------------------------------------------------------------
@pytest.fixture
def page_env(monkeypatch, tasks, tmp_path):
    for name in ("torch", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setenv("KVVIZ_TASKS_DIR", str(tasks))
    monkeypatch.setenv("KVVIZ_NEEDLE_DIR", str(ROOT / "traces" / "needle"))


def page(**query) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params["view"] = "needle"
    for k, v in query.items():
        at.query_params[k] = str(v)
    return at.run()


def titles(at):
    return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]


def test_choosing_recall_shows_its_marked_prompt_and_scored_answers(page_env, tasks, apptest):
    at = page()
    ok(at)
    assert at.session_state["needle.ntask"] == "passkey"
    assert at.selectbox(key="needle.ntask").options == [
        "pass key", "recall: a reminder every 3 sentences", "distractors: 2 look-alikes", "phrase: 4 words"]
    at.selectbox(key="needle.ntask").set_value("recall3").run()
    ok(at)
    assert not at.error
    assert at.session_state["needle.nmode"] == "decode"
    assert any(t.startswith("Recall: a reminder every 3 sentences · accuracy") for t in titles(at))
    strip = next(h.proto.body for h in at.get("html") if "kv-needle-strip" in h.proto.body)
    assert ">a reminder<" in strip and 'kv-tok kv-rem' in strip
    table = next(d.value for d in [*at.table, *at.dataframe] if "configuration" in d.value.columns)
    assert set(table[FS.CHECK]) == {"✓ right", "✗ wrong"}
    # no attention file for the run: one caption line says so, no chart, no error
    assert any("no file" in c.value and "key_attention" in c.value for c in at.caption)
    assert not any(t.startswith("The key's attention") for t in titles(at))


def test_the_recall_cell_draws_its_attention_file(page_env, tasks, apptest):
    from kvviz.studies.key_attention import attention_path, save_attention

    meta, ev, _ = raw(tasks, RECALL)
    att = np.linspace(0, 0.5, TF.LAYERS * 256, dtype=np.float32).reshape(TF.LAYERS, 256)
    save_attention(tasks, meta, att)
    try:
        at = page(ntask="recall3", nbudget=128, nmode="decode", nlen=256, ndepth=10, nseed=0, nalayer=1)
        ok(at)
        spec = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                    if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("The key's attention"))
        marks = {d["name"].split(" loses the key")[0]: d["x"][0] for d in spec["data"]
                 if " loses the key" in (d.get("name") or "")}
        i = {c["label"]: k for k, c in enumerate(meta["configs"])}
        # layer 1: tova loses the key there; scissorhands (layer 2), h2o and snapkv never do
        expect = {}
        for p in ("tova", "h2o", "scissorhands", "snapkv"):
            e = ev[i[f"{p}@128"], 1, 0, TF.KEY_POS]
            if (e >= 0).any():
                expect[p] = int(e[e >= 0].min())
        assert marks == expect == {"tova": TF.KEY_POS[-1] + TF.LOST_AT}
    finally:
        attention_path(tasks, meta["id"]).unlink()


def test_a_bad_task_in_the_link_is_a_note_and_the_default(page_env, apptest):
    at = page(ntask="nope7")
    ok(at)
    assert not at.error
    assert any("ntask=nope7" in w.value for w in at.warning)
    assert at.session_state["needle.ntask"] == "passkey"


def test_the_lesson_scene_opens_the_recall_cell(page_env, tasks, monkeypatch, apptest):
    from kvviz.app.teach import lesson as L

    monkeypatch.chdir(ROOT)
    TF.write_answers(tasks)
    les = L.load("tova-vs-snapkv")
    n = next(s.number for s in les.scenes if s.title.startswith("A key the text returns to"))
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params["lesson"] = "tova-vs-snapkv"
    at.query_params["scene"] = str(n)
    at.run()
    ok(at)
    assert not at.error, [e.value for e in at.error]
    assert at.session_state["kv"]["view"] == "needle"
    assert at.session_state["needle.ntask"] == "recall3" and at.session_state["needle.nmode"] == "decode"
    assert at.session_state["needle.npol"] == "tova"
    assert any("kv-rem" in h.proto.body for h in at.get("html"))


def test_lesson_check_names_what_the_recall_scene_lacks(tasks, tmp_path, monkeypatch, capsys):
    from kvviz.__main__ import main

    monkeypatch.chdir(ROOT)
    shipped = str(ROOT / "lessons" / "tova-vs-snapkv.toml")
    monkeypatch.setenv("KVVIZ_TASKS_DIR", str(tmp_path / "none"))
    assert main(["lesson", "check", shipped]) == 2
    assert "state.ntask: 'recall3': no results of that task" in capsys.readouterr().err
    (tasks / "answers.json").unlink(missing_ok=True)
    monkeypatch.setenv("KVVIZ_TASKS_DIR", str(tasks))
    assert main(["lesson", "check", shipped]) == 2
    assert f"{{tasks.recall_by_k}}: {tasks / 'answers.json'}: no such file" in capsys.readouterr().err
    TF.write_answers(tasks)
    assert main(["lesson", "check", shipped]) == 0


def test_the_tasks_folder_follows_the_paths_rule(tmp_path, monkeypatch):
    from kvviz.core import paths

    monkeypatch.delenv("KVVIZ_TASKS_DIR", raising=False)
    monkeypatch.delenv("KVVIZ_TRACES_DIR", raising=False)
    monkeypatch.chdir(ROOT)
    assert paths.tasks_dir() == ROOT / "traces" / "tasks"
    monkeypatch.setenv("KVVIZ_TRACES_DIR", str(tmp_path))
    assert paths.tasks_dir() == tmp_path / "tasks" and paths.needle_dir() == tmp_path / "needle"
    monkeypatch.setenv("KVVIZ_TASKS_DIR", str(tmp_path / "mine"))
    assert paths.tasks_dir() == tmp_path / "mine"


def test_attention_axis_fits_the_reminders_and_names_the_keys_peak():
    att = np.full((TF.LAYERS, 256), 0.01, np.float32)
    att[:, TF.KEY_POS[0]:TF.KEY_POS[-1] + 4] = 0.3  # the key's own rows, far above the rest
    for a, b in TF.REMINDERS:
        att[:, a:b] = 0.03
    fig = NV.key_attention_figure(att, reminders=TF.REMINDERS, key_positions=TF.KEY_POS, lost={},
                                  layer=0).to_plotly_json()
    lo, hi = fig["layout"]["yaxis"]["range"]
    assert lo == 0 and 0.03 < hi < 0.3  # a reminder's bump fills the chart, the key runs above
    notes = [a["text"] for a in fig["layout"]["annotations"]]
    assert notes == [f"↑ up to 0.30<br>at the key (step {TF.KEY_POS[0]})"]
    flat = NV.key_attention_figure(np.full((1, 50), 0.2, np.float32), reminders=[], key_positions=[3],
                                   lost={}, layer=0).to_plotly_json()
    assert flat["layout"]["yaxis"]["range"][1] > 0.2 and not flat["layout"].get("annotations")


def test_the_long_table_names_each_runs_task_and_option(tasks):
    from kvviz.model.needle.results import layer_table

    long = layer_table(tasks)
    opts = long.groupby("task")[["reminder_every", "distractors", "phrase_words"]].agg(
        lambda c: sorted(set(c.dropna())) + ["<NA>"] * bool(c.isna().any()))
    assert opts.loc["recall"].tolist() == [[TF.K], ["<NA>"], ["<NA>"]]
    assert opts.loc["distractors"].tolist() == [["<NA>"], [2], ["<NA>"]]
    assert opts.loc["phrase"].tolist() == [["<NA>"], ["<NA>"], [4]]
    # one row per run x configuration x layer (one head row at layer granularity)
    recall = long[long.task == "recall"]
    assert len(recall) == 6 * (1 + 3 * len(TF.POLICIES)) * TF.LAYERS
