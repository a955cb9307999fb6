"""The needle tasks on SmolLM2's tokenizer and model: each generator puts its key, reminders,
distractors or phrase at the token positions it records, to the exact length, at the depth,
the same for the same seed; the refusals that need the tokenizer; each task end to end
through `kvviz needle --task`; the attention the reminders pay the key."""
import numpy as np
import pytest

from kvviz.__main__ import main
from kvviz.model.needle import list_runs, load_results, load_run
from kvviz.model.needle.prompt import NEEDLE, QUESTION
from kvviz.model.needle.prompt import build as passkey
from kvviz.model.needle.tasks import (
    PHRASE_QUESTION,
    REMINDER,
    THING_KEY,
    THING_QUESTION,
    Task,
    build,
    distractors,
    phrase,
    recall,
)

TASKS = [Task("recall", reminder_every=5), Task("distractors", distractors=2), Task("phrase", phrase_words=4)]


@pytest.fixture(scope="module")
def tok(torch_stack):
    from kvviz.model.needle.run import load_tokenizer

    return load_tokenizer(None)


def _say(tok, p, positions) -> str:
    return "".join(tok.decode([p.ids[i]]) for i in positions)


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
@pytest.mark.parametrize("length", [256, 301])
@pytest.mark.parametrize("depth", [0, 50, 100])
def test_exact_length_and_the_same_prompt_for_the_same_seed(tok, task, length, depth):
    p = build(tok, task, length, depth, 3)
    assert len(p.ids) == length == p.length
    assert p.ids == tok(p.text, add_special_tokens=False)["input_ids"]
    q = build(tok, task, length, depth, 3)
    assert (q.text, q.ids, q.key_positions, q.reminders, q.distractor_positions) == \
        (p.text, p.ids, p.key_positions, p.reminders, p.distractor_positions)
    assert build(tok, task, length, depth, 4).text != p.text
    assert max(p.key_positions) < p.question_start


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_depth_moves_the_answer_through_the_haystack(tok, task):
    ps = [build(tok, task, 256, d, 0) for d in (0, 25, 50, 75, 100)]
    starts = [p.key_positions[0] for p in ps]
    assert starts == sorted(starts) and len(set(starts)) == 5
    assert "grass" not in tok.decode(ps[0].ids[:ps[0].key_positions[0]])  # depth 0: no filler before it
    after = tok.decode(ps[-1].ids[max(ps[-1].key_positions) + 1:ps[-1].question_start]).strip()
    # depth 100: the answer's sentence ends, then the question
    assert after == {"recall": "is the pass key.", "distractors": ".", "phrase": ". Remember it."}[task.name]


def test_recall_reminders_every_k_sentences_after_the_key(tok):
    p = recall(tok, 300, 10, 0, 5)
    assert len(p.reminders) >= 2
    for a, b in p.reminders:
        assert tok.decode(p.ids[a:b]).strip() == REMINDER
    assert p.text.count(REMINDER) == len(p.reminders)
    assert min(a for a, _ in p.reminders) > max(p.key_positions)
    assert _say(tok, p, p.key_positions) == p.key * 2
    # the haystack after the key's sentence, cut at each reminder: `every` sentences before
    # each reminder, at least `every` whole sentences after the last one
    after = p.text[p.text.index(NEEDLE.format(key=p.key)) + len(NEEDLE.format(key=p.key)):p.text.rindex(QUESTION)]
    chunks = after.split(REMINDER)
    assert [c.count(".") for c in chunks[:-1]] == [5] * len(p.reminders)
    assert chunks[-1].count(".") >= 5


def test_recall_without_room_for_a_reminder_is_the_pass_key(tok):
    for length, depth, seed in ((256, 10, 0), (300, 50, 1), (513, 90, 2)):
        a, b = passkey(tok, length, depth, seed), recall(tok, length, depth, seed, 10 ** 6)
        assert (a.text, a.ids, a.key_positions, a.question_start) == (b.text, b.ids, b.key_positions, b.question_start)
        assert b.reminders == []


def test_distractors_at_their_positions(tok):
    p = distractors(tok, 400, 50, 5, 3)
    assert len(p.distractor_keys) == len(p.distractor_names) == len(p.distractor_positions) == 3
    assert p.target not in p.distractor_names and p.key not in p.distractor_keys
    assert _say(tok, p, p.key_positions) == p.key
    for name, key, pos in zip(p.distractor_names, p.distractor_keys, p.distractor_positions):
        assert _say(tok, p, pos) == key
        assert THING_KEY.format(name=name, key=key) in p.text
    assert THING_KEY.format(name=p.target, key=p.key) in p.text
    assert tok.decode(p.ids[p.question_start:]).strip() == THING_QUESTION.format(name=p.target)
    assert p.text.index(p.target) < p.text.index(THING_KEY.format(name=p.target, key=p.key))  # named first


def test_phrase_tokens_are_the_phrase(tok):
    p = phrase(tok, 300, 40, 2, 5)
    assert len(p.key.split()) == 5
    assert _say(tok, p, p.key_positions).strip() == p.key
    assert p.key_positions == list(range(p.key_positions[0], p.key_positions[-1] + 1))  # one span
    assert tok.decode(p.ids[p.question_start:]).strip() == PHRASE_QUESTION


@pytest.mark.parametrize("argv, message", [
    (["--task", "distractors", "--distractors", "15", "--lengths", "256"],
     "--lengths 256: --distractors 15 does not fit"),
    (["--task", "phrase", "--phrase-words", "30", "--lengths", "60", "--max-new-tokens", "64"],
     "--lengths 60: --phrase-words 30 does not fit"),
    (["--task", "phrase", "--max-new-tokens", "2"], "--max-new-tokens 2: the pass phrase of --phrase-words 4"),
])
def test_refusals_that_count_tokens_come_before_the_model(tok, tmp_path, capsys, monkeypatch, argv, message):
    import kvviz.model.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code = main(["needle", "--out", str(tmp_path / "out"), "--policies", "tova", "--budgets", "64", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def _held(ev, positions, step):
    e = ev[..., positions]
    return (e == -1) | (e > step)


@pytest.mark.parametrize("task", [Task("recall", reminder_every=10), Task("distractors", distractors=2),
                                  Task("phrase", phrase_words=4)], ids=lambda t: t.name)
def test_each_task_end_to_end(smollm, tmp_path, capsys, task):
    mode = "prefill"  # seconds; decode mode reads the prompt token by token (a minute here)
    opt = {"recall": "--reminder-every", "distractors": "--distractors", "phrase": "--phrase-words"}[task.name]
    code = main(["needle", "--task", task.name, opt, str(task.option), "--out", str(tmp_path), "--lengths", "256",
                 "--depths", "10", "--seeds", "0", "--policies", "tova", "--budgets", "64", "--prompt-modes", mode,
                 "--threads", "1", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    (id_,) = list_runs(tmp_path)
    assert id_ == f"{task.name}{task.option}-L256-d10-s0-{mode}-layer"
    run, p = load_run(tmp_path, id_), build(smollm[0], task, 256, 10, 0)
    m, ev = run["meta"], run["evicted_at"]
    assert m["key_positions"] == p.key_positions and m["task"] == task.name
    assert [tuple(r) for r in m["reminders"]] == p.reminders and m["distractor_positions"] == p.distractor_positions
    df = load_results(tmp_path)
    full, tova = df.iloc[0], df.iloc[1]
    assert full.label == "full" and full.correct  # the full cache does the task at this length
    said = {"recall": "reminder every", "distractors": "distractors", "phrase": "phrase words"}[task.name]
    assert f"{task.name} ({said} {task.option}) at 256 tokens: 100% of 1 prompts, kept" in out
    # the held share per layer, from the eviction log by the rule (held after the prompt's last step)
    T0 = m["prompt_len"]
    assert tova.held_end_by_layer == pytest.approx(_held(ev[1], p.key_positions, T0 - 1).mean(axis=(1, 2)).tolist())
    assert full.held_end == 1.0
    if task.name == "recall":
        assert tova.reminder_positions == [a for a, _ in p.reminders] and tova.outcome in ("right", "wrong")
        assert tova.correct == (p.key in tova.answer)
    if task.name == "distractors":
        assert full.outcome == "right" and full.target == p.target
        if tova.outcome == "distractor":
            assert p.distractor_keys[p.distractor_names.index(tova.detail)] in tova.answer
    if task.name == "phrase":
        assert full.outcome == "whole" and full.detail == p.key
        kept = tova.detail.split()
        assert tova.outcome in ("whole", "partial", "lost") and all(w in tova.answer.lower() for w in kept)


def test_reminders_draw_attention_to_the_key(smollm):
    from lab.reminder_attention import reminder_attention

    # 600 tokens, a reminder every 20 sentences (the study's defaults): quiet stretches long
    # enough to contrast with (at 300 tokens every 5-10 sentences the contrast is weak)
    p = recall(smollm[0], 600, 10, 0, 20)
    r = reminder_attention(smollm, p)
    assert r.at_reminders.shape == r.between.shape == (30,)
    assert (r.ratio > 1).sum() >= 25, np.round(r.ratio, 2).tolist()  # nearly every layer


def test_a_small_real_study_reports_each_question(smollm, tmp_path):
    """The study's pipeline on a real grid two prompts wide per task: the tasks report reads it
    and answers from it; what it says agrees with the runs' own answers."""
    from kvviz.model.needle.grid import Grid
    from kvviz.model.needle.run import run_grid
    from lab import tasks_report

    trio = ["tova", "h2o", "scissorhands"]
    pk = ["snapkv:pool_kernel=5,obs_window=16", "snapkv:pool_kernel=1,obs_window=16"]
    for task, policies, new in ((Task("recall", reminder_every=5), trio, 8), (Task("phrase", phrase_words=4), pk, 12),
                                (Task("distractors", distractors=2), trio, 8)):
        run_grid(Grid(lengths=[256], depths=[10], seeds=[0, 1], policies=policies, budgets=[64],
                      prompt_modes=["prefill"], max_new_tokens=new, task=task), tmp_path, model=smollm,
                 progress=False)
    doc, answers, summary = tasks_report.report(tmp_path)
    df = load_results(tmp_path)
    ev = df[df.policy != "full"]
    for (task, _), g in ev.groupby(["task", "label"]):
        row = summary[(summary.task == task) & (summary.label == tasks_report.prepare(g).name.iloc[0])]
        assert row.right.sum() == g.correct.sum() and row.prompts.sum() == len(g)
    assert answers["recall"]["budget"] is None and answers["recall"]["answer"] == "No recall prompt ran in decode mode."
    pre = answers["recall"]["prefill"]["budgets"]["64"][0]
    tova = df[(df.task == "recall") & (df.policy == "tova")]
    assert pre["accuracy"]["tova"] == [int(tova.correct.sum()), 2]
    assert "phrase prompts at budget 64" in answers["phrase"]["answer"]
    assert "## 3. Among look-alikes" in doc and "### distractors2" in doc
