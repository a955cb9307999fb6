"""Generation under eviction (kvviz.model.loop.generate): the loop's engine, continuing greedily.

Refusals run without the model; the rest share the session's SmolLM2 (tests/conftest.py).
"""
import sys

import numpy as np
import pytest

from kvviz.core.replay import NEVER
from kvviz.model.loop import Generation, LoopConfig, generate, load_generation

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
N = 6
WIDE = 64  # more than the prompt and its continuation: nothing is evicted
SNAP = LoopConfig("snapkv", {"obs_window": 4, "recent_window": 2, "pool_kernel": 3}, 8)
CONFIGS = {
    "layer": [LoopConfig("tova", {}, WIDE), LoopConfig("tova", {}, 8), SNAP,
              LoopConfig("h2o", {"recent_window": 2}, 8), LoopConfig("streaming-llm", {"sinks": 2}, 8)],
    "kv-head": [LoopConfig("tova", {}, 8), SNAP, LoopConfig("knorm", {}, 8)],
}


# -- refusals: before anything loads ---------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    ({"prompt": "  \n"}, "prompt is empty"),
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": [1, -3]}, "prompt token ids must be non-negative integers"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 1"),
    ({"prompt_mode": "chunked"}, "prompt_mode must be one of ['decode', 'prefill']"),
    ({"granularity": "head"}, "granularity must be one of"),
])
def test_generate_refuses_before_loading_the_model(monkeypatch, kwargs, needle):
    monkeypatch.setitem(sys.modules, "torch", None)  # a refusal must come before torch
    args = {"prompt": "hello", "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError) as err:
        generate(args.pop("prompt"), [LoopConfig("tova", {}, 8)], args.pop("max_new_tokens"), **args)
    assert needle in str(err.value)


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "   "], "--prompt is empty"),
    (["--prompt-file", "{empty}"], "is empty"),
    (["--prompt", "hi", "--prompt-file", "{empty}"], "not allowed with argument"),
    ([], "--prompt or --prompt-file is required"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--prompt", "hi", "--max-new-tokens", "x"], "--max-new-tokens: invalid int value"),
    (["--prompt", "hi", "--budget", "0"], "--budget must be >= 1, got 0"),
    (["--prompt", "hi", "--policy", "nosuch"], "unknown policy 'nosuch'"),
    (["--prompt", "hi", "--policy", "tova:sinks=2"], "tova has no parameter ['sinks']"),
    (["--prompt", "hi", "--prompt-mode", "chunked"], "--prompt-mode: invalid choice: 'chunked'"),
])
def test_cli_refuses_in_one_line_before_loading_the_model(tmp_path, monkeypatch, capsys, args, needle):
    from kvviz.__main__ import main

    (tmp_path / "empty.txt").write_text(" \n", encoding="utf-8")
    for name in ("torch", "transformers"):  # a refusal must come before either is imported
        monkeypatch.setitem(sys.modules, name, None)
    argv = ["generate", *[a.format(empty=tmp_path / "empty.txt") for a in args]]
    if "--max-new-tokens" not in args:
        argv += ["--max-new-tokens", "4"]
    if "--policy" not in args:
        argv += ["--policy", "tova"]
    if "--budget" not in args:
        argv += ["--budget", "8"]
    with pytest.raises(SystemExit) as stop:
        sys.exit(main(argv))
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert out == ""


def test_budget_refused_by_the_config():
    with pytest.raises(ValueError, match="budget must be a positive integer"):
        LoopConfig("tova", {}, 0)


# -- with the model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def gens(smollm):
    return {(gran, mode): generate(PROMPT, cfgs, N, granularity=gran, prompt_mode=mode, model=smollm)
            for gran, cfgs in CONFIGS.items() for mode in ("decode", "prefill")}


@pytest.fixture(scope="module")
def hf_greedy(smollm):
    import torch

    tok, mdl = smollm
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = mdl.generate(ids, max_new_tokens=N, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_wide_budget_is_plain_greedy_generate(gens, hf_greedy, mode):
    gen = gens[("layer", mode)]
    prompt_ids, expect = hf_greedy
    assert gen.prompt_ids.tolist() == prompt_ids and gen.prompt_len == len(prompt_ids)
    assert len(expect) == N  # no EOS this early: every row runs N tokens
    for c in (0, 1):  # full, tova@64
        assert gen.new_ids[c].tolist() == expect, gen.configs[c].label
        assert (gen.evicted_at[c] == NEVER).all()
        assert gen.stopped[c] == "length" and gen.agreement[c] == 1.0 and gen.departure[c] == -1
    # the log-probabilities are the model's own for those tokens, per row
    assert np.isfinite(gen.logprobs).all() and (gen.logprobs <= 0).all()


def test_rows_record_their_own_tokens_and_evictions(gens):
    gen = gens[("layer", "decode")]
    T0 = gen.prompt_len
    assert gen.evicted_at.shape == (6, 30, 1, T0 + N)
    for c, cfg in enumerate(gen.configs):
        if cfg.is_full or cfg.budget >= T0 + N:
            continue
        for step in (T0 - 1, T0 + N - 2):  # the budget holds after every step, in every layer
            assert (gen.held(c, step).sum(axis=-1) == cfg.budget).all()
        assert (gen.evicted_at[c, ..., -1] == NEVER).all()  # the last token is never fed back
    # agreement and departure say where the row's tokens first differ from the full row's
    for c in range(len(gen.configs)):
        same = gen.new_ids[c] == gen.new_ids[0]
        assert gen.departure[c] == (-1 if same.all() else int(np.flatnonzero(~same)[0]))
        assert gen.agreement[c] == pytest.approx(same.mean())


@pytest.mark.parametrize("gran", ["layer", "kv-head"])
def test_decode_mode_prompt_evictions_are_the_teacher_forced_loop(smollm, gens, gran):
    """Same engine, same batch: over the prompt, generate's evictions are run_loop's."""
    from kvviz.model.loop import run_loop

    gen = gens[(gran, "decode")]
    T0 = gen.prompt_len
    res = run_loop(PROMPT, CONFIGS[gran], granularity=gran, max_tokens=T0, model=smollm, rows_layers=[])
    assert res.token_ids.tolist() == gen.prompt_ids.tolist()
    assert [c.label for c in res.configs] == gen.labels
    prompt_part = gen.evicted_at[..., :T0]
    prompt_part = np.where(prompt_part >= T0, NEVER, prompt_part)  # evicted during generation
    np.testing.assert_array_equal(prompt_part, res.evicted_at)
    assert (res.evicted_at != NEVER).any()


def _prompt_rows(smollm, ids, grouped: bool):
    """Each layer's prompt rows from a plain eager forward (transformers' own attention
    weights), mean over all query heads or over each KV head's group: (L, G, T0, T0)."""
    import torch

    tok, mdl = smollm
    with torch.no_grad():
        out = mdl(input_ids=torch.tensor([list(ids)]), output_attentions=True, use_cache=False)
    rows = []
    for a in out.attentions:  # (1, Hq, T0, T0)
        a = a[0].float()
        Hq, Hk = a.shape[0], mdl.config.num_key_value_heads
        rows.append(a.view(Hk, Hq // Hk, *a.shape[1:]).mean(dim=1) if grouped else a.mean(dim=0, keepdim=True))
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("gran", ["layer", "kv-head"])
def test_prefill_holds_the_policys_one_shot_selection(smollm, gens, gran):
    """A fresh policy per (layer, head) observes every prompt row (harness.feed, no
    eviction), then evicts once to its budget: its held set is what prefill mode holds
    after the prompt. SnapKV's ring then holds exactly the prompt's last obs_window rows."""
    from kvviz.core import harness

    gen = gens[(gran, "prefill")]
    T0 = gen.prompt_len
    rows = _prompt_rows(smollm, gen.prompt_ids, gran == "kv-head")
    checked = 0
    for c, cfg in enumerate(gen.configs):
        if cfg.is_full or cfg.policy not in ("tova", "snapkv", "h2o"):
            continue
        for layer in range(rows.shape[0]):
            for g in range(rows.shape[1]):
                p = cfg.make(layer, g)
                for t in range(T0):
                    harness.feed(p, t, rows[layer, g, t, :t])
                p.evict(cfg.budget)
                held = np.zeros(T0, bool)
                held[p.held()] = True
                np.testing.assert_array_equal(gen.held(c, T0 - 1)[layer, g], held,
                                              err_msg=f"{cfg.label} L{layer} g{g}")
                assert (gen.evicted_at[c, layer, g, :T0][~held] == T0 - 1).all()  # one eviction, at the end
                checked += 1
    assert checked >= 2 * rows.shape[0] * rows.shape[1]


def test_prefill_snapkv_scores_the_last_window_of_queries(smollm, gens):
    """SnapKV after prefill, by its paper's formula rather than the policy object: outside
    the recent window, keep the budget's rest with the highest max-pooled sums over the last
    obs_window queries' renormalised rows."""
    gen = gens[("layer", "prefill")]
    c = gen.labels.index(SNAP.label)
    T0, B, w, r = gen.prompt_len, SNAP.budget, 4, 2
    rows = _prompt_rows(smollm, gen.prompt_ids, False)
    for layer in range(rows.shape[0]):
        sums = np.zeros(T0)
        for t in range(T0 - w, T0):
            row = rows[layer, 0, t, :t].astype(np.float64)
            sums[:t] += (row / row.sum()).astype(np.float32)
        pooled = np.array([sums[max(0, i - 1):i + 2].max() for i in range(T0)])
        gone = np.argsort(pooled[:T0 - r], kind="stable")[:T0 - B]  # ties: the lower position goes
        keep = set(range(T0)) - set(gone.tolist())
        assert set(np.flatnonzero(gen.held(c, T0 - 1)[layer, 0])) == keep, layer


def test_prefill_and_decode_differ_only_by_the_prompt_reading(gens):
    dec, pre = gens[("layer", "decode")], gens[("layer", "prefill")]
    assert dec.prompt_ids.tolist() == pre.prompt_ids.tolist() and dec.labels == pre.labels
    # both read the prompt with the full cache's first token only in prefill: every row starts alike
    assert len(set(pre.new_ids[:, 0].tolist())) == 1
    assert pre.meta["prompt_mode"] == "prefill" and dec.meta["prompt_mode"] == "decode"


def test_save_and_load_round_trip(gens, tmp_path):
    gen = gens[("kv-head", "prefill")]
    path = tmp_path / "g.json"
    gen.save(path)
    back = load_generation(path)
    assert isinstance(back, Generation) and back.labels == gen.labels
    np.testing.assert_array_equal(back.new_ids, gen.new_ids)
    np.testing.assert_array_equal(back.evicted_at, gen.evicted_at)
    np.testing.assert_array_equal(back.logprobs, gen.logprobs)
    assert back.texts == gen.texts and back.agreement == gen.agreement and back.tokens == gen.tokens
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_row_stops_at_eos_and_records_nothing_more(smollm):
    """The full cache answers a chat question and ends with <|im_end|> (the model's EOS,
    measured 2026-12-01: 'The answer is 4.', 7 tokens); the 4-token cache rambles on."""
    tok, _ = smollm
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with one number."}],
                                   tokenize=False, add_generation_prompt=True)
    gen = generate(chat, [LoopConfig("streaming-llm", {"sinks": 1}, 4)], 12, model=smollm, prompt_mode="prefill")
    assert gen.meta["eos_ids"] == [tok.eos_token_id]
    n = len(gen.generated(0))
    assert gen.stopped == ["eos", "length"] and n < 12
    assert gen.new_ids[0, n - 1] == tok.eos_token_id and (gen.new_ids[0, n:] == -1).all()
    assert np.isnan(gen.logprobs[0, n:]).all() and np.isfinite(gen.logprobs[0, :n]).all()
    assert "4" in gen.texts[0] and "<|im_end|>" not in gen.texts[0]
    assert len(gen.generated(1)) == 12 and tok.eos_token_id not in gen.generated(1)
    assert (gen.evicted_at[1] != NEVER).any()


def test_cli_prints_full_first_marks_the_departure_and_writes_json(smollm, tmp_path, capsys):
    from kvviz.__main__ import main

    out = tmp_path / "g.json"
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "6", "--policy", "streaming-llm:sinks=1",
                 "--budget", "4", "--json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out.splitlines()
    gen = load_generation(out)
    assert gen.labels == ["full", "streaming-llm(sinks=1)@4"] and gen.prompt_mode == "decode"
    rows = [line for line in printed if line.startswith(("full ", "streaming-llm"))]
    assert [r.startswith(name) for r, name in zip(rows, ["full cache ", "streaming-llm (sinks=1) @ 4 "])] \
        == [True, True]
    d = gen.departure[1]
    assert d >= 0, printed  # 4 positions decoding the prompt lose the pattern
    assert rows[1].endswith(("".join(gen.pieces[1][:d]) + "|>" + "".join(gen.pieces[1][d:])).replace("\n", "\\n"))
    assert "|>" not in rows[0]
