"""The kvpress cross-check's comparison logic (lab/kvpress_xcompare.py) on synthetic kept sets,
scores and weights, with neither kvpress nor a model; and the study page against its result file."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvviz.core.policies.alloc import alpha_floor
from lab import kvpress_xcompare as x


# -- agreement ------------------------------------------------------------------------------
def test_agreement_counts_cells_and_jaccard_by_hand():
    a = {"0,0": [0, 1, 2, 3], "0,1": [0, 1], (1, 0): [5, 6, 7]}
    b = {(0, 0): [0, 1, 2, 9], "0,1": [1, 0], "1,0": [5, 6, 7, 8]}
    got = x.agreement(a, b)
    # (0,0): {0,1,2} shared of {0,1,2,3,9}: 3/5; (0,1) equal; (1,0): 3/4
    assert got["cells"] == 3 and got["same_cells"] == 1 and got["same_counts"] == 2
    assert got["jaccard_mean"] == pytest.approx((3 / 5 + 1 + 3 / 4) / 3)
    assert got["jaccard_min"] == pytest.approx(3 / 5) and got["least_cell"] == "0,0"
    assert (got["kept_a"], got["kept_b"]) == (9, 10)
    assert (got["only_first"], got["only_second"]) == (1, 2)


def test_agreement_refuses_maps_over_different_cells():
    with pytest.raises(ValueError, match="different"):
        x.agreement({"0,0": [1]}, {"0,1": [1]})


def test_jaccard_of_two_empty_sets_is_agreement():
    assert x.jaccard(frozenset(), frozenset()) == 1.0
    assert x.jaccard(frozenset({1}), frozenset()) == 0.0


# -- allocation rules -----------------------------------------------------------------------
def test_kvpress_adakv_by_hand():
    # 2 heads x 6 positions, keep 3 per head on average (6 of 12), alpha 0.5 -> n_safe 1
    s = np.array([[0.9, 0.1, 0.2, 0.3, 0.4, 0.5],
                  [0.05, 0.06, 0.07, 0.08, 0.09, 0.01]])
    keep = x.kvpress_adakv_keep(s, 3, 0.5)
    # head 1's best (0.09 at 4) is forced in; the 6 lowest of the rest go:
    # 0.01, 0.05, 0.06, 0.07, 0.08 (head 1) and 0.1 (head 0, position 1)
    assert keep.tolist() == [[True, False, True, True, True, True],
                             [False, False, False, False, True, False]]


def test_kvpress_adakv_without_safeguard_is_a_flat_bottom_k():
    s = np.array([[0.9, 0.1, 0.2], [0.05, 0.06, 0.07]])
    assert x.kvpress_adakv_keep(s, 1, 0.0).tolist() == [[True, False, True], [False, False, False]]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(0, 10_000), st.sampled_from([0.0, 0.2, 0.5, 0.75]),
       st.integers(1, 4), st.integers(0, 8))
def test_kvvizs_shared_victims_is_kvpress_adakv_when_the_window_is_padded(G, seed, alpha, window, extra):
    """kvpress's safeguard (a head's top n_safe forced in) and kvviz's count floor are one rule:
    distinct scores, the window scored max + 1 on kvpress's side and protected on kvviz's."""
    T = window + extra + 6
    budget = window + 1 + extra // 2
    rng = np.random.default_rng(seed)
    s = rng.permutation(G * T).reshape(G, T).astype(np.float64) / (G * T)
    padded = s.copy()
    padded[:, T - window:] = s.max() + 1
    n_safe = max(1, int(budget * alpha)) if alpha else 0
    if n_safe != alpha_floor(alpha, budget):  # kvpress's max(1, ...) has no kvviz counterpart
        return
    assert (x.kvpress_adakv_keep(padded, budget, alpha)
            == x.kvviz_adakv_keep(s, budget, alpha, window)).all()


def test_topk_keep_and_kvviz_single_keep_agree_off_the_window():
    s = np.array([[5.0, 1.0, 4.0, 2.0, 3.0, 0.0, 0.0]])
    padded = s.copy()
    padded[:, -2:] = 99.0
    assert x.topk_keep(padded, 4).tolist() == [[True, False, True, False, False, True, True]]
    assert (x.kvviz_single_keep(s, 4, 2) == x.topk_keep(padded, 4)).all()


# -- SnapKV rules -------------------------------------------------------------------------
def test_kvpress_pool_pads_with_zeros_and_divides_by_the_kernel():
    got = x.kvpress_pool(np.array([[1.0, 2.0, 3.0, 4.0, 5.0]]), 3)
    assert got.tolist() == [[1.0, 2.0, 3.0, 4.0, 3.0]]  # (0+1+2)/3 ... (4+5+0)/3


def _weights(rng, H, W, T, self_mass):
    """Causal softmax-like rows: query T - W + i spreads 1 - self_mass over 0..t-1."""
    a = np.zeros((H, W, T))
    for i in range(W):
        t = T - W + i
        r = rng.random((H, t))
        a[:, i, :t] = (1 - self_mass) * r / r.sum(axis=1, keepdims=True)
        a[:, i, t] = self_mass
    return a


def test_snapkv_rows_agree_up_to_the_window_length_without_self_weight():
    """Mean over heads, mean over rows and pooling are linear: with no weight on the query's own
    key kvviz's renormalised rows are kvpress's raw ones, summed instead of averaged."""
    rng = np.random.default_rng(0)
    H, G, W, T = 6, 2, 4, 20
    a = _weights(rng, H, W, T, 0.0)
    # kvpress's order: each query head pooled, then the group averaged
    per_head = x.kvpress_pool(a.mean(axis=1)[:, : T - W], 3)
    theirs = per_head.reshape(G, H // G, -1).mean(axis=1)
    press = x.snapkv_scores(a, G, W, 3, rows="kvpress", pooling="kvpress")
    assert np.allclose(press[:, : T - W], theirs, rtol=1e-12)
    assert (press[:, T - W:] == theirs.max() + 1).all()
    mine = x.snapkv_scores(a, G, W, 3, rows="kvviz", pooling="kvpress")
    assert np.allclose(mine[:, : T - W], W * press[:, : T - W], rtol=1e-6)


def test_snapkv_rows_differ_when_queries_attend_to_themselves():
    rng = np.random.default_rng(1)
    a = _weights(rng, 2, 4, 20, 0.0)
    a[:, 0] *= 0.2  # the first window query keeps most weight on itself
    a[:, 0, 16] = 0.8
    press = x.snapkv_scores(a, 1, 4, 3, rows="kvpress", pooling="kvpress")[:, :16]
    mine = x.snapkv_scores(a, 1, 4, 3, rows="kvviz", pooling="kvpress")[:, :16]
    assert not np.allclose(mine, 4 * press, rtol=1e-3)


def test_kvviz_pooling_is_clamped_and_protects_the_window():
    a = _weights(np.random.default_rng(2), 1, 2, 8, 0.0)
    got = x.snapkv_scores(a, 1, 2, 3, rows="kvpress", pooling="kvviz")
    s = a[0].mean(axis=0)
    assert got[0, 0] == pytest.approx((s[0] + s[1]) / 2)  # position 0 has one neighbour
    assert got[0, 5] == pytest.approx((s[4] + s[5] + s[6]) / 3)  # a window position as neighbour
    assert np.isinf(got[0, 6:]).all()


def test_snapkv_scores_refuses_unknown_rules():
    a = np.zeros((1, 2, 6))
    with pytest.raises(ValueError, match="rows"):
        x.snapkv_scores(a, 1, 2, 3, rows="other")
    with pytest.raises(ValueError, match="pooling"):
        x.snapkv_scores(a, 1, 2, 3, pooling="other")


# -- Expected Attention -------------------------------------------------------------------
def test_expected_attention_by_a_slow_loop():
    """With R = I (cos 1, sin 0) and no covariance: softmax of mean-query . key / sqrt(d) over
    the keys after the sinks, averaged over the group, times the value's norm."""
    rng = np.random.default_rng(3)
    H, G, T, d, sink = 4, 2, 9, 4, 2
    q, k, v = rng.normal(size=(H, T, d)), rng.normal(size=(G, T, d)), rng.normal(size=(G, T, d))
    cos, sin = np.ones((3, d)), np.zeros((3, d))
    got = x.expected_attention_scores(q, k, v, cos, sin, n_sink=sink, use_covariance=False)
    want = np.zeros((G, T))
    for g in range(G):
        for h in range(g * 2, g * 2 + 2):
            mu = [sum(q[h, t, j] for t in range(sink, T)) / (T - sink) for j in range(d)]
            z = [sum(mu[j] * k[g, p, j] for j in range(d)) / math.sqrt(d) for p in range(sink, T)]
            e = [math.exp(v_) for v_ in z]
            for p in range(sink, T):
                want[g, p] += e[p - sink] / sum(e) / 2
        for p in range(sink, T):
            want[g, p] *= math.sqrt(sum(v[g, p, j] ** 2 for j in range(d)))
    assert np.allclose(got[:, sink:], want[:, sink:], rtol=1e-12)
    assert (got[:, :sink] == want[:, sink:].max() + 1).all()


def test_expected_attention_covariance_term_and_rotation():
    """One head, one key dimension pair: the covariance adds k' S k / (2d); a quarter turn of
    RoPE for every future position rotates the mean query by it."""
    q = np.array([[[0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [2.0, 0.0]]])  # sink 1, then mean (2, 0)
    k = np.array([[[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]])
    v = np.ones((1, 5, 2))
    ident = (np.ones((1, 2)), np.zeros((1, 2)))
    base = x.expected_attention_scores(q, k, v, *ident, n_sink=1, use_covariance=False, use_vnorm=False)
    cov = x.expected_attention_scores(q, k, v, *ident, n_sink=1, use_covariance=True, use_vnorm=False)
    # variance of the first coordinate (1, 3, 2, 2 around 2): 0.5; key (1, 0) gains 0.5 / 4
    lo = np.array([2 / math.sqrt(2), 0.0, 0.0, 0.0])
    e = np.exp(lo - lo.max())
    assert np.allclose(base[0, 1:], e / e.sum())
    lc = lo + np.array([0.5 / 4, 0, 0, 0])
    e = np.exp(lc - lc.max())
    assert np.allclose(cov[0, 1:], e / e.sum())
    turn = (np.zeros((1, 2)), np.ones((1, 2)))  # cos 0, sin 1: (a, b) -> (-b, a)
    rot = x.expected_attention_scores(q, k, v, *turn, n_sink=1, use_covariance=False, use_vnorm=False)
    lr = np.array([0.0, 2 / math.sqrt(2), 0.0, 0.0])  # the mean (2, 0) turned to (0, 2)
    e = np.exp(lr - lr.max())
    assert np.allclose(rot[0, 1:], e / e.sum())


# -- decode summary and the page ---------------------------------------------------------------
def test_decode_summary_reports_cuts_and_sinks():
    ev = [{"step": 9, "kept": {"0,0": [0, 1, 2, 3, 7], "0,1": [0, 1, 2, 3, 8]}},
          {"step": 13, "kept": {"0,0": [0, 1, 2, 5, 12], "0,1": [0, 1, 2, 3, 11]}}]
    got = x.decode_summary({"press": "P", "prompt": 6, "steps": 8, "interval": 4, "events": ev})
    assert got["compressions"] == 2
    assert "steps [9, 13]" in got["summary"] and "[5] positions" in got["summary"]
    assert got["summary"].endswith("every cut: no.")
    assert x.decode_summary(None) is None


def test_the_page_shows_the_result_files_figures():
    res = json.loads(x.RESULT.read_text(encoding="utf-8"))
    page = x.PAGE.read_text(encoding="utf-8")
    assert x.page_block(page) == x.render(res)
    assert res["date"] in page and res["command"] in page
    for block in res["comparisons"].values():
        for row in block["rows"]:
            assert row["what"] in page


def test_render_shows_every_row_and_the_date():
    agree = x.agreement({"0,0": [1, 2]}, {"0,0": [1, 3]})
    res = {"date": "2030-01-02", "command": "C", "kvpress_version": "0.5.5", "kvpress_transformers": "5.2.0",
           "kvviz_transformers": "5.24.0", "text": "t.txt", "T": 8, "ids_are_kvviz_tokens_after_bos": True,
           "budget": 4, "layers": 1, "kv_heads": 1, "window": 2, "kernel": 3, "alpha": 0.2,
           "comparisons": {"S": {"rows": [{"what": "a vs b", "agreement": agree}], "score_gaps": {"g": 1e-7}}},
           "decode": None}
    text = x.render(res)
    assert text.startswith(x.BEGIN) and text.endswith(x.END)
    assert "2030-01-02" in text and "| S: a vs b | 0 / 1 | 0.3333 | 0.3333 (0,0) | 1 / 1 |" in text
    assert "- S: g: 1.0e-07" in text


def _rope_tables(w, first, count):
    angles = np.arange(first, first + count, dtype=np.float64)[:, None] * w[None, :]
    return np.concatenate([np.cos(angles)] * 2, axis=1), np.concatenate([np.sin(angles)] * 2, axis=1)


@pytest.mark.parametrize("alpha", [None, 0.25])
def test_kvvizs_expected_attention_through_the_harness_is_kvpresss_rule(alpha):
    """The driver feeds kvviz's policy the queries after RoPE; with a query window covering the
    prompt it must keep what kvpress's rule, restated on the queries before RoPE, keeps."""
    from kvviz.core.policies.vectors import inverse_frequencies, rotate

    rng = np.random.default_rng(4)
    L, G, H, T, d, theta, n_future, budget = 2, 2, 4, 14, 4, 10000.0, 8, 7
    w = inverse_frequencies(d, theta)
    q_pre = [rng.normal(size=(H, T, d)) for _ in range(L)]
    q_post = [np.stack([rotate(q[:, t], t * w) for t in range(T)], axis=1) for q in q_pre]
    keys = [rng.normal(size=(G, T, d)).astype(np.float32) for _ in range(L)]
    values = [rng.normal(size=(G, T, d)).astype(np.float32) for _ in range(L)]
    x_ = {"keys": keys, "values": values, "q_post": q_post, "rope_theta": theta}
    params = {"n_future_positions": n_future, "n_sink": 2, "use_covariance": True, "use_vnorm": True,
              "epsilon": 0.0, "query_window": T}
    got = x.kvviz_expected_attention(x_, budget, params, alpha)
    cos, sin = _rope_tables(w, T, n_future)
    want = {}
    for i in range(L):
        s = x.expected_attention_scores(q_pre[i], keys[i], values[i], cos, sin, n_sink=2)
        keep = x.topk_keep(s, budget) if alpha is None else x.kvpress_adakv_keep(s, budget, alpha)
        want.update({(i, g): np.flatnonzero(keep[g]).tolist() for g in range(G)})
    assert x.agreement(got, want)["same_cells"] == L * G


def test_the_pages_prose_claims_hold_in_the_result_file():
    """What the page's prose says in words (every cell, none, almost every) against the file."""
    res = json.loads(x.RESULT.read_text(encoding="utf-8"))
    rows = [(name, r["what"], r["agreement"]) for name, b in res["comparisons"].items() for r in b["rows"]]

    def full(a):
        return a["same_cells"] == a["cells"] == res["layers"] * res["kv_heads"]

    def matching(*parts):
        found = [a for _, what, a in rows if all(p in what for p in parts)]
        assert found, parts
        return found

    assert all(full(a) for a in matching("kvpress's rule restated on kvviz's model", "vs kvpress"))
    assert all(full(a) for a in matching("kvviz's allocation code on kvpress's recorded scores"))
    assert all(full(a) for a in matching("kvviz's rule restated", "vs kvviz"))
    assert all(full(a) for a in matching("kvviz's rows and pooling", "vs kvviz"))
    assert all(not full(a) for a in matching("kvviz `", "snapkv", "vs kvpress"))
    assert all(full(a) for a in matching(f"query_window={res['T']}` vs kvpress"))
    assert all(a["same_cells"] <= 5 for a in matching("query_window=256` vs kvpress"))
    assert all(full(a) for a in matching("(the buffer's length onward) vs kvpress"))
    assert all(a["same_cells"] == 0 for a in matching("(the sequence's length onward) vs kvpress"))
    assert all(a["same_cells"] == 0 for a in matching("cut once at the last, vs kvpress"))
    assert all(full(a) for a in matching("the same kvviz run vs kvpress's rule restated"))
