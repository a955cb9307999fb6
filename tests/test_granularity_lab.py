"""lab.granularity's counting, on hand-built runs and attention: mentions, whole-mention
holding per stream, the group means the KV heads are scored on."""
from __future__ import annotations

import numpy as np
import pytest

from lab import granularity as G


def run(evicted_at, key_positions=(3, 4, 5, 9, 10, 11), prompt_len=12):
    meta = {"key_positions": list(key_positions), "prompt_len": prompt_len, "key": "123",
            "configs": [{"label": "full"}, {"label": "tova@4"}], "correct": [True, False],
            "answers": ["123", "12x"]}
    return {"meta": meta, "evicted_at": np.asarray(evicted_at)}


def test_mentions_are_runs_of_positions():
    assert G.mentions({"key_positions": [11, 3, 4, 5, 9, 10]}) == [[3, 4, 5], [9, 10, 11]]


def test_held_whole_needs_every_digit_of_one_mention():
    e = -np.ones((2, 2, 2, 14), int)  # configs, layers, KV heads, positions
    e[1, 0, 0, [3, 9]] = 11            # layer 0 head 0 loses a digit of each mention: not whole
    e[1, 0, 1, [3, 4, 5]] = 11         # head 1 loses the first mention, keeps the second
    e[1, 1, 0, [3]] = 12               # evicted after the prompt (step 12 > 11): held at its end
    e[1, 1, 1, [9, 10, 11]] = 5
    h = G.held_whole(run(e), "tova@4")
    assert h.tolist() == [[False, True], [True, True]]
    assert G.held_digits(run(e), "tova@4") == pytest.approx(16 / 24)
    assert G.shape_of(run(e), "tova@4") == "dd…" and not G.right(run(e), "tova@4")


def test_group_key_attention_averages_each_kv_heads_query_heads():
    a = np.zeros((1, 4, 3, 3))  # one layer, four query heads -> two KV heads, 3 x 3 rows
    a[0, 0, 2, 0], a[0, 1, 2, 0] = 0.5, 0.1   # KV head 0's query heads, row 2 -> key 0
    a[0, 2, 2, [0, 1]] = 0.2                   # KV head 1: two key positions summed
    out = G.group_key_attention(a, [0, 1], [2], 2)
    assert np.allclose(out, [[0.3, 0.2]])
