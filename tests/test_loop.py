"""The model in the loop (kvviz.model.loop): SmolLM2 decoding over its own evicted cache.

The refusal tests run without the model. The rest share one SmolLM2 load (tests/conftest.py);
without torch they skip, unless KVVIZ_REQUIRE_CAPTURE=1 (set by CI), where that fails.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

from kvviz.model.loop import LoopConfig, check_configs, load_loop_result, parse_policy
from kvviz.model.loop.cli import build_configs

ROOT = Path(__file__).resolve().parents[1]
PROSE = (ROOT / "traces" / "sources" / "execmodel.txt").read_text(encoding="utf-8")


# -- refusals: one clear line, before the model loads ------------------------------

def _cli(tmp_path, monkeypatch, capsys, *args, text="hello world, a short text."):
    from kvviz.__main__ import main

    src = tmp_path / "t.txt"
    src.write_text(text, encoding="utf-8")
    # torch is blocked: a refusal must come before anything imports it
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit) as stop:
        sys.exit(main(["loop", "--text", str(src), *args]))
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args,text,needle", [
    (["--policy", "nosuch", "--budget", "8"], None, "unknown policy 'nosuch'"),
    (["--policy", "tova:sinks=2", "--budget", "8"], None, "tova has no parameter ['sinks']"),
    (["--policy", "snapkv:poolKernel=4", "--budget", "64"], None, "pool_kernel must be odd"),
    (["--policy", "tova", "--budget", "0"], None, "--budget must be >= 1, got 0"),
    (["--policy", "h2o:recentWindow=32", "--budget", "32"], None, "recent_window must be smaller than budget"),
    (["--policy", "tova", "--budget", "8"], "  \n\t", "is empty"),
    (["--policy", "tova"], None, "--budget is required"),
    (["--policy", "snapkv:pool_kernel=x", "--budget", "8"], None, "pool_kernel must be an integer"),
    (["--policy", "tova", "--budget", "8", "--granularity", "head"], None, "invalid choice: 'head'"),
])
def test_cli_refuses_in_one_line_before_loading_the_model(tmp_path, monkeypatch, capsys, args, text, needle):
    code, err = _cli(tmp_path, monkeypatch, capsys, *args, text=text or "hello world, a short text.")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_streaming_llm_without_sinks_is_accepted():
    assert parse_policy("streaming-llm:sinks=0") == ("streaming-llm", {"sinks": 0})
    cfgs = build_configs(["streaming-llm:sinks=0", "snapkv:poolKernel=1,obsWindow=16"], [64, 128])
    assert [c.label for c in cfgs] == [
        "full", "streaming-llm(sinks=0)@64", "streaming-llm(sinks=0)@128",
        "snapkv(obs_window=16,pool_kernel=1,recent_window=32,pooling=max)@64",
        "snapkv(obs_window=16,pool_kernel=1,recent_window=32,pooling=max)@128"]
    assert cfgs[3].to_dict() == {"policy": "snapkv", "budget": 64,
                                 "params": {"obs_window": 16, "pool_kernel": 1, "recent_window": 32,
                                            "pooling": "max"}}


def test_configs_get_a_full_row_and_refuse_duplicates():
    cfgs = check_configs([LoopConfig("tova", {}, 8)])
    assert [c.policy for c in cfgs] == ["full", "tova"]
    with pytest.raises(ValueError, match="distinct"):
        check_configs([LoopConfig("tova", {}, 8), LoopConfig("tova", {}, 8)])
    with pytest.raises(ValueError, match="policy must be one of"):
        LoopConfig("lru", {}, 8)


# -- the model in the loop ---------------------------------------------------------

B = 16  # small budget: evictions start at step 16
REPLAYED = [LoopConfig("tova", {}, B), LoopConfig("snapkv", {"pool_kernel": 5, "recent_window": 4}, B),
            LoopConfig("h2o", {"recent_window": 4}, B)]
SINKS = [LoopConfig("streaming-llm", {"sinks": 4}, B), LoopConfig("streaming-llm", {"sinks": 0}, B)]
# The smallest runs that still prove each point (a decode step costs the same at any
# length here; the steps are the cost): 64 tokens at layer granularity (48 steps
# evicting: StreamingLLM's collapse shows, figures below), 48 per KV head with only the
# configs its tests read, one with a budget equal to the text.
KNORM = [LoopConfig("knorm", {}, B), LoopConfig("knorm", {}, 48)]  # the attention-free one
RUNS = {"layer": (64, REPLAYED + SINKS), "kv-head": (48, REPLAYED + [LoopConfig("tova", {}, 48)] + KNORM)}


@pytest.fixture(scope="module")
def model(smollm):
    return smollm


@pytest.fixture(scope="module")
def runs(model):
    """One batched loop per granularity over the start of the shipped prose."""
    from kvviz.model.loop import run_loop

    return {gran: run_loop(PROSE, configs, granularity=gran, max_tokens=tokens, model=model,
                           rows_layers=range(30))
            for gran, (tokens, configs) in RUNS.items()}


def _plain_nll(model, ids, mask=None):
    """Per-token NLL from one ordinary forward pass (eager attention, optional 4-D mask)."""
    import torch

    tok, mdl = model
    assert mdl.config._attn_implementation == "eager"  # the loop put it back
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        logits = mdl(input_ids=x, attention_mask=mask, use_cache=False).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return -logp[torch.arange(len(ids) - 1), x[0, 1:]].numpy()


def test_budget_at_least_the_text_is_the_plain_forward_pass(model, runs, torch_stack):
    res = runs["kv-head"]
    ref = _plain_nll(model, res.token_ids)
    never = [i for i, c in enumerate(res.configs) if c.is_full or c.budget >= len(res.tokens)]
    assert len(res.tokens) == 48 and [res.configs[i].label for i in never] == ["full", "tova@48", "knorm@48"]
    for i in never:
        assert (res.evicted_at[i] == -1).all()
        assert np.abs(res.nll[i] - ref).max() < 1e-4
        assert res.results[i]["perplexity"] == pytest.approx(np.exp(ref.mean()), rel=1e-4)
    for i in never[1:]:
        assert res.results[i]["top1_agreement"] == 1.0 and res.results[i]["kl"] < 1e-6


def test_knorm_in_the_loop_evicts_the_highest_key_norms_of_the_cache(model, runs, torch_stack):
    """Layer 0's keys depend only on the tokens (embedding, projection, RoPE), not on what
    was evicted, so the L2 norms of a plain forward pass's cached layer-0 keys say what
    knorm must do: at every step, per KV head, the position the loop evicted has the
    highest norm of everything it held then. (Up to float rounding: the loop decodes a
    batch of configurations, the plain pass one sequence, and a multi-threaded matmul may
    round the two differently, which can swap two near-equal norms.)"""
    import torch

    res = runs["kv-head"]
    c = next(i for i, x in enumerate(res.configs) if x.label == f"knorm@{B}")
    with torch.no_grad():
        out = model[1](input_ids=torch.tensor([list(res.token_ids)]), use_cache=True)
    norms = out.cache.layers[0].keys[0].float().norm(dim=-1).numpy()  # (KV heads, T)
    T = len(res.tokens)
    for h in range(norms.shape[0]):
        ev = res.evicted_at[c, 0, h]
        assert (ev != -1).sum() == T - B
        for t in range(B, T):
            held = [p for p in range(t + 1) if ev[p] == -1 or ev[p] >= t]  # before step t's eviction
            victim, = [p for p in held if ev[p] == t]
            top = max(norms[h, p] for p in held)
            assert norms[h, victim] >= top * (1 - 1e-5), (h, t, victim, norms[h, victim], top)

def test_masked_keys_are_removed_keys(model, runs, torch_stack):
    """StreamingLLM's held set is known in closed form: query t sees the 4 sinks and the
    12 newest positions before it. An ordinary forward pass with exactly that 4-D mask
    must give the loop's per-token NLL."""
    import torch

    res = runs["layer"]
    c = next(i for i, x in enumerate(res.configs) if x.label == "streaming-llm(sinks=4)@16")
    T = len(res.tokens)
    t, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= t) & ((j < 4) | (j >= t - B + 4))
    mask = torch.where(torch.tensor(visible), 0.0, float("-inf"))[None, None]
    assert np.abs(res.nll[c] - _plain_nll(model, res.token_ids, mask)).max() < 1e-4
    assert np.abs(res.nll[c] - _plain_nll(model, res.token_ids)).max() > 0.1  # eviction mattered


def test_evicting_one_key_removes_exactly_its_term(torch_stack):
    """The attention function with position p masked for KV head 1 only: heads reading KV
    head 1 lose p's term and renormalise, out' = (out - w_p v_p) / (1 - w_p); the others
    are unchanged, and p's weight is 0."""
    import torch

    from kvviz.model.loop import engine

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 1 if n == 9 else 7, 64, generator=g) for n in (9, 3, 3))
    module = type("M", (), {"layer_idx": 0})()
    full, _ = engine.attention(module, q, k, v, None, 0.125)
    state = engine.State(torch, 2, 1, 3, 3, 7)
    p = 2
    state.bias[1, 0, 1, p] = -np.inf
    engine.bind(module, state)  # the lane this module's model runs
    masked, _ = engine.attention(module, q, k, v, None, 0.125)
    assert state.cur[1, 0, 1, p] == 0 and state.cur[0, 0, 1, p] > 0
    w = torch.softmax((q[1, 3:6, 0] @ k[1, 1].T) * 0.125, dim=-1)  # (3 heads, 7 keys)
    expect = (full[1, 0, 3:6] - w[:, p:p + 1] * v[1, 1, p]) / (1 - w[:, p:p + 1])
    assert torch.allclose(masked[1, 0, 3:6], expect, atol=1e-5)
    untouched = [h for h in range(9) if h not in (3, 4, 5)]
    assert torch.equal(masked[1, 0, untouched], full[1, 0, untouched])
    assert torch.equal(masked[0], full[0])


def test_each_model_reads_its_own_lane(torch_stack):
    """No module global carries a step's state: two modules bound to two lanes each record
    into their own State, one bound to none runs plain attention, and `use` refuses a model
    that is not attached."""
    import torch

    from kvviz.model.loop import engine

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (1, 5, 5))
    first, second, plain = (type("M", (), {"layer_idx": 0})() for _ in range(3))
    a, b = engine.State(torch, 1, 1, 2, 1, 5), engine.State(torch, 1, 1, 2, 1, 5)
    b.bias[0, 0, :, 1] = -np.inf
    engine.bind(first, a)
    engine.bind(second, b)
    out_a, _ = engine.attention(first, q, k, v, None, 0.3)
    out_b, _ = engine.attention(second, q, k, v, None, 0.3)
    out_plain, _ = engine.attention(plain, q, k, v, None, 0.3)
    assert torch.equal(out_a, out_plain) and not torch.allclose(out_a, out_b)
    assert a.cur[0, 0, 0, 1] > 0 and b.cur[0, 0, 0, 1] == 0  # each lane recorded its own weights
    assert (b.cur[0, 0, 0, [0, 2, 3]] > a.cur[0, 0, 0, [0, 2, 3]]).all()  # b renormalised without 1
    with pytest.raises(ValueError, match="not attached"):
        engine.use(plain, a)


@pytest.mark.parametrize("gran", ["layer", "kv-head"])
def test_loop_victims_equal_replay_of_the_rows_it_recorded(runs, gran):
    from kvviz.core.replay import Replay

    res = runs[gran]
    T = len(res.tokens)
    for c, cfg in enumerate(res.configs):
        if cfg.policy not in ("tova", "snapkv", "h2o") or cfg.budget >= T:
            continue
        for layer in range(30):
            for h in range(len(res.heads)):
                ev = res.evicted_at[c, layer, h]
                assert (ev != -1).sum() == T - B  # the budget holds at every step
                replay = Replay(res.trace(c, layer, h), cfg.make(layer, h)).run()
                np.testing.assert_array_equal(replay.evicted_at, ev, err_msg=f"{cfg.label} L{layer} h{h}")
                # the model really gave no weight to evicted keys, and some to every held one
                tr = res.trace(c, layer, h)
                for t in (B + 1, T // 2, T - 1):
                    row, held = tr.row(t), replay.held_mask(t - 1)[:t]
                    assert (row[~held] == 0).all() and (row[held] > 0).all()
    if gran == "kv-head":  # KV heads choose differently
        c = next(i for i, x in enumerate(res.configs) if x.policy == "tova")
        assert any((res.evicted_at[c, layer, 0] != res.evicted_at[c, layer, 1]).any() for layer in range(30))


def test_sliding_window_without_sinks_loses_to_four_sinks(runs):
    """StreamingLLM's collapse, on the shipped prose (first 64 tokens, budget 16, layer
    granularity, perplexity over the tokens predicted after the first eviction). Measured
    2026-12-01 (torch 2.13 CPU, 1 thread): 4 sinks + 12 recent 25.68; 16 recent, no sink
    2652.0 (full cache 20.87 over all 63 predictions). KL(full || .) 0.206 vs 3.664; top-1
    agreement with the full cache 0.857 vs 0.333 (over all 63). At 96 tokens, as measured
    2026-11-30 and again 2026-12-01: 41.38 vs 1587.30, KL 0.371 vs 3.356, top-1 0.768 vs 0.347."""
    by = {r["label"]: r for r in runs["layer"].results}
    zero, four = by["streaming-llm(sinks=0)@16"], by["streaming-llm(sinks=4)@16"]
    assert zero["perplexity_after_eviction"] > 2 * four["perplexity_after_eviction"]
    assert zero["kl"] > four["kl"] and zero["top1_agreement"] < four["top1_agreement"]


def test_cli_writes_json_and_result(model, tmp_path, capsys):
    from kvviz.__main__ import main

    src, js, npz = tmp_path / "t.txt", tmp_path / "r.json", tmp_path / "r.npz"
    src.write_text(PROSE[:400], encoding="utf-8")
    assert main(["loop", "--text", str(src), "--max-tokens", "24", "--budget", "8", "--budget", "12",
                 "--policy", "streaming-llm:sinks=0", "--granularity", "kv-head", "--json", str(js),
                 "--out", str(npz), "--quiet"]) == 0
    import json

    data = json.loads(js.read_text())
    results = data["results"]
    # provenance: the bundled model, by name and the GGUF's own hash; no BOS (SmolLM2's convention)
    assert "SmolLM2" in data["model"] and data["model_source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(data["model_sha256"]) == 64 and data["bos"] is False
    assert (data["dtype"], data["device"]) == ("float32", "cpu") and data["torch"] and data["transformers"]
    assert [(r["policy"], r["budget"]) for r in results] == [
        ("full", None), ("streaming-llm", 8), ("streaming-llm", 12)]
    keys = {"policy", "params", "budget", "granularity", "perplexity", "perplexity_after_eviction",
            "top1_agreement", "kl"}
    assert all(keys <= set(r) for r in results) and results[1]["params"] == {"sinks": 0}
    back = load_loop_result(npz)
    assert back.results == results and back.evicted_at.shape == (3, 30, 3, 24)
    assert {k: back.meta[k] for k in ("model", "model_sha256", "bos")} == \
        {k: data[k] for k in ("model", "model_sha256", "bos")}
    run = back.run(1, 29, 2)
    assert run.held_at(23).tolist() == list(range(16, 24))  # sinks=0: the 8 newest
    # the two memories side by side: 3 rows x 24 positions x 30 layers x 3 KV heads x 64 x (key, value) x
    # 4 bytes held (masked: every row the whole cache); streaming-llm's 4 bytes per slot x 8 and 12 slots
    # in each of 90 streams
    assert (data["eviction"], data["cache_bytes"], data["full_cache_bytes"]) == \
        ("masked", 3 * 24 * 30 * 3 * 64 * 2 * 4, 3 * 24 * 30 * 3 * 64 * 2 * 4)
    assert data["policy_bytes"] == (8 + 12) * 90 * 4
    # and per configuration: each row holds the whole cache (masked); each policy its own slots
    row_bytes = 24 * 30 * 3 * 64 * 2 * 4
    assert [(m["label"], m["kv_held_bytes"], m["full_cache_bytes"], m["policy_bytes"])
            for m in data["memory_by_config"]] == [
        ("full", row_bytes, row_bytes, 0), ("streaming-llm(sinks=0)@8", row_bytes, row_bytes, 8 * 90 * 4),
        ("streaming-llm(sinks=0)@12", row_bytes, row_bytes, 12 * 90 * 4)]
    assert [(r["kv_held_bytes"], r["policy_bytes"]) for r in results] == [
        (row_bytes, 0), (row_bytes, 8 * 90 * 4), (row_bytes, 12 * 90 * 4)]
    out = capsys.readouterr().out
    assert "eviction masked: keys and values held 3.2 MiB (the full cache: 3.2 MiB); the policies' own " \
        "bookkeeping 7.0 KiB" in out
    assert "24 tokens x 3 configurations in " in out and "of a step)" in out


def test_perf_plain_decode_shows_progress_every_step(torch_stack):
    """`loop --perf` once sat silent for minutes while timing the model's own decode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvviz.studies.loop_perf import plain_decode

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    calls = []
    secs = plain_decode(LlamaForCausalLM(cfg).eval(), [3, 1, 4, 1, 5], 2,
                        lambda done, total: calls.append((done, total)))
    assert calls == [(t, 5) for t in range(1, 6)] and len(secs) == 5 and (secs > 0).all()


def test_the_cli_table_names_configurations_as_the_app_does():
    """`kvviz loop`'s table and `kvviz needle`'s summary name each row by config_label."""
    import pandas as pd

    from kvviz.model.loop.cli import table
    from kvviz.model.needle.cli import summary

    rows = [{"policy": "full", "params": {}, "budget": None, "perplexity": 9.0,
             "perplexity_after_eviction": None, "top1_agreement": 1.0, "kl": 0.0},
            {"policy": "snapkv", "params": {"obs_window": 16, "pool_kernel": 1}, "budget": 64,
             "perplexity": 10.0, "perplexity_after_eviction": 11.0, "full_perplexity_after_eviction": 12.5,
             "top1_agreement": 0.9, "kl": 0.1}]
    lines = table(rows).splitlines()
    names = [line.split("  ")[0] for line in lines[1:3]]
    assert names == ["full cache", "snapkv (poolKernel=1) @ 64"]
    # beside each configuration's perplexity after its first eviction: the full cache's on the same tokens
    assert lines[0].split()[1:5] == ["ppl", "after", "full", "diff"]
    assert lines[2].split()[-6:-2] == ["10.000", "11.000", "12.500", "-1.500"]
    assert lines[1].split()[-6:-2] == ["9.000", "-", "-", "-"]
    assert "the full cache's perplexity on those same tokens" in lines[3]
    df = pd.DataFrame({"prompt_mode": ["decode"] * 2, "policy": ["full", "snapkv"],
                       "params": ["{}", '{"pool_kernel": 1}'], "budget": [0, 64],
                       "correct": [True, False], "held_end": [1.0, 0.5]})
    assert "snapkv (poolKernel=1) @ 64" in summary(df) and "full cache" in summary(df)
