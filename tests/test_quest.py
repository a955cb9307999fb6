"""Quest's page selection against a slow reference written from the paper's rule, a case
worked by hand, and its reads on the shipped trace with key and query vectors."""
from pathlib import Path

import numpy as np
import pytest

from kvviz.core.quest import (
    contrast,
    eviction_memory,
    page_bounds,
    page_scores,
    query_heads,
    quest_at,
    quest_heads,
    quest_memory,
    quest_read,
    quest_reads,
)
from kvviz.core.trace import load_trace, save_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"


def ref_quest_read(keys, query, page_size, token_budget):
    """Quest, section 3, one element at a time: pages of `page_size` consecutive positions;
    per page and channel i the key's min m_i and max M_i; the page's bound is the sum over
    channels of max(q_i m_i, q_i M_i); with more pages than token_budget // page_size, read
    the newest page and then, one at a time, the unread page with the highest bound (the
    lowest page first among equals) until that many pages are read."""
    n, d = len(keys), len(query)
    pages = [list(range(s, min(s + page_size, n))) for s in range(0, n, page_size)]
    bounds = []
    for page in pages:
        total = 0.0
        for i in range(d):
            m = min(float(keys[p][i]) for p in page)
            big = max(float(keys[p][i]) for p in page)
            total += max(float(query[i]) * m, float(query[i]) * big)
        bounds.append(total)
    allowed = token_budget // page_size
    if len(pages) <= allowed:
        chosen = list(range(len(pages)))
    else:
        chosen = [len(pages) - 1]
        while len(chosen) < allowed:
            best = None
            for j in range(len(pages) - 1):
                if j not in chosen and (best is None or bounds[j] > bounds[best]):
                    best = j
            chosen.append(best)
    return sorted(p for j in chosen for p in pages[j])


# ---- a case worked by hand ---------------------------------------------------------------
# page size 2 over 7 positions: pages {0,1} {2,3} {4,5} {6}
KEYS = np.array([[1, 0], [0, 1],        # page 0: m = (0, 0),  M = (1, 1)
                 [-1, 2], [3, -2],      # page 1: m = (-1, -2), M = (3, 2)
                 [0, 0], [0.5, 0.5],    # page 2: m = (0, 0),  M = (0.5, 0.5)
                 [-3, -3]])             # page 3 (the newest, partial): m = M = (-3, -3)
QUERY = np.array([1.0, -1.0])
# bounds for q = (1, -1): page 0: max(0, 1) + max(0, -1) = 1; page 1: max(-1, 3) + max(2, -2)
# = 5 (key 3 reaches it: 3 + 2); page 2: max(0, 0.5) + max(0, -0.5) = 0.5; page 3: -3 + 3 = 0


def test_hand_worked_bounds_and_reads():
    lo, hi = page_bounds(KEYS, 2)
    assert lo.tolist() == [[0, 0], [-1, -2], [0, 0], [-3, -3]]
    assert hi.tolist() == [[1, 1], [3, 2], [0.5, 0.5], [-3, -3]]
    assert page_scores(KEYS, QUERY, 2).tolist() == [1.0, 5.0, 0.5, 0.0]
    # budget 2: one page, the newest; 4: + page 1 (bound 5); 6: + page 0 (bound 1) before
    # page 2 (0.5); 8: four pages, all of them; an odd budget rounds down to whole pages
    assert quest_read(KEYS, QUERY, page_size=2, token_budget=2).tolist() == [6]
    assert quest_read(KEYS, QUERY, page_size=2, token_budget=4).tolist() == [2, 3, 6]
    assert quest_read(KEYS, QUERY, page_size=2, token_budget=5).tolist() == [2, 3, 6]
    assert quest_read(KEYS, QUERY, page_size=2, token_budget=6).tolist() == [0, 1, 2, 3, 6]
    assert quest_read(KEYS, QUERY, page_size=2, token_budget=8).tolist() == list(range(7))
    # the newest page is read though its bound (0) is the lowest
    # a zero query bounds every page by 0: the tie goes to the lower pages
    assert quest_read(KEYS, [0, 0], page_size=2, token_budget=6).tolist() == [0, 1, 2, 3, 6]
    # q = (-1, 0): bounds 0, 1, 0, 3 -> with two pages, the newest and page 1
    assert quest_read(KEYS, [-1, 0], page_size=2, token_budget=4).tolist() == [2, 3, 6]


def test_hand_worked_memory():
    # 368 positions, 3 KV heads of 64 channels, float16: 768 bytes a position; 23 pages of
    # 16, each a min and a max key per KV head: 23 x 3 x 64 x 2 x 2 = 17,664 bytes
    q = quest_memory(368, kv_heads=3, head_dim=64, itemsize=2, page_size=16)
    assert (q.positions, q.kv_bytes, q.metadata_bytes, q.policy_bytes) == (368, 282_624, 17_664, 0)
    assert q.total == 300_288
    e = eviction_memory(64, kv_heads=3, head_dim=64, itemsize=2, bytes_per_slot=9)
    assert (e.kv_bytes, e.metadata_bytes, e.policy_bytes, e.total) == (49_152, 0, 576, 49_728)
    assert quest_memory(17, kv_heads=1, head_dim=4, itemsize=4, page_size=16).metadata_bytes == 64


def test_contrast_splits_positions():
    c = contrast([0, 1, 2, 3, 6], [0, 3, 4, 5])
    assert c["both"].tolist() == [0, 3]
    assert c["evicted_read"].tolist() == [1, 2, 6]
    assert c["held_skipped"].tolist() == [4, 5]


# ---- the reference -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
def test_matches_the_slow_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 90))
    d = int(rng.integers(1, 6))
    page_size = int(rng.choice([1, 2, 3, 4, 16]))
    budget = int(rng.integers(page_size, 70))
    # small integers: equal bounds are common, so the tie order is exercised
    keys = rng.integers(-2, 3, size=(n, d)).astype(np.float64)
    query = rng.integers(-2, 3, size=d).astype(np.float64)
    if seed % 2:
        keys, query = rng.normal(size=(n, d)), rng.normal(size=d)
    got = quest_read(keys, query, page_size=page_size, token_budget=budget)
    assert got.dtype == np.int64
    assert got.tolist() == ref_quest_read(keys, query, page_size, budget)
    # the bound holds: no key of a page scores above its page's bound
    scores = page_scores(keys, query, page_size)
    for p in range(n):
        assert float(keys[p] @ query) <= scores[p // page_size] + 1e-9


def test_heads_read_their_kv_head_and_union():
    rng = np.random.default_rng(7)
    keys = rng.normal(size=(2, 50, 4))
    queries = rng.normal(size=(6, 4))  # query heads 0-2 read KV head 0, 3-5 KV head 1
    want = sorted(set().union(*(ref_quest_read(keys[h // 3], queries[h], 4, 12) for h in range(6))))
    assert quest_heads(keys, queries, page_size=4, token_budget=12).tolist() == want
    assert query_heads("mean", 9, 3) == list(range(9))
    assert query_heads("kv1", 9, 3) == [3, 4, 5] and query_heads("q7", 9, 3) == [7]


@pytest.mark.parametrize("call, match", [
    (lambda: quest_read(KEYS, QUERY, page_size=0, token_budget=4), "page_size must be a positive"),
    (lambda: quest_read(KEYS, QUERY, page_size=2.5, token_budget=4), "page_size"),
    (lambda: quest_read(KEYS, QUERY, page_size=4, token_budget=3), "token_budget must be .* at least page_size"),
    (lambda: quest_read(KEYS, [1.0], page_size=2, token_budget=4), "query must be one vector of head_dim 2"),
    (lambda: quest_read(KEYS[0], QUERY, page_size=2, token_budget=4), "keys must be 2-D"),
    (lambda: quest_read(KEYS * np.nan, QUERY, page_size=2, token_budget=4), "keys must be finite"),
    (lambda: quest_heads(np.zeros((2, 5, 2)), np.zeros((3, 2)), page_size=2, token_budget=4),
     "whole multiple"),
    (lambda: query_heads("kv3", 9, 3), "head must be"),
])
def test_bad_input_is_refused_with_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- on a trace --------------------------------------------------------------------------
def test_reads_on_the_shipped_trace_match_the_reference_per_query_head():
    t = load_trace(TRACES / "code-vec.npz", layer=14)
    step = 200
    k = t.keys[1].astype(np.float64)        # layer 14 is the second stored layer
    q = t.queries[1, :, step].astype(np.float64)
    per_kv = {g: set() for g in range(3)}
    for h in range(9):
        per_kv[h // 3] |= set(ref_quest_read(k[h // 3, :step], q[h], 16, 64))
    reads = quest_reads(t, step, token_budget=64)
    assert {g: r.tolist() for g, r in reads.items()} == {g: sorted(s) for g, s in per_kv.items()}
    union = quest_at(t, step, token_budget=64)
    assert union.tolist() == sorted(set().union(*per_kv.values()))
    # every query head reads exactly 4 pages of 16 positions (the newest, 192-199, partial)
    assert all(len(r) <= 3 * 64 for r in reads.values()) and 192 in union and 199 in union
    assert quest_at(t, step, token_budget=64, layer=29).tolist() != union.tolist()
    assert quest_at(t, step, token_budget=64, head="q4").tolist() == \
        ref_quest_read(k[1, :step], q[4], 16, 64)
    assert quest_at(t, 0, token_budget=64).tolist() == []
    assert quest_at(t, 20, token_budget=64).tolist() == list(range(20))  # 2 pages <= 4


def test_a_trace_without_vectors_is_refused(tmp_path):
    m = np.tril(np.full((6, 6), 0.2, np.float32), k=-1)
    t = load_trace(save_trace(tmp_path / "plain.npz", m))
    with pytest.raises(ValueError, match="has none: capture one with `kvviz capture --vectors`"):
        quest_at(t, 3, token_budget=16)
