"""A task's prompt built to an exact token length: the instruction, the haystack cut at a
token count with sentences inserted at depths (and, for the recall task, a reminder after
every k-th haystack sentence that follows the last insert), the question.

The pass key's own builder (kvviz.model.needle.prompt.build) is the one-insert case: the
same cut, the same split rule and the same length correction, so a task prompt with one
insert and no reminders is the pass-key prompt token for token.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvviz.model.needle.prompt import INTRO, _tokens, repeat_haystack, split_at


@dataclass(frozen=True)
class Insert:
    depth: float  # percent of the haystack's tokens
    text: str


@dataclass
class Composed:
    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    inserts: list[tuple[int, int]]    # character span of each insert, in the inserts' order
    reminders: list[tuple[int, int]]  # character span of each reminder, in text order

    def tokens_of(self, span: tuple[int, int]) -> list[int]:
        """Token indices whose characters overlap the character span."""
        s, e = span
        return [i for i, (a, b) in enumerate(self.offsets) if b > a and a < e and b > s]


def with_reminders(tail: str, reminder: str, every: int | None, cap: int | None = None) -> list[tuple[str, bool]]:
    """The haystack after the last insert as (piece, is_reminder) pieces: a reminder after
    sentence every, 2*every, ... while at least `every` whole sentences follow it, so the
    question comes after a quiet stretch of `every` sentences or more; at most `cap` of them."""
    if not tail or not every:
        return [(tail, False)] if tail else []
    sentences = re.split(r"(?<=\.) ", tail)
    whole = sum(1 for s in sentences if s.endswith("."))
    out: list[tuple[str, bool]] = []
    run: list[str] = []
    for i, s in enumerate(sentences, 1):
        run.append(s)
        if i % every == 0 and i + every <= whole and (cap is None or len(out) < 2 * cap):
            out += [(" ".join(run), False), (reminder, True)]
            run = []
    if run:
        out.append((" ".join(run), False))
    return out


def join(hay: str, hay_offsets, n: int, inserts: list[Insert], question: str,
         reminder: str = "", every: int | None = None, cap: int | None = None, intro: str = INTRO):
    """The prompt text for n haystack tokens: (text, insert spans, reminder spans)."""
    end = hay_offsets[n - 1][1] if n > 0 else 0
    part = hay[:end]
    splits = [split_at(part, hay_offsets, n, d.depth) for d in inserts]
    pieces: list[tuple[str, str | int | None]] = [(intro, None)]
    prev = 0
    for i in sorted(range(len(inserts)), key=lambda j: (splits[j], j)):
        pieces += [(part[prev:splits[i]].strip(), None), (inserts[i].text, i)]
        prev = splits[i]
    pieces += [(p, "reminder" if r else None) for p, r in with_reminders(part[prev:].strip(), reminder, every, cap)]
    pieces.append((question, None))
    text, at = [], 0
    ins: dict[int, tuple[int, int]] = {}
    rem: list[tuple[int, int]] = []
    for piece, tag in pieces:
        if not piece:
            continue
        at += 1 if text else 0
        if tag == "reminder":
            rem.append((at, at + len(piece)))
        elif tag is not None:
            ins[tag] = (at, at + len(piece))
        text.append(piece)
        at += len(piece)
    return " ".join(text), [ins[i] for i in range(len(inserts))], rem


def compose(tok, length: int, hay: str, inserts: list[Insert], question: str, reminder: str = "",
            every: int | None = None, what: str = "the task", intro: str = INTRO) -> Composed:
    """The prompt of exactly `length` tokens (the nearest below when the tokenizer cannot hit
    it), or ValueError naming --lengths when the inserts and question do not fit."""
    need = len(_tokens(tok, join("", [], 0, inserts, question, intro=intro)[0])[0])
    if length < need + 1:
        raise ValueError(f"--lengths {length}: {what} does not fit; the instruction, its sentences and the "
                         f"question take {need} tokens, so a length must be at least {need + 1}")
    hay, hay_ids, hay_off = repeat_haystack(tok, hay, length)
    top = len(hay_ids)
    exact, tried = _search(tok, length, lambda n: join(hay, hay_off, n, inserts, question, reminder, every,
                                                       intro=intro), top, length - need)
    if exact is None and every:
        # a reminder that comes in with one more sentence adds its tokens at once, so some
        # lengths have no n: fix the count of reminders at what the nearest shorter prompt
        # holds (its last stretch quiet), and fill the haystack around them
        below = max((m for m, t in tried.items() if len(t[1]) <= length), default=None)
        if below is not None:
            cap = len(tried[below][4])
            exact, more = _search(tok, length, lambda n: join(hay, hay_off, n, inserts, question, reminder, every,
                                                              cap, intro), top, below)
            tried = {**tried, **{("cap", m): t for m, t in more.items()}}
            exact = None if exact is None else ("cap", exact)
    if exact is None:
        fits = [m for m, t in tried.items() if len(t[1]) <= length]
        if not fits:
            raise ValueError(f"--lengths {length}: cannot build a prompt this short around {what}")
        exact = max(fits, key=lambda m: len(tried[m][1]))
    text, ids, offsets, ins, rem = tried[exact]
    return Composed(text, ids, offsets, ins, rem)


def _search(tok, length: int, make, top: int, start: int):
    """(n whose prompt has exactly `length` tokens or None, every prompt tried by n): the
    pass key's correction of n first, then a bisection (the length grows with n) and the
    values around it."""
    tried: dict[int, tuple] = {}

    def attempt(n):
        if n not in tried:
            text, ins, rem = make(n)
            ids, offsets = _tokens(tok, text)
            tried[n] = (text, ids, offsets, ins, rem)
        return tried[n]

    n = max(0, min(top, start))
    for _ in range(12):  # the joins merge or split a few tokens: correct n until it fits
        if len(attempt(n)[1]) == length:
            return n, tried
        n = max(0, min(top, n + length - len(attempt(n)[1])))
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(attempt(mid)[1]) <= length else (lo, mid - 1)
    for m in sorted(range(max(0, lo - 48), min(top, lo + 48) + 1), key=lambda m: (abs(m - lo), m)):
        if len(attempt(m)[1]) == length:
            return m, tried
    return None, tried


def place(tok, length: int, hay: str, pieces: list[tuple[int, str]], question: str, what: str = "the task",
          intro: str = INTRO, tries: int = 12, snap: int = 8) -> Composed:
    """The prompt of exactly `length` tokens with each piece's first token at its given
    prompt token index (pieces in increasing order), the haystack flowing in order between
    them: the instruction, haystack, piece, haystack, ..., the question. A piece goes in at
    the haystack's sentence end nearest its place when one lies within `snap` tokens (it then
    sits up to `snap` tokens off), else at the word end at its place.
    Each cut is corrected by the error the tokenizer left until every piece sits where asked
    (or `tries` runs out: the nearest found; the spans are recorded either way). `inserts`:
    each piece's character span, in the pieces' order. ValueError naming --lengths when
    the pieces and question do not fit, or a piece lies past the question."""
    at = [int(p) for p, _ in pieces]
    if at != sorted(at):
        raise ValueError("the pieces must come in increasing positions")
    need = len(_tokens(tok, " ".join([intro, *[t for _, t in pieces], question]))[0])
    if length < need + 1:
        raise ValueError(f"--lengths {length}: {what} does not fit; the instruction, its sentences and the "
                         f"question take {need} tokens, so a length must be at least {need + 1}")
    hay, hay_ids, hay_off = repeat_haystack(tok, hay, length)
    words = [m for m in range(1, len(hay_ids) + 1) if m == len(hay_ids) or hay[hay_off[m - 1][1]:][:1].isspace()]
    ends = [m for m in words if hay[:hay_off[m - 1][1]].endswith(".")]

    def word_cut(m: int) -> int:  # the sentence end nearest m within `snap` tokens, else the word end at or below
        m = max(0, min(len(hay_ids), m))
        near = [e for e in ends if abs(e - m) <= snap]
        if near:
            return min(near, key=lambda e: (abs(e - m), e))
        i = np.searchsorted(words, m, side="right")
        return int(words[i - 1]) if i > 0 else 0

    def make(cuts):
        chars = [0] + [hay_off[m - 1][1] if m > 0 else 0 for m in cuts]
        parts, spans, pos = [intro], [], len(intro)
        for i, (_, text) in enumerate(pieces):
            for chunk in (hay[chars[i]:chars[i + 1]].strip(), text):
                if chunk:
                    parts.append(chunk)
                    if chunk is text:
                        spans.append((pos + 1, pos + 1 + len(text)))
                    pos += 1 + len(chunk)
        tail = hay[chars[-2]:chars[-1]].strip()
        text = " ".join(parts + ([tail] if tail else []) + [question])
        ids, offsets = _tokens(tok, text)
        return text, ids, offsets, spans

    intro_n = len(_tokens(tok, intro)[0])
    cuts, before = [], 0
    for p, text in pieces:
        cuts.append(max(cuts[-1] if cuts else 0, p - intro_n - before))
        before += len(_tokens(tok, text)[0])
    cuts.append(max(cuts[-1] if cuts else 0, length - need))
    best = None
    for _ in range(tries):
        cuts = [word_cut(m) for m in cuts[:-1]] + [max(0, min(len(hay_ids), cuts[-1]))]
        for i in range(1, len(cuts)):
            cuts[i] = max(cuts[i], cuts[i - 1])
        text, ids, offsets, spans = make(cuts)
        got = [next(i for i, (a, b) in enumerate(offsets) if b > s) for s, _ in spans]
        miss = [g - p for g, p in zip(got, at)]
        score = (len(ids) > length, sum(abs(x) for x in miss) + abs(len(ids) - length))
        if best is None or score < best[0]:
            best = (score, (text, ids, offsets, spans))
        if score == (False, 0):
            break
        cuts = [c - e for c, e in zip(cuts[:-1], miss)] + [cuts[-1] + length - len(ids)]
    (over, _), (text, ids, offsets, spans) = best
    if over:
        raise ValueError(f"--lengths {length}: cannot build a prompt this short around {what}")
    if spans and max(s for s, _ in spans) > text.rindex(question):
        raise ValueError(f"--lengths {length}: {what} lies past the question")
    return Composed(text, ids, offsets, spans, [])
