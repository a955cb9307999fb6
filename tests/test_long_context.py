"""Long prompts: the prompt's rows reach the policies a block of queries at a time (no
(T0, T0) array), and the freed eviction mode, whose cache holds only the kept positions.

The reference for a prefill is the plain rule from the model's own rows: Hugging Face's
eager attention with output_attentions=True gives every prompt row, each policy is fed
every row in order and steps the last (kvviz.core.harness), and what it holds must be
what the chunked engine holds, for any block size. Masked and freed must agree on the
tokens (and the log-probabilities within float rounding): the same policies decide, only
the memory differs.
"""
import numpy as np
import pytest
from modelhelp import eager_attentions

from kvviz.core import harness
from kvviz.core.replay import NEVER
from kvviz.model.loop import LoopConfig, generate, run_loop

PROMPT = ("The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is Berlin. "
          "Our meeting moved to Thursday at noon, in the blue room. The capital of Spain is")
POLICIES = [LoopConfig("tova", {}, 12), LoopConfig("snapkv", {"obs_window": 4, "recent_window": 3}, 12),
            LoopConfig("h2o", {"recent_window": 3}, 12), LoopConfig("scissorhands", {"history_window": 6,
                                                                                  "recent_window": 3}, 12),
            LoopConfig("streaming-llm", {"sinks": 2}, 12), LoopConfig("knorm", {}, 12),
            LoopConfig("random", {}, 12)]


@pytest.fixture(autouse=True)
def one_thread(torch_stack):
    """One torch thread, as the model commands run: with two, the matrix products split
    differently for different batch shapes (masked runs every row in one batch, freed in
    lanes), and K-norm's exact ties (RoPE keeps a key's norm, so a repeated token's keys
    tie) are then decided by rounding noise."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_prefill(pair, ids, configs, granularity):
    """evicted_at (C, L, G, T0) of each config's one-shot prefill eviction, from every row of
    the model's own eager attention, each policy fed row by row (the plain rule)."""
    tok, mdl = pair
    att = eager_attentions(mdl, ids)
    Hk = mdl.config.num_key_value_heads
    L, T0 = len(att), len(ids)
    G = 1 if granularity == "layer" else Hk
    rows = np.stack([(a[0].float().mean(dim=0, keepdim=True) if G == 1
                      else a[0].float().view(Hk, -1, T0, T0).mean(dim=1)).numpy() for a in att])
    norms = None
    ev = np.full((len(configs), L, G, T0), NEVER, np.int64)
    for c, cfg in enumerate(configs):
        if cfg.is_full:
            continue
        for layer in range(L):
            for g in range(G):
                p = cfg.make(layer, g, 0)
                if p.reads_key_norms:
                    if norms is None:
                        norms = key_norms(mdl, ids, G)
                    kn = norms[layer, g]
                else:
                    kn = np.zeros(T0, np.float32)
                for t in range(T0 - 1):
                    harness.feed(p, t, rows[layer, g, t, :t], kn[t])
                victims = harness.step(p, T0 - 1, rows[layer, g, T0 - 1, :T0 - 1], cfg.budget, kn[T0 - 1])
                ev[c, layer, g, victims] = T0 - 1
    return ev


def key_norms(mdl, ids, G):
    """(L, G, T0): each cached key's L2 norm (after RoPE), mean over KV heads when G == 1."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        mdl(torch.tensor([ids]), cache=cache, use_cache=True)
    out = []
    for lay in cache.layers:
        n = lay.keys[0].float().norm(dim=-1)  # (Hk, T0)
        out.append((n.mean(dim=0, keepdim=True) if G == 1 else n).numpy())
    return np.stack(out)


@pytest.mark.parametrize("granularity", ["layer", "kv-head"])
def test_chunked_prefill_holds_what_every_stored_row_gives(smollm, granularity):
    tok, _ = smollm
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    T0 = len(ids)
    assert T0 > 30
    want = reference_prefill(smollm, ids, [LoopConfig("full"), *POLICIES], granularity)
    gens = {chunk: generate(ids, POLICIES, 4, granularity=granularity, prompt_mode="prefill", model=smollm,
                            prefill_chunk=chunk) for chunk in (1, 7, T0)}
    for chunk, gen in gens.items():
        got = gen.evicted_at[..., :T0] == T0 - 1  # the prompt's victims (later steps evict more)
        for c, cfg in enumerate(gen.configs):
            assert np.array_equal(got[c], want[c] == T0 - 1), (chunk, cfg.label)
        assert np.array_equal(gen.new_ids, gens[T0].new_ids), chunk
    # every evicting config held exactly its budget after the prompt, in every stream
    for c, cfg in enumerate(gens[7].configs):
        if not cfg.is_full:
            assert (gens[7].held(c, T0 - 1).sum(axis=-1) == cfg.budget).all(), cfg.label


def _same(a, b, what, rows=None):
    """The same evictions, tokens and (within float rounding) log-probabilities, for the
    configurations `rows` (every one by default)."""
    rows = slice(None) if rows is None else list(rows)
    assert np.array_equal(a.evicted_at[rows], b.evicted_at[rows]), what
    assert np.array_equal(a.new_ids[rows], b.new_ids[rows]), what
    la, lb = a.logprobs[rows], b.logprobs[rows]
    both = ~np.isnan(la)
    assert np.array_equal(both, ~np.isnan(lb))
    assert np.abs(la[both] - lb[both]).max() < 1e-3, what


def _same_up_to_exact_ties(a, b, c):
    """K-norm (config c) in both runs: at layer 0 a key is its token's (no attention before
    it), so a repeated token's keys have exactly the same norm, and which of them goes is the
    tie-break's on exact arithmetic but rounding noise's in float32: the matrix products round
    differently for different batch rows (masked runs every configuration in one batch, freed
    in lanes), on some CPUs (AVX-512 kernels) even with one thread. So after every prompt step
    both hold the same tokens at layer 0 (the same multiset of token ids, in every stream),
    whichever copies of a repeated token they kept; deeper layers see different contexts
    from there on."""
    ids = np.asarray(a.prompt_ids)
    assert np.array_equal(ids, b.prompt_ids)
    for t in range(len(ids)):
        ha, hb = a.held(c, t)[0], b.held(c, t)[0]  # (G, t + 1) at layer 0
        for g in range(ha.shape[0]):
            assert sorted(ids[: t + 1][ha[g]]) == sorted(ids[: t + 1][hb[g]]), (t, g)


@pytest.mark.parametrize("granularity", ["layer", "kv-head"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_masked_and_freed_give_the_same_tokens(smollm, granularity, mode):
    cfgs = [LoopConfig("tova", {}, 16), LoopConfig("snapkv", {"recent_window": 4}, 24),
            LoopConfig("h2o", {"recent_window": 4}, 16), LoopConfig("knorm", {}, 24)]
    gens = {ev: generate(PROMPT, cfgs, 8, granularity=granularity, prompt_mode=mode, model=smollm, eviction=ev)
            for ev in ("masked", "freed")}
    # full cache and the attention-based policies: identical; K-norm: up to exact ties
    _same(gens["masked"], gens["freed"], (granularity, mode), rows=range(4))
    _same_up_to_exact_ties(gens["masked"], gens["freed"], 4)
    m, f = gens["masked"].meta, gens["freed"].meta
    assert (m["eviction"], f["eviction"]) == ("masked", "freed")
    # the last token is never fed back: T - 1 positions read. Masked: every row holds them all;
    # freed: the full row holds them, each other row its budget + 1 slots (lanes of 16 and 24)
    n = gens["freed"].prompt_len + 8 - 1
    per_position = m["full_cache_bytes"] // (5 * n)
    assert per_position == 30 * 3 * 64 * 2 * 4  # layers x KV heads x head size x (key, value) x fp32
    assert m["cache_bytes"] == m["full_cache_bytes"] == 5 * n * per_position
    assert f["cache_bytes"] == (n + 2 * 17 + 2 * 25) * per_position
    assert m["policy_bytes"] == f["policy_bytes"] > 0


@pytest.mark.parametrize("length,mode,granularities", [
    (160, "decode", ("kv-head",)), (256, "prefill", ("layer", "kv-head")), (2048, "prefill", ("kv-head",))])
def test_masked_and_freed_agree_on_pass_key_prompts(smollm, length, mode, granularities):
    """Pass-key prompts of 160 (read token by token), 256 and 2,048 tokens, several policies:
    the same tokens, the same evictions, log-probabilities within float rounding. Per KV
    head, the finer of the two granularities, in every mode (the short prompts above take
    both granularities in both modes; the needle command below takes 2,048 tokens per
    layer)."""
    from kvviz.model.needle.prompt import build

    p = build(smollm[0], length, 50, 0)
    cfgs = [LoopConfig("tova", {}, 64), LoopConfig("snapkv", {}, 96), LoopConfig("h2o", {}, 64),
            LoopConfig("streaming-llm", {}, 64)]
    for granularity in granularities:
        gens = {ev: generate(list(p.ids), cfgs, 6, granularity=granularity, prompt_mode=mode, model=smollm,
                             eviction=ev) for ev in ("masked", "freed")}
        _same(gens["masked"], gens["freed"], (length, mode, granularity))
        assert gens["freed"].meta["cache_bytes"] < gens["masked"].meta["cache_bytes"]


def test_loop_masked_and_freed_agree(smollm):
    text = PROMPT * 4
    cfgs = [LoopConfig("tova", {}, 24), LoopConfig("snapkv", {"recent_window": 4}, 24),
            LoopConfig("streaming-llm", {"sinks": 2}, 32)]
    res = {ev: run_loop(text, cfgs, max_tokens=64, model=smollm, eviction=ev) for ev in ("masked", "freed")}
    a, b = res["masked"], res["freed"]
    assert np.array_equal(a.evicted_at, b.evicted_at) and np.array_equal(a.top1, b.top1)
    assert np.abs(a.nll - b.nll).max() < 1e-3 and np.abs(a.kl_tokens - b.kl_tokens).max() < 1e-3
    # the rows the app opens are the same rows: weights by position, 0 on evicted ones
    assert np.abs(a.rows - b.rows).max() < 1e-5
    assert b.meta["cache_bytes"] < a.meta["cache_bytes"]


def test_hf_masked_and_freed_agree_with_and_without_gradients(smollm):
    import torch

    import kvviz.hf

    tok, mdl = smollm
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    outs = {}
    for ev in ("masked", "freed"):
        with torch.no_grad(), kvviz.hf.evicting(mdl, "tova", 12, eviction=ev) as log:
            outs[ev] = (mdl.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist(), log.evicted_at.copy())
    assert outs["masked"][0] == outs["freed"][0]
    assert np.array_equal(outs["masked"][1], outs["freed"][1])
    # a user's own decode loop with gradients on: the policies read detached weights
    with kvviz.hf.evicting(mdl, "tova", 12, eviction="freed") as log:
        out = mdl(ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        mdl(nxt, cache=out.past_key_values, use_cache=True)
    assert log.evicted_at.shape[-1] == ids.shape[1] + 1
    assert (log.held(ids.shape[1]).sum(axis=-1) == 12).all()


# -- the command line ------------------------------------------------------------------

def _cli(capsys, argv):
    from kvviz.__main__ import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_model_load(monkeypatch):
    """A refusal must come before the weights load: loading them fails the test."""
    import kvviz.model.models as M

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(M, "load_model", refuse)


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "The pass key is 42.", "--max-new-tokens", "4", "--policy", "tova", "--budget", "64",
      "--eviction", "freed"],
     "--budget 64 with --eviction freed: the prompt with --max-new-tokens 4 reads {n} positions, so nothing would "
     "be evicted or freed"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "4", "--policy", "tova", "--budget", "8",
      "--device", "cuda"], "--device cuda: no CUDA device here"),
    (["generate", "--prompt-file", "{long}", "--max-new-tokens", "4", "--policy", "tova", "--budget", "8"],
     "more than the model's context of 8192"),
    (["loop", "--text", "{long}", "--max-tokens", "9000", "--policy", "tova", "--budget", "8"],
     "--text {long} needs 9000 positions, more than the model's context of 8192"),
    (["needle", "--out", "{out}", "--lengths", "512", "--policies", "tova", "--budgets", "600",
      "--eviction", "freed", "--max-new-tokens", "4"],
     "--budgets 600 with --eviction freed: the longest prompt (--lengths 512) with its new tokens reads 515 "
     "positions"),
    (["needle", "--out", "{out}", "--lengths", "512", "--policies", "tova", "--budgets", "64",
      "--prefill-chunk", "0"], "--prefill-chunk must be an integer >= 1, got 0"),
])
def test_long_run_refusals_name_the_option_before_the_model_loads(smollm, tmp_path, capsys, no_model_load,
                                                                  argv, needle):
    from kvviz.model.needle.prompt import FILLER

    long = tmp_path / "long.txt"
    long.write_text(FILLER * 800, encoding="utf-8")  # well over 8,192 tokens
    argv = [a.format(long=long, out=tmp_path / "out") for a in argv]
    code, out, err = _cli(capsys, argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    from kvviz.model.models import tokenize

    n = len(tokenize(smollm[0], "The pass key is 42.", 100)[0]) + 4 - 1  # the last new token is never read
    assert needle.format(long=long, n=n) in lines[0], lines[0]


def test_a_2048_token_pass_key_prompt_in_prefill_mode_with_freed_eviction(smollm, tmp_path, capsys):
    """The needle command end to end at 2,048 tokens: the prompt read a block at a time,
    every policy's cache freed to its budget, the mode and the memory recorded."""
    from kvviz.model.needle.results import list_runs, load_run

    runs = {}
    for ev in ("masked", "freed"):
        out = tmp_path / ev
        code, stdout, err = _cli(capsys, ["needle", "--out", str(out), "--lengths", "2048", "--depths", "50",
                                          "--prompt-modes", "prefill", "--policies", "tova",
                                          "streaming-llm:sinks=4", "--budgets", "256", "--eviction", ev, "--quiet"])
        assert code == 0, err
        assert f"eviction: {ev}" in stdout
        (run_id,) = list_runs(out)
        runs[ev] = load_run(out, run_id)
    assert runs["masked"]["meta"]["answers"] == runs["freed"]["meta"]["answers"]
    assert np.array_equal(runs["masked"]["evicted_at"], runs["freed"]["evicted_at"])
    run = runs["freed"]
    meta = run["meta"]
    assert meta["prompt_len"] == 2048 and meta["eviction"] == "freed"
    assert meta["correct"][0], meta["answers"][0]  # the full cache reads the key at 2,048 tokens
    # every evicting row held its budget from the prompt on: 256 of the prompt's positions
    ev = run["evicted_at"]
    for c in (1, 2):
        held = (ev[c, :, :, :2048] == NEVER) | (ev[c, :, :, :2048] > 2047)
        assert (held.sum(axis=-1) == 256).all()
    per_position = 30 * 3 * 64 * 2 * 4  # layers x KV heads x head size x (key, value) x fp32
    n = 2048 + len(run["new_ids"][0][run["new_ids"][0] >= 0]) - 1
    assert meta["full_cache_bytes"] == 3 * n * per_position
    assert meta["cache_bytes"] == (n + 2 * 257) * per_position  # full row, then two rows of budget + 1 slots


def test_gpu_check_runs_its_checks_on_the_cpu(torch_stack):
    """scripts/gpu_check.py, small, on the CPU: the same code a GPU machine runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--quick"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "all checks passed" in proc.stdout
    assert "MISMATCH" not in proc.stdout and "DIFFER" not in proc.stdout
    assert proc.stdout.count("same tokens") == 12  # 3 architectures x 2 eviction modes x 2 prompt modes


@pytest.mark.cuda
def test_gpu_check_on_cuda(torch_stack):
    """The GPU check on a CUDA device, where there is one (scripts/gpu_check.py, small)."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: scripts/gpu_check.py runs this on a GPU machine")
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cuda", "--quick"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
