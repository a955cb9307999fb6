"""Policies that read each query head's row, not only their mean (`reads_query_rows`): the
harness passes them renormalised, the model's loop supplies them in every mode (checked
against the model's own eager attention), a replay refuses them in one line, and `kvviz check`
drives such a policy on synthetic heads."""
from typing import ClassVar

import numpy as np
import pytest
from modelhelp import eager_attentions

from kvviz.core import harness, plugins
from kvviz.core.policies.base import Policy, Rank
from kvviz.core.replay import Replay
from kvviz.core.trace import canonical

PROMPT = ("The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is Berlin. "
          "Our meeting moved to Thursday at noon, in the blue room. The capital of Spain is")


class HeadMax(Policy):
    """The largest weight any query head gave a slot so far; the lowest goes. Records what it
    was given: (layer, head, pos) -> (the mean row, the query heads' rows)."""
    name = "head-max"
    label = "head max"
    rank = Rank("head max", "largest weight from any query head", "lowest goes")
    reads_query_rows = True
    seen: ClassVar[dict] = {}

    def columns(self):
        return {"best": (np.float32, (), 0.0)}

    def advance(self, pos, attn, key_norm=None, value_norm=None, query_rows=None):
        type(self).seen[(self.place.layer, self.place.head, pos)] = (
            None if attn is None else attn.copy(), query_rows.copy())
        if len(query_rows[0]):
            best = self.col("best")
            np.maximum(best, query_rows.max(axis=0), out=best)
        super().advance(pos, attn)

    def observe(self, attn):
        pass

    def priority(self):
        return self.col("best")


@pytest.fixture
def registered():
    plugins.register_policy(HeadMax)
    HeadMax.seen = {}
    yield
    plugins.forget()


def test_the_harness_renormalises_each_head_and_keeps_attn_their_mean_renormalised():
    p = HeadMax(budget=2)
    for t in range(3):
        harness.step(p, t, np.ones(t, np.float32), 2, query_rows=np.ones((2, t), np.float32))
    # step 1: position 0 gets 1 from both heads; step 2: 0 and 1 get 0.5 each, newcomer 2
    # (best 0) goes; so positions 0 and 1 are held at step 3
    assert p.kept.tolist() == [0, 1]
    raw = np.array([[1.0, 3.0], [2.0, 2.0]], np.float32)
    victims = harness.step(p, 3, raw.mean(axis=0), 2, query_rows=raw)
    attn, rows = HeadMax.seen[(None, None, 3)]
    assert rows.tolist() == [[0.25, 0.75], [0.5, 0.5]]  # each head renormalised on its own
    assert attn.tolist() == [0.375, 0.625]  # the mean row [1.5, 2.5], renormalised
    assert p.col("best").tolist() == [1.0, 0.75]  # 0: max(1, 0.25, 0.5); 1: max(0.5, 0.75, 0.5)
    assert victims.tolist() == [3]  # the newcomer, best 0


def test_a_policy_reading_query_rows_is_refused_without_them():
    p = HeadMax(budget=4)
    with pytest.raises(ValueError, match="head-max reads per-query-head rows, and none were given"):
        harness.step(p, 0, np.zeros(0, np.float32), 4)
    with pytest.raises(ValueError, match=r"query_rows must be \(query heads, kept positions\) = \(h, 0\)"):
        harness.step(p, 0, np.zeros(0, np.float32), 4, query_rows=np.zeros((2, 3), np.float32))


def test_a_replay_refuses_it_in_one_line():
    with pytest.raises(ValueError, match="head-max reads per-query-head rows, and trace 'canonical' "
                                         "stores one row per stream: run it in the model loop"):
        Replay(canonical(), HeadMax(budget=64))


def test_kvviz_check_drives_it_on_synthetic_heads():
    from kvviz.core.check import check_contract, check_determinism, check_robustness, passed

    results = check_contract(HeadMax) + check_determinism(HeadMax) + check_robustness(HeadMax)
    assert passed(results), [r for r in results if not r.ok]


def eager_rows(mdl, ids):
    """Per layer, the model's own eager attention of batch row 0: (L, Hq, T, T)."""
    return np.stack([a[0].float().numpy() for a in eager_attentions(mdl, ids)])


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_the_loop_gives_each_stream_its_query_heads_rows(smollm, registered, mode):
    """At a budget above the text's length nothing is evicted, so each stream's rows must be
    the eager forward's rows of its KV head's query heads (every head at layer granularity),
    each renormalised over the earlier positions; and their mean, renormalised, is `attn`."""
    import torch

    from kvviz.model.loop import LoopConfig, generate

    torch.set_num_threads(1)
    tok, mdl = smollm
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    T = len(ids)
    att = eager_rows(mdl, ids)  # (30, 9, T, T)
    for granularity, G in (("kv-head", 3), ("layer", 1)):
        HeadMax.seen = {}
        generate(ids, [LoopConfig("head-max", {}, 200)], 1, granularity=granularity, prompt_mode=mode,
                 model=smollm)
        checked = 0
        for (layer, head, pos), (attn, rows) in HeadMax.seen.items():
            if not 1 <= pos < T:
                continue
            heads = range(9) if G == 1 else range(3 * head, 3 * head + 3)
            want = att[layer, list(heads), pos, :pos].astype(np.float64)
            want /= want.sum(axis=1, keepdims=True)
            np.testing.assert_allclose(rows, want, atol=2e-5, err_msg=f"{layer} {head} {pos}")
            mean = att[layer, list(heads), pos, :pos].astype(np.float64).mean(axis=0)
            np.testing.assert_allclose(attn, mean / mean.sum(), atol=2e-5)
            checked += 1
        assert checked == 30 * G * (T - 1)


def test_masked_and_freed_give_the_same_rows_under_eviction(smollm, registered):
    import torch

    from kvviz.model.loop import LoopConfig, generate

    torch.set_num_threads(1)
    seen = {}
    for ev in ("masked", "freed"):
        HeadMax.seen = {}
        gen = generate(PROMPT, [LoopConfig("head-max", {}, 12)], 4, granularity="kv-head",
                       prompt_mode="decode", model=smollm, eviction=ev)
        seen[ev] = (dict(HeadMax.seen), gen.evicted_at.copy(), gen.texts)
    assert seen["masked"][2] == seen["freed"][2]
    assert np.array_equal(seen["masked"][1], seen["freed"][1])
    assert (seen["masked"][1] >= 0).any()  # something was evicted
    assert seen["masked"][0].keys() == seen["freed"][0].keys()
    for k, (_, rows) in seen["masked"][0].items():
        np.testing.assert_allclose(rows, seen["freed"][0][k][1], atol=1e-5, err_msg=str(k))


def test_kvviz_hf_gives_them_too(smollm, registered):
    import torch

    import kvviz.hf

    torch.set_num_threads(1)
    tok, mdl = smollm
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    HeadMax.seen = {}
    with kvviz.hf.evicting(mdl, "head-max", budget=12, granularity="kv-head"):
        mdl.generate(ids, max_new_tokens=3, do_sample=False)
    T = ids.shape[1]
    decoded = {pos for (_, _, pos) in HeadMax.seen if pos >= T}
    assert decoded == {T, T + 1}
    rows = next(r for (layer, head, pos), (_, r) in HeadMax.seen.items() if pos == T + 1)
    assert rows.shape == (3, 12)  # the KV head's three query heads on its 12 held slots
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-5)
