"""kvviz.hf.evicting: kvviz's policies inside a plain Hugging Face `generate`.

Shares the session's SmolLM2 (tests/conftest.py); refusals need no model."""
import numpy as np
import pytest

from kvviz.model.loop import LoopConfig, generate

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
N = 8


def _ids(tok):
    import torch

    return torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])


@pytest.mark.parametrize("policy,params,budget,gran", [
    ("tova", {}, 8, "kv-head"),
    ("snapkv", {"obs_window": 4, "recent_window": 2, "pool_kernel": 3}, 8, "layer"),
    ("h2o", {"recent_window": 2}, 10, "kv-head"),
])
def test_greedy_generate_inside_is_kvviz_generate_in_prefill_mode(smollm, policy, params, budget, gran):
    import kvviz.hf

    tok, mdl = smollm
    gen = generate(PROMPT, [LoopConfig(policy, params, budget)], N, granularity=gran, prompt_mode="prefill",
                   model=smollm)
    c = 1 - gen.full_index
    ids = _ids(tok)
    with kvviz.hf.evicting(mdl, policy=policy, budget=budget, granularity=gran, **params) as log:
        out = mdl.generate(ids, max_new_tokens=N, do_sample=False)
    assert mdl.config._attn_implementation == "eager"
    new = out[0, ids.shape[1]:].tolist()
    assert new == gen.generated(c).tolist()
    T0 = gen.prompt_len
    assert log.prompt_len == T0 and log.evicted_at.shape == gen.evicted_at.shape[1:3] + (T0 + N - 1,)
    np.testing.assert_array_equal(log.evicted_at, gen.evicted_at[c, :, :, : T0 + N - 1])
    assert (log.held(T0 + N - 2).sum(axis=-1) == budget).all()


def test_attention_restored_and_hooks_removed_on_error(smollm):
    import kvviz.hf

    tok, mdl = smollm
    with pytest.raises(RuntimeError, match="boom"):
        with kvviz.hf.evicting(mdl, policy="tova", budget=8):
            assert mdl.config._attn_implementation == "kvviz_loop"
            raise RuntimeError("boom")
    assert mdl.config._attn_implementation == "eager"
    assert not mdl._forward_hooks and not mdl._forward_pre_hooks


def test_refuses_a_second_sequence(smollm):
    import kvviz.hf

    tok, mdl = smollm
    ids = _ids(tok)
    with pytest.raises(ValueError, match="open a new block for each generate call"):
        with kvviz.hf.evicting(mdl, policy="tova", budget=8):
            mdl.generate(ids, max_new_tokens=2, do_sample=False)
            mdl.generate(ids, max_new_tokens=2, do_sample=False)
    assert mdl.config._attn_implementation == "eager" and not mdl._forward_hooks


@pytest.mark.parametrize("kwargs,needle", [
    ({"policy": "nosuch"}, "policy must be one of"),
    ({"budget": 0}, "budget must be a positive integer"),
    ({"granularity": "head"}, "granularity must be one of"),
    ({"sinks": 2}, "sinks"),
])
def test_bad_arguments_refused_before_anything_runs(kwargs, needle):
    import kvviz.hf

    args = {"policy": "tova", "budget": 8, **kwargs}
    with pytest.raises(ValueError, match=needle):
        with kvviz.hf.evicting(object(), **args):
            pass
