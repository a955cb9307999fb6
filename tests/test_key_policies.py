"""R-KV and Expected Attention, the policies that read the cache's keys and the step's
queries. The expected victims are worked by hand from the papers' rules (their Hypothesis
differential against kvviz.core.reference_vectors is tests/test_policies.py's, with every
policy's); the seam refuses what is missing or malformed by name."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvviz.core import harness
from kvviz.core.check import truncated
from kvviz.core.policies import make_policy
from kvviz.core.reference_vectors import RefExpectedAttention, RefRKV
from kvviz.core.replay import Replay, can_drive
from kvviz.core.trace import canonical


def _drive(policy, keys, queries, budget, vnorms=None):
    """Step positions 0.. with `keys[t]` admitted and `queries[t]` observed; victims per step."""
    out = []
    for t, q in enumerate(queries):
        kept = np.asarray(policy.kept, np.int64)
        extra = {} if vnorms is None else {"value_norm": vnorms[t]}
        policy.on_decode_step(t, None, keys=np.asarray(keys, np.float32)[np.append(kept, t)],
                              query=np.asarray(q, np.float32), **extra)
        out.append(policy.evict(budget).tolist())
    return out


# -- R-KV, by hand ---------------------------------------------------------------------------
# budget 3, window 1 (the newest slot stays; the last query observes), threshold 0.5,
# mix_lambda 0.5, head_dim 2, one query head.
RKV_KEYS = [(1, 0), (1, 0), (1, 0), (0, 1), (0, 1)]
C = math.sqrt(2) * math.log(4)  # a query (C, 0) gives a key (1, 0) the logit ln 4
RKV_QUERIES = [(0, 0), (0, 0), (0, 0), (0, 0), (C, 0)]
# t3: kept [0, 1, 2, 3], candidates 0, 1, 2. Query (0, 0): every logit 0, importance 1/3 each.
#     Redundancy: 0, 1, 2 are one key, 3 is orthogonal. Row 0's newest similar key is 2,
#     row 1's is 2, row 2's is 1, row 3 has none (its entry at 0, already 0, is zeroed):
#     rows 0 [0, 1, 0, 0], 1 [1, 0, 0, 0], 2 [1, 0, 0, 0], 3 zeros. Column means / 4:
#     [0.5, 0.25, 0, 0], softmaxed: [0.3342, 0.2603, 0.2027, 0.2027]. The score
#     0.5/3 - 0.5 x redundancy is lowest for pos 0: the oldest copy goes, the newest stays.
# t4: kept [1, 2, 3, 4], candidates 1, 2, 3. Keys: 1 = 2, 3 = 4. Each row's one similar key
#     is zeroed, so every row is zero: redundancy 1/4 each (a pair is not redundant).
#     Query (C, 0): logits ln 4, ln 4, 0 -> importance [4/9, 4/9, 1/9]: pos 3 goes.
#     With kernel_size 3, pos 3's importance is pooled from its neighbour pos 2: 4/9 too,
#     all three tie, and the lowest position, pos 1, goes.
RKV_VICTIMS = {1: [[], [], [], [0], [3]], 3: [[], [], [], [0], [1]]}


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("build", [make_policy, RefRKV], ids=["fast", "reference"])
def test_rkv_victims_worked_by_hand(build, kernel):
    params = dict(window=1, kernel_size=kernel, threshold=0.5, mix_lambda=0.5)
    policy = build("rkv", budget=3, **params) if build is make_policy else build(3, None, **params)
    assert _drive(policy, RKV_KEYS, RKV_QUERIES, 3) == RKV_VICTIMS[kernel]


def test_rkv_scores_worked_by_hand():
    policy = make_policy("rkv", budget=3, window=1, kernel_size=1, threshold=0.5, mix_lambda=0.5)
    _drive(policy, RKV_KEYS[:3], RKV_QUERIES[:3], 3)
    policy.on_decode_step(3, None, keys=np.array(RKV_KEYS[:4], np.float32),
                          query=np.zeros((1, 2), np.float32))
    e = [math.exp(0.5), math.exp(0.25), 1.0, 1.0]
    red = [v / sum(e) for v in e]
    got = policy.scores()
    np.testing.assert_allclose(got["redundancy"][:3], red[:3], atol=1e-7)  # unit keys: |k| + 1e-8
    np.testing.assert_allclose(got["importance"][:3], [1 / 3] * 3, rtol=1e-12)
    np.testing.assert_allclose(got["score"][:3], [0.5 / 3 - 0.5 * r for r in red[:3]], atol=1e-7)
    assert np.isnan(got["score"][3]) and got["candidate"].tolist() == [True, True, True, False]


# -- Expected Attention, by hand -------------------------------------------------------------
# head_dim 2 (one RoPE frequency, 1 radian per position whatever the base: rope_theta is
# given only because nothing here records one), one query head, no covariance,
# n_future_positions 1: the mean rotation is RoPE at the next position, 3. Each query is
# (1, 0) before RoPE, given after it: (cos t, sin t). So mu = (cos 3, sin 3) =
# (-0.98999, 0.14112). Keys (after RoPE, as the cache holds them): (1, 0), (-1, 0), (0, 1):
# logits mu.k / sqrt 2 = -0.70003, 0.70003, 0.09979, softmaxed: 0.13735, 0.55702, 0.30563.
# Value norms 1, 0.2, 1: scores 0.13735, 0.11140, 0.30563 -> pos 1 goes; without the value
# norms pos 0 goes. With n_sink 1, pos 0 stays and the softmax is over pos 1 and 2 alone:
# 0.64571 x 0.2 = 0.12914 < 0.35429 -> pos 1.
EA_KEYS = [(1, 0), (-1, 0), (0, 1)]
EA_QUERIES = [(math.cos(t), math.sin(t)) for t in range(3)]
EA_VNORMS = [1.0, 0.2, 1.0]
EA_CASES = [({"use_vnorm": True, "n_sink": 0}, [[], [], [1]]),
            ({"use_vnorm": False, "n_sink": 0}, [[], [], [0]]),
            ({"use_vnorm": True, "n_sink": 1}, [[], [], [1]])]


@pytest.mark.parametrize("case", range(len(EA_CASES)))
@pytest.mark.parametrize("build", [make_policy, RefExpectedAttention], ids=["fast", "reference"])
def test_expected_attention_victims_worked_by_hand(build, case):
    extra, victims = EA_CASES[case]
    params = dict(n_future_positions=1, use_covariance=False, epsilon=0.0, rope_theta=10000.0, **extra)
    policy = (build("expected-attention", budget=2, **params) if build is make_policy
              else build(2, None, **params))
    assert _drive(policy, EA_KEYS, [[q] for q in EA_QUERIES], 2, EA_VNORMS) == victims


def test_expected_attention_scores_worked_by_hand():
    policy = make_policy("expected-attention", budget=2, n_future_positions=1, use_covariance=False,
                         n_sink=0, rope_theta=10000.0)
    _drive(policy, EA_KEYS[:2], [[q] for q in EA_QUERIES[:2]], 2, EA_VNORMS)
    policy.on_decode_step(2, None, keys=np.array(EA_KEYS, np.float32),
                          query=np.array([EA_QUERIES[2]], np.float32), value_norm=1.0)
    got = policy.scores()
    np.testing.assert_allclose(got["expected"], [0.13735, 0.55702, 0.30563], atol=1e-5)
    np.testing.assert_allclose(got["score"], [0.13735, 0.11140, 0.30563], atol=1e-5)


# -- the seam --------------------------------------------------------------------------------
def test_a_trace_without_keys_is_refused_by_name():
    trace = truncated(canonical(16), 16)  # value norms, keys and queries (synthetic)
    trace.keys = trace.queries = None
    for name in ("rkv", "expected-attention"):
        with pytest.raises(ValueError, match=f"{name} reads key and query vectors, and trace "
                                             "'canonical' has none: pick a trace captured with"):
            Replay(trace, make_policy(name, budget=16))
    trace = truncated(canonical(16), 16)
    rkv = make_policy("rkv", budget=16).__class__
    assert can_drive(trace, rkv)
    trace.queries = None
    assert not can_drive(trace, rkv)
    with pytest.raises(ValueError, match="rkv reads query vectors, and trace"):
        Replay(trace, make_policy("rkv", budget=16))
    trace.queries = np.zeros((2, 15, 4), np.float16)  # one step short
    with pytest.raises(ValueError, match=r"queries must be .* with T = 16"):
        Replay(trace, make_policy("rkv", budget=16))


def test_a_trace_with_keys_replays_and_the_policy_reads_them():
    trace = truncated(canonical(64), 64)
    runs = []
    for seed in (0, 1):
        if seed:
            trace.keys = np.random.default_rng(seed).normal(size=trace.keys.shape).astype(np.float16)
        replay = Replay(trace, make_policy("expected-attention", budget=16))
        runs.append(replay.run().evicted_at.copy())
    assert (runs[0] != runs[1]).any()  # other keys, other victims
    assert (runs[0] >= 0).sum() == 64 - 16


@pytest.mark.parametrize("bad,rule", [
    (lambda k, q: (None, q), "reads key vectors, and none were given"),
    (lambda k, q: (k, None), "reads query vectors, and none were given"),
    (lambda k, q: (k[:-1], q), r"keys must be \(kept positions \+ the admitted one"),
    (lambda k, q: (np.where(k == k.max(), np.nan, k), q), "keys must be finite"),
    (lambda k, q: (k, q[:, :3]), "query and keys must share one head_dim"),
    (lambda k, q: (k, np.full_like(q, np.inf)), "query must be finite"),
])
def test_the_seam_refuses_bad_vectors_by_name(bad, rule):
    policy = make_policy("rkv", budget=4, window=1)
    keys, query = np.ones((1, 4), np.float32), np.ones((2, 4), np.float32)
    keys, query = bad(keys, query)
    with pytest.raises(ValueError, match=rule):
        harness.step(policy, 0, None, 4, keys=keys, query=query)


def test_odd_head_dim_is_refused_by_expected_attention():
    policy = make_policy("expected-attention", budget=4, n_sink=0)
    with pytest.raises(ValueError, match="head_dim must be even"):
        policy.on_decode_step(0, None, keys=np.ones((1, 3)), query=np.ones((1, 3)), value_norm=1.0)


def test_memory_per_slot_counts_no_keys():
    """Keys are the cache's, read each step: neither policy keeps a copy per slot."""
    assert make_policy("rkv", budget=16).bytes_per_slot == 4 + 1
    assert make_policy("expected-attention", budget=16).bytes_per_slot == 4 + 4 + 1


# -- in the model loop, on a tiny random-weight model --------------------------------------
TEXT = "The committee met at noon; the minutes record that the motion passed on a bright day."


def _layer0_vectors(mdl, ids):
    """Layer 0's keys (Hk, T, D) and queries (Hq, T, D) after RoPE from a plain forward: they
    depend on no attention, so eviction leaves them as they are."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = mdl.model.layers[0].self_attn
    got = {}
    hook = attn.q_proj.register_forward_hook(lambda m, i, o: got.setdefault("q", o.detach()))
    try:
        with torch.no_grad():
            out = mdl(input_ids=torch.tensor([ids]), use_cache=True)
    finally:
        hook.remove()
    cache = out.past_key_values
    keys = cache.layers[0].keys if hasattr(cache, "layers") else cache.key_cache[0]
    T, D = len(ids), keys.shape[-1]
    q = got["q"].view(1, T, -1, D).transpose(1, 2)
    cos, sin = mdl.model.rotary_emb(q, torch.arange(T)[None])
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return keys[0].float().numpy(), q[0].float().numpy()


def test_in_the_loop_layer_0_is_the_reference_on_the_models_vectors(tiny_llama, torch_stack):
    """Both policies in one run per eviction mode; layer 0's victims are the reference's fed
    the model's own layer-0 keys, queries and value norms (Expected Attention's rope_theta
    left at its default, the run's: the loop hands it the model's, which the reference is
    given). Then what the loop refuses."""
    import torch

    from kvviz.model.loop import LoopConfig, generate, run_loop

    tok, mdl = tiny_llama
    theta = (getattr(mdl.config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    budget = 6
    setups = [("rkv", {"window": 2, "kernel_size": 3}, RefRKV),
              ("expected-attention", {"n_sink": 2, "n_future_positions": 8}, RefExpectedAttention)]
    ref_params = {"rkv": {}, "expected-attention": {"rope_theta": float(theta)}}
    configs = [LoopConfig("full")] + [LoopConfig(name, params, budget) for name, params, _ in setups]
    for eviction in ("masked", "freed"):
        res = run_loop(TEXT, configs, max_tokens=16, model=tiny_llama, granularity="kv-head",
                       eviction=eviction)
        ids = res.token_ids.tolist()
        T = len(ids)
        keys, queries = _layer0_vectors(mdl, ids)
        with torch.no_grad():
            cache = mdl(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
        values = cache.layers[0].values if hasattr(cache, "layers") else cache.value_cache[0]
        vnorms = values[0].float().norm(dim=-1).numpy()  # (Hk, T)
        Hk, Hq = keys.shape[0], queries.shape[0]
        for c, (name, params, ref_cls) in enumerate(setups, start=1):
            for h in range(Hk):
                ref, want = ref_cls(budget, None, **params, **ref_params[name]), np.full(T, -1)
                group = slice(h * (Hq // Hk), (h + 1) * (Hq // Hk))
                for t in range(T):
                    ref.on_decode_step(t, None, keys=keys[h][np.append(ref.kept, t)],
                                       query=queries[group, t], value_norm=float(vnorms[h, t]))
                    want[ref.evict(budget)] = t
                ev = res.evicted_at[c, 0, h]
                assert (ev != -1).sum() == T - budget
                np.testing.assert_array_equal(ev, want, err_msg=f"{name}, {eviction}, head {h}")
    # a prompt read in one pass: layer 0's one-shot eviction at the prompt's last row is the
    # reference's fed every prompt position; kvviz.hf (which reads the prompt in one pass) agrees
    import kvviz.hf

    prompt, n, (name, params, ref_cls) = TEXT[:40], 4, setups[0]
    gen = generate(prompt, [LoopConfig(name, params, budget)], n, granularity="kv-head",
                   prompt_mode="prefill", model=tiny_llama)
    c, T0 = 1 - gen.full_index, gen.prompt_len
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert len(ids) == T0 > budget
    keys, queries = _layer0_vectors(mdl, ids)
    Hk, Hq = keys.shape[0], queries.shape[0]
    for h in range(Hk):
        ref = ref_cls(budget, None, **params)
        for t in range(T0):
            ref.on_decode_step(t, None, keys=keys[h][np.append(ref.kept, t)],
                               query=queries[h * (Hq // Hk):(h + 1) * (Hq // Hk), t])
        want = np.full(T0, -1)
        want[ref.evict(budget)] = T0 - 1
        at_prompt = np.where(gen.evicted_at[c, 0, h, :T0] == T0 - 1, T0 - 1, -1)  # later steps aside
        np.testing.assert_array_equal(at_prompt, want, err_msg=f"prefill, head {h}")
    with kvviz.hf.evicting(mdl, policy=name, budget=budget, granularity="kv-head", **params) as log:
        out = mdl.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    assert out[0, T0:].tolist() == gen.generated(c).tolist()
    np.testing.assert_array_equal(log.evicted_at, gen.evicted_at[c, :, :, : T0 + n - 1])
    # what the loop cannot supply is refused by name
    with pytest.raises(ValueError, match=f"expected-attention's rope_theta=3 is not the RoPE base the "
                                         rf"model's config records \({theta:g}\): pass rope_theta={theta:g}"):
        run_loop(TEXT, [LoopConfig("full"), LoopConfig("expected-attention", {"rope_theta": 3.0}, 6)],
                 max_tokens=8, model=tiny_llama, granularity="kv-head")
    with pytest.raises(ValueError, match=r"expected-attention's rope_theta=3 is not the RoPE base the model's"):
        generate(prompt, [LoopConfig("expected-attention", {"rope_theta": 3.0}, 6)], 2, granularity="kv-head",
                 prompt_mode="prefill", model=tiny_llama)
    assert mdl.config.num_key_value_heads > 1
    with pytest.raises(ValueError, match="rkv: reads key and query vectors, which belong to one KV head"):
        run_loop(TEXT, [LoopConfig("full"), LoopConfig("rkv", {"window": 2}, 6)], max_tokens=8,
                 model=tiny_llama, granularity="layer")


# -- in the page ------------------------------------------------------------------------------
def test_the_page_refuses_them_on_a_trace_without_keys(apptest):
    import apphelp

    at = apphelp.app(timeout=180, a="rkv", b="expected-attention", budget=64, step=300, view="scores")
    apphelp.ok(at)  # no traceback
    refused = " ".join(e.value for e in at.error)
    assert "Refused: " in refused and "rkv reads key and query vectors, and trace" in refused
    assert "Refused: expected-attention reads value norms, and trace" in refused  # checked first


def test_a_trace_file_with_vectors_replays_its_kv_heads_keys(tmp_path):
    """A trace file's keys and queries are every stored layer's (format version 5): the
    replay of layer 7's head kv1 reads KV head 1's keys and its group's two query heads; a
    head mean over two KV heads is refused by name."""
    from kvviz.core.trace import load_trace, save_trace

    rng = np.random.default_rng(5)
    T, d = 24, 4
    attn = np.tril(rng.random((2, 3, T, T)), k=-1).astype(np.float32)
    keys = rng.normal(size=(2, 2, T, d)).astype(np.float16)
    queries = rng.normal(size=(2, 4, T, d)).astype(np.float16)
    path = save_trace(tmp_path / "vec.npz", attn, layers=[3, 7], heads=["mean", "kv0", "kv1"],
                      keys=keys, queries=queries)
    trace = load_trace(path, layer=7, head="kv1")
    run = Replay(trace, make_policy("rkv", budget=8, window=2)).run()
    by_hand = make_policy("rkv", budget=8, window=2)
    want = np.full(T, -1)
    for t in range(T):
        want[harness.step(by_hand, t, None, 8, keys=keys[1, 1][np.append(by_hand.kept, t)].astype(np.float32),
                          query=queries[1, 2:4, t].astype(np.float32))] = t
    assert run.evicted_at.tolist() == want.tolist() and (want >= 0).sum() == T - 8
    with pytest.raises(ValueError, match="head 'mean' averages 2 KV heads, and a key vector belongs to one"):
        Replay(load_trace(path, layer=7), make_policy("rkv", budget=16))
    assert not can_drive(load_trace(path, layer=7), make_policy("rkv", budget=16).__class__)
