"""The needle's tasks beside the pass key, each generated offline from (seed, length, depth)
and scored by its own answer check:

- `passkey`: the pass key (kvviz.model.needle.prompt).
- `recall`: the pass key's sentence once, then a reminder that names the key without
  repeating it ("Keep the pass key in mind.") after every k-th haystack sentence, the last
  stretch before the question quiet (`--reminder-every K`). With no room for a reminder it
  is the pass-key prompt. A token the model returns to now and then.
- `distractors`: one key per named thing, several things (`--distractors N` besides the
  asked one); the question names one. Scored "right", "distractor" (which one), "no key".
- `phrase`: the answer is a phrase of several words (`--phrase-words N`). Scored "whole",
  "partial" (the words that survived, in order), "lost". A span of tokens that matter together.
- `returns`: the recall study's design. The pass key's sentence in the first half of the
  prompt (`depth` percent of the way from the instruction to KEY_BEFORE of it), then R
  returns (`--returns R`: RETURN, naming the key without repeating it) at fixed fractions
  of the prompt's tokens inside the eviction window of a budget of 3/4 of the prompt
  (RETURNS_AT), then a quiet stretch before the question. R = 0 is the
  no-returns control on the same haystack, key and key position.
- `vartrack`: variable tracking in the RULER style on the same geometry: the key assigned to
  a variable at the key's place, then H assignments (`--hops H`) passing the value on, each
  naming the previous variable, at the returns' places; the question asks the last
  variable's value. H = 0 asks the first variable's (the no-returns control).

Every check here needs neither torch nor a tokenizer except where it says so.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvviz.model.needle.compose import Insert, compose, place
from kvviz.model.needle.prompt import (
    FILLER,
    INTRO,
    NEEDLE,
    QUESTION,
    NeedlePrompt,
    check_depth,
    check_haystack,
    make_key,
)

TASKS = ("passkey", "recall", "distractors", "phrase", "returns", "vartrack")
OPTION = {"recall": "reminder_every", "distractors": "distractors", "phrase": "phrase_words",
          "returns": "returns", "vartrack": "hops"}
FLAG = {"reminder_every": "--reminder-every", "distractors": "--distractors", "phrase_words": "--phrase-words",
        "returns": "--returns", "hops": "--hops"}
DEFAULT = {"reminder_every": 20, "distractors": 2, "phrase_words": 4, "returns": 3, "hops": 2}
LEAST = {"reminder_every": 1, "distractors": 0, "phrase_words": 1, "returns": 0, "hops": 0}

# The returns' geometry, in fractions of the prompt's tokens: the key before KEY_BEFORE (so a
# budget of half the prompt or more holds it when eviction starts), the last return at
# RETURNS_AT[0], each earlier one RETURNS_AT[1] before the next (at 256 tokens: 197, 210,
# 223, all inside the eviction window of budget 192), the stretch from the last return to
# the question quiet (about 15 tokens at 256, then the answer's).
KEY_BEFORE = 0.45
RETURNS_AT = (0.87, 0.05)  # (the last return's first token, the spacing between returns)
MOST_RETURNS = 3           # 0.87 - 2 x 0.05 = 0.77: every return past a budget of 3/4 of the prompt
SNAP = 5                   # a return moves at most this many tokens to a sentence end
VARIABLES = ("QXR", "BKT", "MZW", "JDF", "PLV", "HGN", "TCY", "WRK", "DSB", "NFZ", "YVH", "KTP")
VAR_ASSIGN = "VAR {name} = {value}."
VAR_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find the variables and "
             "memorize their values. I will quiz you about the value of a variable.")
VAR_QUESTION = "What is the value of {name}? The value of {name} is"

REMINDER = "Keep the pass key in mind."
# the returns task's reminder: of the wordings lab/studies/wording_trial.py tried on the full
# cache (traces/studies/wording/trial.csv), the one it answered most often
RETURN = "Do not forget the number above."

# the people whose keys the distractors task names; the asked one and its distractors are
# drawn from here by the seed. The wording was chosen on the full cache (greedy, 300-600
# tokens, two distractors): with the asked name in the instruction as well as in the
# question and each key said once, SmolLM2-135M-Instruct answers the asked key in 23 of 24
# prompts; with the name in the question only it often gives the key of the next name.
THINGS = ("Anna", "Boris", "Clara", "David", "Emma", "Felix", "Greta", "Hugo", "Irene", "James",
          "Karen", "Leo", "Maria", "Nora", "Oscar", "Paul")
THING_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find the pass key of {name} and "
               "memorize it. I will quiz you about the pass key of {name}.")
THING_KEY = "The pass key of {name} is {key}."
THING_QUESTION = "What is the pass key of {name}? The pass key of {name} is"

WORDS = ("thunder", "falcon", "amber", "maple", "river", "silver", "garden", "candle", "winter", "copper",
         "violet", "harbor", "meadow", "rocket", "lantern", "pepper", "marble", "canyon", "velvet", "willow",
         "orange", "tiger", "castle", "summer", "forest", "crystal", "shadow", "island", "pencil", "dragon")
PHRASE = "The pass phrase is {phrase}. Remember it."
PHRASE_QUESTION = "What is the pass phrase? The pass phrase is"
NEIGHBOURS = 4  # the phrase's neighbours: this many tokens each side of it, outside it (the span study's control)


@dataclass(frozen=True)
class Task:
    """A task and its one option (None: the option's default; passkey has none)."""
    name: str = "passkey"
    reminder_every: int | None = None
    distractors: int | None = None
    phrase_words: int | None = None
    returns: int | None = None
    hops: int | None = None

    def __post_init__(self):
        check(self)
        opt = OPTION.get(self.name)
        if opt is not None and getattr(self, opt) is None:
            object.__setattr__(self, opt, DEFAULT[opt])

    @property
    def option(self) -> int | None:
        return getattr(self, OPTION[self.name]) if self.name in OPTION else None

    @property
    def prefix(self) -> str:
        """The run id's prefix: none for the pass key (its ids are unchanged), else the task
        and its option, e.g. `recall20-`."""
        return "" if self.name == "passkey" else f"{self.name}{self.option}-"

    def record(self) -> dict:
        return {"task": self.name, **{o: getattr(self, o) for o in OPTION.values()}}


def _count(flag: str, value, least: int) -> None:
    if isinstance(value, bool) or int(value) != value or value < least:
        raise ValueError(f"{flag} must be an integer >= {least}, got {value}")


def check(t: Task) -> None:
    """ValueError naming the option: an unknown task, an option below its least value, an
    option given to a task that does not take it."""
    if t.name not in TASKS:
        raise ValueError(f"--task: unknown task {t.name!r}; known: {', '.join(TASKS)}")
    for opt, flag in FLAG.items():
        value = getattr(t, opt)
        if value is None:
            continue
        if OPTION.get(t.name) != opt:
            owner = next(k for k, v in OPTION.items() if v == opt)
            raise ValueError(f"{flag}: only --task {owner} takes it, not --task {t.name}")
        _count(flag, value, LEAST[opt])
    if t.phrase_words is not None and t.phrase_words > len(WORDS):
        raise ValueError(f"--phrase-words {t.phrase_words}: the phrase's words are drawn without repeats from "
                         f"{len(WORDS)} words, so at most {len(WORDS)}")
    for opt in ("returns", "hops"):
        if getattr(t, opt) is not None and getattr(t, opt) > MOST_RETURNS:
            raise ValueError(f"{FLAG[opt]} {getattr(t, opt)}: at most {MOST_RETURNS} fit between the middle of "
                             "the prompt and its quiet stretch (kvviz.model.needle.tasks.RETURNS_AT)")
    if t.distractors is not None and t.distractors + 1 > len(THINGS):
        raise ValueError(f"--distractors {t.distractors}: the keys belong to {len(THINGS)} names, so at most "
                         f"{len(THINGS) - 1} distractors")


def _rng(seed: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), salt])


def draw_things(seed: int, n: int) -> tuple[list[str], list[str]]:
    """n + 1 distinct names and keys from the seed; index 0 is the asked one, its key make_key(seed)."""
    names = [THINGS[i] for i in _rng(seed, 2345).permutation(len(THINGS))[:n + 1]]
    keys, rng = [make_key(seed)], _rng(seed, 3456)
    while len(keys) < n + 1:
        k = str(int(rng.integers(10 ** 4, 10 ** 5)))
        if k not in keys:
            keys.append(k)
    return names, keys


def draw_phrase(seed: int, n: int) -> list[str]:
    return [WORDS[i] for i in _rng(seed, 4567).permutation(len(WORDS))[:n]]


def _hay(haystack):
    return check_haystack(FILLER if haystack is None else haystack)


def _digits(c, span, key: str) -> list[int]:
    """Token indices of every mention of `key` inside the character span."""
    text = c.text
    out, at = [], span[0]
    while (at := text.find(key, at, span[1])) >= 0:
        out += c.tokens_of((at, at + len(key)))
        at += len(key)
    return sorted(set(out))


def _prompt(c, key, key_positions, question, length, depth, **extra) -> NeedlePrompt:
    q = c.text.rindex(question)
    qs = next(i for i, (a, b) in enumerate(c.offsets) if b > q)
    return NeedlePrompt(c.text, key, c.ids, c.offsets, key_positions, qs, int(length), depth, **extra)


def recall(tok, length: int, depth, seed: int, every: int, haystack: str | None = None) -> NeedlePrompt:
    """The pass key's sentence at `depth`, then REMINDER after every `every`-th haystack
    sentence after it (with_reminders' rule). Reminders' token spans in `reminders`."""
    depth, key = check_depth(depth), make_key(seed)
    c = compose(tok, length, _hay(haystack), [Insert(depth, NEEDLE.format(key=key))], QUESTION,
                REMINDER, every, "the pass key")
    spans = [(c.tokens_of(r)[0], c.tokens_of(r)[-1] + 1) for r in c.reminders]
    return _prompt(c, key, _digits(c, c.inserts[0], key), QUESTION, length, depth, task="recall",
                   reminders=spans)


def distractor_depths(depth: float, n: int) -> list[float]:
    """Evenly through the haystack, 100 (i + 1) / (n + 1) for i < n, each one closer to
    the asked key's depth than half that spacing moved to half the spacing after it, so no
    distractor shares the asked key's place (it stays <= 100: the last even depth is
    100 - spacing)."""
    gap = 100 / (n + 1)
    return [depth + gap / 2 if abs(gap * (i + 1) - depth) < gap / 2 else gap * (i + 1) for i in range(n)]


def distractors(tok, length: int, depth, seed: int, n: int, haystack: str | None = None) -> NeedlePrompt:
    """n + 1 keys of named people: the asked one's sentence at `depth`, the n others at
    distractor_depths; the instruction and the question name the asked one."""
    depth = check_depth(depth)
    names, keys = draw_things(seed, n)
    depths = [depth] + distractor_depths(depth, n)
    inserts = [Insert(d, THING_KEY.format(name=nm, key=k)) for d, nm, k in zip(depths, names, keys)]
    question = THING_QUESTION.format(name=names[0])
    c = compose(tok, length, _hay(haystack), inserts, question, what=f"--distractors {n}",
                intro=THING_INTRO.format(name=names[0]))
    return _prompt(c, keys[0], _digits(c, c.inserts[0], keys[0]), question, length, depth, task="distractors",
                   target=names[0], distractor_names=names[1:], distractor_keys=keys[1:],
                   distractor_positions=[_digits(c, s, k) for s, k in zip(c.inserts[1:], keys[1:])])


def phrase(tok, length: int, depth, seed: int, n: int, haystack: str | None = None) -> NeedlePrompt:
    """The pass phrase of n seeded words at `depth`; key_positions are the phrase's tokens."""
    depth = check_depth(depth)
    words = " ".join(draw_phrase(seed, n))
    c = compose(tok, length, _hay(haystack), [Insert(depth, PHRASE.format(phrase=words))], PHRASE_QUESTION,
                what=f"--phrase-words {n}")
    at = c.text.index(words, c.inserts[0][0])
    span = c.tokens_of((at, at + len(words)))
    near = [i for i in range(span[0] - NEIGHBOURS, span[-1] + NEIGHBOURS + 1) if i not in span and 0 <= i < len(c.ids)]
    return _prompt(c, words, span, PHRASE_QUESTION, length, depth, task="phrase", neighbour_positions=near)


def return_positions(length: int, n: int) -> list[int]:
    """The prompt token index each of n returns starts at, earliest first (RETURNS_AT)."""
    last, gap = RETURNS_AT
    return [int(round((last - gap * (n - 1 - i)) * length)) for i in range(n)]


def key_position(length: int, depth: float, intro_tokens: int) -> int:
    """The key sentence's first token: `depth` percent of the way from the end of the
    instruction to KEY_BEFORE of the prompt."""
    end = int(KEY_BEFORE * length)
    return intro_tokens + 1 + int(round(depth / 100 * max(0, end - intro_tokens - 1)))


def returns(tok, length: int, depth, seed: int, n: int, haystack: str | None = None) -> NeedlePrompt:
    """The pass key's sentence in the first part of the prompt (key_position), then n returns
    (REMINDER) starting at return_positions, the question after a quiet stretch. The
    returns' token spans in `reminders`."""
    depth, key = check_depth(depth), make_key(seed)
    at = key_position(length, depth, len(_intro_ids(tok, INTRO)))
    pieces = [(at, NEEDLE.format(key=key))] + [(p, RETURN) for p in return_positions(length, n)]
    c = place(tok, length, _hay(haystack), pieces, QUESTION, what=f"--returns {n}", snap=SNAP)
    spans = [(c.tokens_of(r)[0], c.tokens_of(r)[-1] + 1) for r in c.inserts[1:]]
    return _prompt(c, key, _digits(c, c.inserts[0], key), QUESTION, length, depth, task="returns",
                   reminders=spans)


def draw_variables(seed: int, n: int) -> list[str]:
    return [VARIABLES[i] for i in _rng(seed, 5678).permutation(len(VARIABLES))[:n]]


def vartrack(tok, length: int, depth, seed: int, hops: int, haystack: str | None = None) -> NeedlePrompt:
    """VAR A = key at the key's place (key_position), then `hops` assignments VAR B = A,
    VAR C = B, ... at the returns' places (return_positions); the question asks the last
    variable's value. The assignments after the first are the returns (`reminders`)."""
    depth, key = check_depth(depth), make_key(seed)
    names = draw_variables(seed, hops + 1)
    at = key_position(length, depth, len(_intro_ids(tok, VAR_INTRO)))
    values = [key] + names[:-1]
    pieces = [(p, VAR_ASSIGN.format(name=nm, value=v))
              for p, nm, v in zip([at] + return_positions(length, hops), names, values)]
    question = VAR_QUESTION.format(name=names[-1])
    c = place(tok, length, _hay(haystack), pieces, question, what=f"--hops {hops}", intro=VAR_INTRO, snap=SNAP)
    spans = [(c.tokens_of(r)[0], c.tokens_of(r)[-1] + 1) for r in c.inserts[1:]]
    return _prompt(c, key, _digits(c, c.inserts[0], key), question, length, depth, task="vartrack",
                   reminders=spans, target=names[-1])


def _intro_ids(tok, intro: str) -> list[int]:
    from kvviz.model.needle.prompt import _tokens

    return _tokens(tok, intro)[0]


def build(tok, task: Task, length: int, depth, seed: int, haystack: str | None = None) -> NeedlePrompt:
    """The task's prompt (ValueError naming the option where it cannot be built)."""
    if task.name == "passkey":
        from kvviz.model.needle.prompt import build as passkey

        return passkey(tok, length, depth, seed, haystack)
    return {"recall": recall, "distractors": distractors, "phrase": phrase, "returns": returns,
            "vartrack": vartrack}[task.name](
        tok, length, depth, seed, task.option, haystack)


# --- answer checks -----------------------------------------------------------------------

@dataclass(frozen=True)
class Score:
    outcome: str   # passkey, recall: right / wrong; distractors: right / distractor / no key;
    #                phrase: whole / partial / lost
    detail: str    # the distractor's name; the phrase's words found, in order; else ""
    correct: bool


def score_key(answer: str, key: str) -> Score:
    ok = key in str(answer)
    return Score("right" if ok else "wrong", "", ok)


def score_distractors(answer: str, key: str, names, keys) -> Score:
    """The key that appears first in the answer decides: the asked one's ("right"), a
    distractor's ("distractor", its name), none of them ("no key")."""
    answer = str(answer)
    found = [(answer.find(k), i) for i, k in enumerate([key, *keys]) if k in answer]
    if not found:
        return Score("no key", "", False)
    _, i = min(found)
    return Score("right", "", True) if i == 0 else Score("distractor", list(names)[i - 1], False)


def score_phrase(answer: str, phrase: str) -> Score:
    """Words compared lower-case, punctuation ignored. "whole": the phrase's words
    consecutive and in order; else the phrase's words found in order (each after the
    previous one found): "partial" with those words, "lost" with none."""
    want = phrase.lower().split()
    got = re.findall(r"[a-z]+", str(answer).lower())
    if any(got[i:i + len(want)] == want for i in range(len(got) - len(want) + 1)):
        return Score("whole", " ".join(want), True)
    kept, at = [], 0
    for w in want:
        if w in got[at:]:
            at = got.index(w, at) + 1
            kept.append(w)
    return Score("partial", " ".join(kept), False) if kept else Score("lost", "", False)


def score(meta: dict, answer: str) -> Score:
    """A run's answer under its task's check (meta as a run records it)."""
    task = meta.get("task", "passkey")
    if task == "distractors":
        return score_distractors(answer, meta["key"], meta["distractor_names"], meta["distractor_keys"])
    if task == "phrase":
        return score_phrase(answer, meta["key"])
    return score_key(answer, meta["key"])
