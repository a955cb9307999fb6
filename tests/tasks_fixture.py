"""A small synthetic tasks folder (recall, distractors, phrase) in `kvviz needle --task`'s
schema, for the Forgetting view's task tests. No model runs.

Each run's answers are chosen so the task's check has something to say: TOVA answers
wrong (recall: no key; distractors: Greta's key; phrase: two of its four words), H2O
answers nothing useful (no key; the phrase lost), the rest answer right. In decode mode TOVA
evicts the key in layer 1 at LOST_AT steps after the key's last token, Scissorhands in layer
2 at SC_LOST_AT steps after it; H2O and SnapKV never evict it. The tables come from
kvviz.model.needle's own writer (it scores the answers).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvviz.model.needle.results import save_run, write_tables

KEY = "42817"
PHRASE = "thunder falcon amber maple"
NAMES = ("Anna", "Greta", "Hugo")  # the asked one, then the distractors
KEYS = ("42817", "55031", "71920")
LAYERS, NEW = 3, 4
POLICIES = ("tova", "h2o", "scissorhands", "snapkv")
LOST_AT, SC_LOST_AT = 5, 40
K = 3  # the recall runs' reminder_every
REMINDERS = [(60, 67), (100, 107), (140, 147)]  # [start, end) token spans
KEY_POS = [20, 21, 22]
Q0_BACK = 8  # the question's tokens at the end


def _answers(task: str) -> dict:
    return {"recall": {"tova": " the pass key is", "h2o": " what?"},
            "distractors": {"tova": f" {KEYS[1]}.", "h2o": " no idea"},
            "phrase": {"tova": " thunder amber", "h2o": " something else"}}[task]


def right_answer(task: str) -> str:
    return {"recall": f" {KEY}.", "distractors": f" {KEY}.", "phrase": f" {PHRASE}."}[task]


def write_run(out: Path, task: str, option: int, length: int, depth, seed: int, mode: str,
              budgets=(64, 128), gran: str = "layer") -> str:
    rng = np.random.default_rng([length, seed, mode == "prefill", len(task)])
    T0, T = length, length + NEW
    q0 = T0 - Q0_BACK
    tokens = [" filler"] * T0
    for p in KEY_POS:
        tokens[p] = "7"
    extra = {"task": task, "reminder_every": None, "distractors": None, "phrase_words": None,
             "reminders": [], "target": "", "distractor_names": [], "distractor_keys": [],
             "distractor_positions": []}
    key = KEY
    if task == "recall":
        extra.update(reminder_every=option, reminders=[list(r) for r in REMINDERS])
        for a, b in REMINDERS:
            tokens[a:b] = [" Keep", " the", " pass", " key", " in", " mind", "."]
    elif task == "distractors":
        extra.update(distractors=option, target=NAMES[0], distractor_names=list(NAMES[1:1 + option]),
                     distractor_keys=list(KEYS[1:1 + option]),
                     distractor_positions=[[90 + 30 * i, 91 + 30 * i] for i in range(option)])
    elif task == "phrase":
        extra.update(phrase_words=option)
        key = PHRASE
    prefix = f"{task}{option}-"
    id_ = f"{prefix}L{length}-d{depth:g}-s{seed}-{mode}-{gran}"
    configs = [{"policy": "full", "params": {}, "budget": None, "label": "full"}]
    configs += [{"policy": p, "params": {}, "budget": b, "label": f"{p}@{b}"} for b in budgets for p in POLICIES]
    C = len(configs)
    ev = np.full((C, LAYERS, 1, T), -1, np.int32)
    for c, cfg in enumerate(configs[1:], 1):
        for li in range(LAYERS):
            for p in range(T0):
                if p not in KEY_POS and rng.random() < 0.4:
                    ev[c, li, 0, p] = T0 - 1 if mode == "prefill" else rng.integers(p, T0)
        if cfg["policy"] == "tova":
            ev[c, 1, 0, KEY_POS] = T0 - 1 if mode == "prefill" else KEY_POS[-1] + LOST_AT
        if cfg["policy"] == "scissorhands":
            ev[c, 2, 0, KEY_POS] = T0 - 1 if mode == "prefill" else KEY_POS[-1] + SC_LOST_AT
    answers = [_answers(task).get(c["policy"], right_answer(task)) for c in configs]
    meta = dict(id=id_, length=length, depth=depth, seed=seed, prompt_mode=mode, granularity=gran,
                key=key, key_positions=KEY_POS, question_start=q0, prompt_len=T0, max_new_tokens=NEW,
                haystack="synthetic", model={"name": "synthetic"}, kvviz_version="test", configs=configs,
                answers=answers, correct=[a.strip().rstrip(".") == key for a in answers],
                agreement=[1.0] * C, layers=LAYERS, kv_heads=1, **extra)
    save_run(out, meta, np.arange(T0), tokens, np.tile(np.arange(NEW), (C, 1)), ev)
    return id_


def write_tasks(out) -> Path:
    """recall (K=3, decode and prefill, seeds 0, 1 and 3, 256 tokens at depth 10, budgets 64, 128
    and 192: the lesson's cell among them), distractors (2) and phrase (4) in prefill, seeds 0-1;
    then results.csv/json."""
    out = Path(out)
    for seed in (0, 1, 3):
        for mode in ("decode", "prefill"):
            write_run(out, "recall", K, 256, 10, seed, mode, budgets=(64, 128, 192))
    for seed in (0, 1):
        write_run(out, "distractors", 2, 256, 10, seed, "prefill")
        write_run(out, "phrase", 4, 256, 10, seed, "prefill")
    write_tables(out)
    return out


ANSWERS = {
    "recall": {"mode": "decode", "length": 256, "budget": 128,
               "by_k": [{"reminder_every": 20, "reminders": 0, "prompts": 30,
                         "accuracy": {"tova": [2, 30], "h2o": [3, 30], "scissorhands": [1, 30]},
                         "tova_lost_both_kept": 0, "tova_kept_both_lost": 1,
                         "against": {"h2o": [1, 2], "scissorhands": [0, 1]}},
                        {"reminder_every": 3, "reminders": 9, "prompts": 30,
                         "accuracy": {"tova": [4, 30], "h2o": [10, 30], "scissorhands": [9, 30]},
                         "tova_lost_both_kept": 6, "tova_kept_both_lost": 0,
                         "against": {"h2o": [7, 1], "scissorhands": [6, 0]}}],
               "longer": {"512@384": [{"reminder_every": 20, "reminders": 3, "prompts": 30,
                                       "accuracy": {"tova": [28, 30], "h2o": [19, 30], "scissorhands": [0, 30]},
                                       "tova_lost_both_kept": 0, "tova_kept_both_lost": 9,
                                       "against": {"h2o": [0, 9], "scissorhands": [0, 28]}}]},
               "answer": "Recall: TOVA lost the key where both others kept it in 6 prompts."},
    "phrase": {"answer": "Phrase: a test sentence."},
    "distractors": {"answer": "Distractors: a test sentence."},
    "modes": {"answer": "Modes: a test sentence."},
}


def write_answers(out) -> Path:
    path = Path(out) / "answers.json"
    path.write_text(json.dumps(ANSWERS))
    return path
