"""The pass-key prompt (Mohtashami & Jaggi 2023), in a wording SmolLM2-135M-Instruct answers
with its full cache: an instruction, a haystack with the key's sentence at a depth, the question.

The prompt is built to a token length and tokenised the way every kvviz model run
tokenises (kvviz.model.models.tokenize), so the recorded positions are the model's positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

INTRO = ("There is an important info hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
DIGITS = 5


@dataclass
class NeedlePrompt:
    text: str
    key: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    key_positions: list[int]   # token indices of the key's digits (both mentions); phrase: the phrase's tokens
    question_start: int        # token index of the question's first token
    length: int
    depth: float
    task: str = "passkey"      # kvviz.model.needle.tasks.TASKS; `key` is the task's answer
    reminders: list[tuple[int, int]] = field(default_factory=list)  # recall: token span [start, end) of each
    target: str = ""           # distractors: the asked name
    distractor_names: list[str] = field(default_factory=list)
    distractor_keys: list[str] = field(default_factory=list)
    distractor_positions: list[list[int]] = field(default_factory=list)  # each distractor key's tokens
    neighbour_positions: list[int] = field(default_factory=list)  # phrase: NEIGHBOURS tokens each side of it


def make_key(seed: int, digits: int = DIGITS) -> str:
    """`digits` random digits from the seed, no leading zero (so it reads as a number)."""
    return str(int(np.random.default_rng([int(seed), 1234]).integers(10 ** (digits - 1), 10 ** digits)))


def check_depth(depth) -> float:
    d = float(depth)
    if not 0 <= d <= 100:
        raise ValueError(f"--depths: a depth is a percent of the haystack, 0-100; got {depth:g}")
    return d


def check_haystack(text: str, where: str = "--haystack") -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: the haystack is empty")
    return " ".join(text.split())  # one line: the prompt reads as prose


def _tokens(tok, text):
    from kvviz.model.models import tokenize

    ids, offsets, _ = tokenize(tok, text, 10 ** 9)
    if offsets is None:
        raise ValueError("the needle needs a fast tokenizer (character offsets) to find the key's tokens")
    return ids, offsets


def minimum_length(tok) -> int:
    """Tokens of the prompt with an empty haystack: the shortest length a key fits in."""
    return len(_tokens(tok, _join("", "", make_key(0)))[0])


def _join(before: str, after: str, key: str, question: str = QUESTION) -> str:
    return " ".join(p for p in (INTRO, before, NEEDLE.format(key=key), after, question) if p)


def _cut(hay: str, hay_offsets, n: int, depth: float) -> tuple[str, str]:
    """The haystack's first n tokens, split at `depth` percent, the split moved back to the
    end of a sentence when one is within 200 characters (the key gets its own sentence)."""
    end = hay_offsets[n - 1][1] if n > 0 else 0
    part = hay[:end]
    split = split_at(part, hay_offsets, n, depth)
    return part[:split].strip(), part[split:].strip()


def split_at(part: str, hay_offsets, n: int, depth: float) -> int:
    """Character index of `depth` percent of the first n haystack tokens (`part`, their
    text), moved back to the end of a sentence when one is within 200 characters."""
    k = int(round(depth / 100 * n))
    split = hay_offsets[k - 1][1] if k > 0 else 0
    if 0 < split < len(part):
        dot = part.rfind(". ", max(0, split - 200), split + 1)
        if dot >= 0:
            split = dot + 1
    return split


def repeat_haystack(tok, hay: str, length: int):
    """(text, token ids, offsets) of `hay` repeated until it holds at least `length` tokens."""
    unit = hay
    while len(_tokens(tok, hay)[0]) < length:
        hay = hay + " " + unit
    return (hay, *_tokens(tok, hay))


def build(tok, length: int, depth, seed: int, haystack: str | None = None) -> NeedlePrompt:
    """The prompt of `length` tokens (the nearest below when the tokenizer cannot hit it),
    key from `seed`, its sentence at `depth` percent of the haystack. ValueError names the
    parameter: a length the key and question do not fit in, a depth outside 0-100, an empty
    haystack. A haystack shorter than needed is repeated."""
    depth = check_depth(depth)
    hay = check_haystack(FILLER if haystack is None else haystack)
    key = make_key(seed)
    need = minimum_length(tok)
    if length < need + 1:
        raise ValueError(f"--lengths {length}: the pass key does not fit; the instruction, the key's "
                         f"sentence and the question take {need} tokens, so a length must be at least {need + 1}")
    hay, hay_ids, hay_off = repeat_haystack(tok, hay, length)
    n = min(len(hay_ids), length - need)
    best = None
    for _ in range(12):  # the joins merge or split a few tokens: correct n until it fits
        text = _join(*_cut(hay, hay_off, n, depth), key)
        ids, offsets = _tokens(tok, text)
        if len(ids) <= length and (best is None or len(ids) > len(best[1])):
            best = (text, ids, offsets)
        if len(ids) == length:
            break
        n = max(0, min(len(hay_ids), n + length - len(ids)))
    if best is None:
        raise ValueError(f"--lengths {length}: cannot build a prompt this short around the pass key")
    text, ids, offsets = best
    return NeedlePrompt(text, key, ids, offsets, key_positions(text, offsets, key),
                        question_start(text, offsets), int(length), depth)


def key_positions(text: str, offsets, key: str) -> list[int]:
    """Token indices whose characters overlap a mention of the key inside the key's sentence."""
    start = text.index(NEEDLE.format(key=key))
    spans, at = [], start
    for _ in range(2):
        at = text.index(key, at)
        spans.append((at, at + len(key)))
        at += len(key)
    return [i for i, (a, b) in enumerate(offsets) if b > a and any(a < e and b > s for s, e in spans)]


def build_around(tok, passage: str, key: str, question: str = QUESTION, depth: float = 50.0,
                 max_tokens: int | None = None) -> NeedlePrompt:
    """The pass-key prompt around a passage, key and question the user gives (the app's own
    run), in the same wording as `build`: the key's sentence goes in at `depth` percent of
    the passage's characters, moved back to a sentence end; the passage is used once, whole.
    ValueError names the field: an empty passage or question, a prompt over `max_tokens`."""
    depth = check_depth(depth)
    hay = check_haystack(passage, "passage")
    question = question.strip()
    if not question:
        raise ValueError("question: it is empty")
    cut = int(round(depth / 100 * len(hay)))
    dot = hay.rfind(". ", 0, cut + 1)
    cut = dot + 1 if dot >= 0 and cut < len(hay) else cut
    text = _join(hay[:cut].strip(), hay[cut:].strip(), key, question)
    ids, offsets = _tokens(tok, text)
    if max_tokens is not None and len(ids) > max_tokens:
        raise ValueError(f"passage: the prompt is {len(ids)} tokens; at most {max_tokens} here "
                         "(shorten the passage, or use `kvviz needle --haystack`)")
    return NeedlePrompt(text, key, ids, offsets, key_positions(text, offsets, key),
                        question_start(text, offsets, question), len(ids), depth)


def question_start(text: str, offsets, question: str = QUESTION) -> int:
    q = text.rindex(question)
    return next(i for i, (a, b) in enumerate(offsets) if b > q)
