"""Span integrity on tiny hand-built cases; every expected value is worked out in the comments."""
import math

import numpy as np
import pytest

from kvviz.core.spans import attention_spans, important_spans, received, span_integrity, word_spans
from kvviz.core.trace import Trace


class HandTrace(Trace):
    """Row t puts all its weight on position focus[t] (row 0 is empty)."""

    def __init__(self, focus, tokens=None):
        self.focus = focus
        self.steps = len(focus)
        self.tokens = tokens
        self.name = "hand"
        self.meta = {}

    def row(self, i):
        r = np.zeros(i, np.float32)
        if i:
            r[self.focus[i]] = 1.0
        return r


class FixedRun:
    """A Run stand-in whose cache after every step is the same set."""

    def __init__(self, held):
        self.held = np.asarray(held, np.int64)

    def held_at(self, step):
        return self.held[self.held <= step]


# focus: rows 1..7 attend to 0, 1, 1, 3, 3, 3, 6 -> totals: pos0 1, pos1 2, pos3 3, pos6 1, rest 0
FOCUS = [None, 0, 1, 1, 3, 3, 3, 6]
SPANS = [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_received_sums_columns():
    assert received(HandTrace(FOCUS)).tolist() == [1, 2, 0, 3, 0, 0, 1, 0]


def test_word_spans_glue_rule():
    tokens = ["The", " Un", "bound", "Local", "Error", " is", "(", "x", ")",
              "__", "main", "__", "."]
    # " Un" starts a word (space); "bound", "Local", "Error" glue on (letters both sides).
    # "(" ")" "." are punctuation; "x" follows "(" so it starts a word; "__main__" glues
    # because "_" counts as a word character. Single-token words are not returned.
    assert word_spans(tokens) == [(1, 5), (9, 12)]


def test_word_spans_character_split_over_tokens():
    # "" is the first bytes of a character finished by the next token: "数" "" "学" is one
    # word; " a" "" "b" too (the empty token is judged by "b", a letter after "a").
    assert word_spans(["数", "", "学", " a", "", "b"]) == [(0, 3), (3, 6)]
    # after a space the empty token starts a word, and the token completing it joins it
    assert word_spans([" ", "", "学"]) == [(1, 3)]


def test_attention_spans_local_median():
    # p=2: window p-2..p+2 = [1,1,5,6,1], median 1, 5 > 1 -> above.
    # p=3: window 0..6 = [1,1,5,6,1,1,1], median 1, 6 > 1 -> above.
    # p=1, 4, 5: median 1 and total 1 -> not above; p=0 and p=6 have an empty window.
    assert attention_spans(None, totals=[1, 1, 5, 6, 1, 1, 1]) == [(2, 4)]


def test_attention_spans_ignore_a_smooth_trend():
    # On a monotone slope each position is its symmetric window's median: never above.
    assert attention_spans(None, totals=[9, 8, 7, 6, 5, 4, 3, 2, 1]) == []
    # A lone spike is above, but a run must have 2 positions.
    assert attention_spans(None, totals=[9, 8, 7, 50, 5, 4, 3, 2, 1]) == []


def test_important_spans_by_top_positions():
    totals = received(HandTrace(FOCUS))
    # ranking: pos3 (3), pos1 (2), then pos0 and pos6 tie at 1 -> lower position first
    assert important_spans(SPANS, totals, top=1) == [(2, 4)]
    assert important_spans(SPANS, totals, top=2) == [(0, 2), (2, 4)]
    assert important_spans(SPANS, totals, top=3) == [(0, 2), (2, 4)]   # pos0 already in (0,2)
    assert important_spans(SPANS, totals, top=4) == [(0, 2), (2, 4), (6, 8)]


def test_span_integrity_whole_fragmented_dropped():
    trace = HandTrace(FOCUS)
    run = FixedRun([1, 2, 3])
    # top 4 -> spans (0,2) (2,4) (6,8). Held {1,2,3}: (0,2) holds 1 of 2 -> fragmented,
    # (2,4) holds both -> whole, (6,8) holds none -> dropped. Shares 0.5, 1, 0 -> mean 0.5.
    out = span_integrity(trace, run, spans=SPANS, top=4)
    assert (out["whole"], out["fragmented"], out["dropped"]) == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert out["n_spans"] == 3 and out["held_share"] == pytest.approx(0.5)
    # top 2 -> (0,2) fragmented, (2,4) whole
    out = span_integrity(trace, run, spans=SPANS, top=2)
    assert (out["whole"], out["fragmented"], out["dropped"]) == (0.5, 0.5, 0.0)
    assert out["held_share"] == pytest.approx(0.75)


def test_span_integrity_only_judges_spans_that_exist_by_step():
    # at step 6, span (6,8) ends after the step, so only (0,2) and (2,4) are judged
    out = span_integrity(HandTrace(FOCUS), FixedRun([1, 2, 3]), spans=SPANS, top=4, step=6)
    assert out["n_spans"] == 2 and out["whole"] == 0.5 and out["dropped"] == 0.0


def test_span_integrity_default_span_kind_and_nan_when_no_spans():
    run = FixedRun(range(8))
    # no tokens -> attention spans; totals [1,2,0,3,0,0,1,0]: p=1 window [1,2,0] median 1 ->
    # above; p=2 window 0..4 [1,2,0,3,0] median 1 -> not; p=3 window 0..6 median 1 -> above;
    # no two adjacent positions above, so there is no span and the fractions are NaN.
    out = span_integrity(HandTrace(FOCUS), run)
    assert out["kind"] == "attention" and out["n_spans"] == 0 and math.isnan(out["whole"])
    tokens = ["A", "b", " c", "d", " e", "f", " g", "h"]   # words (0,2) (2,4) (4,6) (6,8)
    out = span_integrity(HandTrace(FOCUS, tokens), run, top=1)
    assert out["kind"] == "words" and out["n_spans"] == 1 and out["whole"] == 1.0
    with pytest.raises(ValueError, match="tokens"):
        span_integrity(HandTrace(FOCUS), run, spans="words")
