"""Span integrity: does a policy keep a phrase whole, or only its peak?

The SnapKV card claims max-pooling lets a high scorer defend its neighbours, so a phrase
survives whole where TOVA keeps only the token the attention peaked on. This module measures
that on any trace and Run. A span is a half-open (start, end) range of positions. Only spans
of 2 or more positions are counted: a single position is either held or not, which hit-rate
metrics already measure, and cannot be "fragmented".

Two span sources:
  word_spans(tokens)     whole words from the tokenizer's token strings
  attention_spans(trace) runs of positions that receive more attention than their neighbourhood
A span is *important* if it contains one of the `top` positions by total attention received
over the whole trace (the same ranking heavy-hitter recall uses). No torch needed.
"""
from __future__ import annotations

import numpy as np

DEFAULT_TOP = 64
DEFAULT_HALF_WINDOW = 32


def received(trace) -> np.ndarray:
    """Total attention each position receives, summed over every row of the trace."""
    total = np.zeros(trace.steps, np.float64)
    for t in range(1, trace.steps):
        total[:t] += trace.row(t)
    return total


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def word_spans(tokens) -> list[tuple[int, int]]:
    """Multi-token words: maximal runs of tokens glued together without a boundary.

    Rule: token i continues the word of token i-1 unless (a) it starts with whitespace or
    punctuation (any character that is not a letter, digit or "_"), or (b) the previous
    token ends with one. So " Unbound" "Local" "Error" is one word, "(" "x" ")" are three,
    and "__main__" stays one. An empty token (the first bytes of a character split over
    tokens) is judged by the next non-empty token. Returns only words of >= 2 tokens.
    """
    texts = [str(t) for t in tokens]
    n = len(texts)
    effective = list(texts)
    following = ""
    for i in range(n - 1, -1, -1):  # empty tokens take the next non-empty token's text
        if effective[i]:
            following = effective[i]
        else:
            effective[i] = following
    glued, prev = [], ""
    for i, text in enumerate(effective):
        if i > 0 and texts[i - 1] == "":  # completes the character the empty token began
            glued.append(True)
        else:
            glued.append(i > 0 and bool(text) and bool(prev)
                         and _is_word_char(text[0]) and _is_word_char(prev[-1]))
        if texts[i]:
            prev = texts[i]
    return _runs(glued, glue=True)


def _runs(flags, glue=False) -> list[tuple[int, int]]:
    """Spans of length >= 2. glue=True: flags[i] means "i joins i-1"; else "i is in a run"."""
    spans, start = [], None
    n = len(flags)
    for i in range(n + 1):
        if glue:
            if i == n or not flags[i]:
                if start is not None and i - start >= 2:
                    spans.append((start, i))
                start = i
        else:
            inside = i < n and flags[i]
            if inside and start is None:
                start = i
            elif not inside and start is not None:
                if i - start >= 2:
                    spans.append((start, i))
                start = None
    return spans


def attention_spans(trace, half_window: int = DEFAULT_HALF_WINDOW,
                    totals: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Runs (>= 2 adjacent positions) whose total attention received is above their local median.

    Position p is "above" if its total exceeds the median of the totals over the symmetric
    window p-h..p+h, with h = min(half_window, p, T-1-p). Why local, not one global median:
    the total grows with age (every later row can attend to an earlier position), so on the
    canonical trace a global median simply calls the older half one long span. A symmetric
    window cancels any smooth trend: a position on a monotone slope equals its window's median
    and is never "above"; only positions that stick out from their neighbourhood are.
    """
    totals = received(trace) if totals is None else np.asarray(totals, np.float64)
    n = len(totals)
    above = np.zeros(n, bool)
    for p in range(n):
        h = min(half_window, p, n - 1 - p)
        if h > 0:
            above[p] = totals[p] > np.median(totals[p - h:p + h + 1])
    return _runs(above)


def important_spans(spans, totals: np.ndarray, top: int = DEFAULT_TOP) -> list[tuple[int, int]]:
    """The spans that contain at least one of the `top` positions by total attention received.

    Ties in the ranking go to the lower position (stable sort), matching the policies' rule.
    """
    order = np.argsort(-np.asarray(totals), kind="stable")[:top]
    heavy = np.zeros(len(totals), bool)
    heavy[order] = True
    return [(a, b) for a, b in spans if heavy[a:b].any()]


def judge(held: np.ndarray, start: int, end: int) -> str:
    """One span against a held mask: 'whole', 'fragmented' or 'dropped'."""
    k = int(held[start:end].sum())
    return "whole" if k == end - start else "dropped" if k == 0 else "fragmented"


def span_integrity(trace, run, spans=None, top: int = DEFAULT_TOP, step: int | None = None,
                   totals: np.ndarray | None = None) -> dict:
    """Fractions of important spans held whole / fragmented / dropped after `step`.

    `step` defaults to the final step: what the cache holds when the trace ends. `spans`
    may be a list of (start, end), "words", "attention", or None (words when the trace has
    tokens, else attention spans). Only spans wholly inside 0..step are judged. Fractions
    are NaN when there is no important span (e.g. a workload with no multi-token phrases).
    Returns whole, fragmented, dropped (fractions summing to 1), n_spans (important spans
    judged), held_share (mean share of each span's positions held) and kind. Pass `totals`
    (from received(trace)) to avoid recomputing it when judging many runs or steps.
    """
    step = trace.steps - 1 if step is None else int(step)
    totals = received(trace) if totals is None else np.asarray(totals, np.float64)
    kind = "custom"
    if spans is None:
        spans = "words" if trace.tokens is not None else "attention"
    if isinstance(spans, str):
        kind = spans
        if spans == "words":
            if trace.tokens is None:
                raise ValueError("word spans need a trace with tokens; use spans='attention'")
            spans = word_spans(trace.tokens)
        elif spans == "attention":
            spans = attention_spans(trace, totals=totals)
        else:
            raise ValueError(f"spans must be 'words', 'attention' or a list, got {spans!r}")
    chosen = [(a, b) for a, b in important_spans(spans, totals, top) if b - 1 <= step]
    held = np.zeros(trace.steps, bool)
    held[np.asarray(run.held_at(step), np.int64)] = True
    counts = {"whole": 0, "fragmented": 0, "dropped": 0}
    shares = []
    for a, b in chosen:
        counts[judge(held, a, b)] += 1
        shares.append(int(held[a:b].sum()) / (b - a))
    n = len(chosen)
    out = {key: (value / n if n else float("nan")) for key, value in counts.items()}
    out.update(n_spans=n, held_share=float(np.mean(shares)) if n else float("nan"), kind=kind)
    return out
