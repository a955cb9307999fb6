"""Policies that see the whole model, in the model's own loop: each stream is told where it
sits (Place), allocators share a layer's slots across its KV heads (masked or freed), and a
policy that keeps more than its budget stops the run with one line naming it."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from kvviz.core import plugins
from kvviz.core.policies import Place, make_policy, register_allocator
from kvviz.core.policies.base import BudgetError
from kvviz.core.policies.tova import Tova
from kvviz.core.replay import NEVER
from kvviz.model.loop import LoopConfig, generate, run_loop
from kvviz.policies import Allocator

PROMPT = ("The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is Berlin. "
          "Our meeting moved to Thursday at noon, in the blue room. The capital of Spain is")


class PlaceRecorder(Tova):
    name = "place-recorder"
    label = "place recorder"
    seen: ClassVar[set] = set()

    def observe(self, attn):
        type(self).seen.add(self.place)
        super().observe(attn)


class KeepsOneMore(Tova):
    name = "keeps-one-more-loop"
    label = "keeps one more"

    def evict(self, budget):
        return super().evict(budget + 1)  # one victim too few


@dataclass
class FirstRowsPlanner(Allocator):
    """Test only: every layer's budget from every layer's first 8 rows: the layer whose
    rows put the most mass outside their 4 newest positions gains budget // 2 per head, the
    one with the least gives them (ties to the lower layer)."""

    name = "first-rows-planner"
    label = "First rows planner"
    plans: ClassVar[list] = []

    def calibration_rows(self):
        return 8

    def plan_layers(self, rows_by_layer):
        stat = [np.mean([r[:-4].sum() / r.sum() for head in rows for r in head if len(r) > 4])
                for rows in rows_by_layer]
        L = len(stat)
        out = [self.budget] * L
        out[max(range(L), key=lambda d: (stat[d], -d))] += self.budget // 2
        out[min(range(L), key=lambda d: (stat[d], d))] -= self.budget // 2
        type(self).plans.append(out)
        return out


@pytest.fixture(autouse=True)
def registered():
    plugins.register_policy(PlaceRecorder)
    plugins.register_policy(KeepsOneMore)
    register_allocator(FirstRowsPlanner)
    FirstRowsPlanner.plans = []
    PlaceRecorder.seen = set()
    yield
    plugins.forget()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_each_stream_is_told_its_layer_and_head_in_the_loop(smollm, mode):
    generate(PROMPT, [LoopConfig("place-recorder", {}, 12)], 2, granularity="kv-head", prompt_mode=mode,
             model=smollm)
    assert PlaceRecorder.seen == {Place(layer, 30, g, 3) for layer in range(30) for g in range(3)}
    PlaceRecorder.seen = set()
    generate(PROMPT, [LoopConfig("place-recorder", {}, 12)], 2, granularity="layer", prompt_mode=mode,
             model=smollm)
    assert PlaceRecorder.seen == {Place(layer, 30, None, None) for layer in range(30)}


def test_each_stream_is_told_its_layer_and_head_in_kvviz_hf(smollm):
    import torch

    import kvviz.hf

    tok, mdl = smollm
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad(), kvviz.hf.evicting(mdl, "place-recorder", 12):
        mdl.generate(ids, max_new_tokens=2, do_sample=False)
    assert PlaceRecorder.seen == {Place(layer, 30, g, 3) for layer in range(30) for g in range(3)}


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_adakv_shares_each_layers_slots_across_its_heads(smollm, mode):
    budget = 12
    cfgs = [LoopConfig("adakv", {"scorer": "tova"}, budget), LoopConfig("tova", {}, budget)]
    gens = {ev: generate(PROMPT, cfgs, 6, granularity="kv-head", prompt_mode=mode, model=smollm, eviction=ev)
            for ev in ("masked", "freed")}
    gen = gens["masked"]
    floor = make_policy("adakv", budget, scorer="tova").floor(budget)  # floor(alpha x budget)
    assert floor == int(0.2 * budget)
    T0, last = gen.prompt_len, gen.prompt_len + 4
    moved = False
    for step in range(T0 - 1, last + 1):
        held = gen.held(1, step).sum(axis=-1)  # (layers, heads)
        assert (held.sum(axis=-1) == 3 * budget).all(), step  # the layer's total, every step
        assert (held >= floor).all(), step
        moved |= bool((held != budget).any())
        assert (gen.held(2, step).sum(axis=-1) == budget).all()  # plain tova: each head its budget
    assert moved  # the budget really moved between heads
    assert np.array_equal(gens["masked"].new_ids, gens["freed"].new_ids)
    assert np.array_equal(gens["masked"].evicted_at, gens["freed"].evicted_at)
    assert gens["freed"].meta["cache_bytes"] < gens["masked"].meta["cache_bytes"]


def test_pyramidkv_gives_each_layer_its_scheduled_budget_in_the_loop(smollm):
    cfg = LoopConfig("pyramidkv", {"scorer": "tova"}, 24)
    gen = generate(PROMPT, [cfg], 2, granularity="kv-head", prompt_mode="prefill", model=smollm)
    schedule = make_policy("pyramidkv", 24, scorer="tova").layer_budgets(30)
    held = gen.held(1, gen.prompt_len - 1).sum(axis=-1)  # (30, 3) after the prompt's eviction
    T0 = gen.prompt_len
    assert held.tolist() == [[min(b, T0)] * 3 for b in schedule]
    assert sum(schedule) == 30 * 24


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a_policy_over_its_budget_stops_the_loop_naming_it(smollm, mode):
    with pytest.raises(BudgetError) as exc:
        generate(PROMPT, [LoopConfig("keeps-one-more-loop", {}, 8)], 4, prompt_mode=mode, model=smollm)
    msg = str(exc.value)
    step = 8 if mode == "decode" else len(smollm[0](PROMPT, add_special_tokens=False)["input_ids"]) - 1
    assert msg.startswith("keeps-one-more-loop@8, layer 0: keeps-one-more-loop held 9 slots"), msg
    assert f"after step {step}, over its budget of 8" in msg
    with pytest.raises(BudgetError, match="keeps-one-more-loop held 9 slots"):
        run_loop(PROMPT, [LoopConfig("keeps-one-more-loop", {}, 8)], model=smollm, max_tokens=20)


class ValueRecorder(Tova):
    name = "value-recorder"
    label = "value recorder"
    reads_value_norms = True
    seen: ClassVar[dict] = {}

    def advance(self, pos, attn, key_norm=None, value_norm=None):
        type(self).seen[(self.place.layer, self.place.head, pos)] = value_norm
        super().advance(pos, attn)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_the_loop_gives_each_stream_its_positions_value_norms(smollm, mode):
    """The L2 norm of each position's cached value, per layer and KV head, as a plain forward
    pass caches it (in decode mode, up to the first eviction: later values depend on it)."""
    import torch
    from transformers import DynamicCache

    plugins.register_policy(ValueRecorder)
    ValueRecorder.seen = {}
    tok, mdl = smollm
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    for ev in ("masked", "freed"):
        generate(ids, [LoopConfig("value-recorder", {}, 12)], 2, granularity="kv-head", prompt_mode=mode,
                 model=smollm, eviction=ev)
    cache = DynamicCache()
    with torch.no_grad():
        mdl(torch.tensor([ids]), cache=cache, use_cache=True)
    upto = len(ids) if mode == "prefill" else 13
    checked = 0
    for (layer, head, pos), got in ValueRecorder.seen.items():
        if pos < upto:
            want = float(cache.layers[layer].values[0, head, pos].norm())
            assert got == pytest.approx(want, rel=1e-4), (layer, head, pos)
            checked += 1
    assert checked == 30 * 3 * upto


def test_head_roles_in_the_loop_keep_the_layers_total_and_need_a_prompt_read_in_one_pass(smollm):
    from pathlib import Path

    prompt = (Path(__file__).resolve().parents[1] / "examples" / "passkey.txt").read_text(encoding="utf-8")
    budget = 40  # 3 x 40 = 120 slots a layer, below the prompt's 126 tokens
    cfg = LoopConfig("headroles", {"scorer": "tova"}, budget)
    roles = make_policy("headroles", budget, scorer="tova")
    streaming = roles.stream_sinks + roles.stream_recent  # what a streaming head keeps
    gens = {ev: generate(prompt, [cfg], 4, granularity="kv-head", prompt_mode="prefill", model=smollm,
                         eviction=ev) for ev in ("masked", "freed")}
    gen = gens["masked"]
    held = gen.held(1, gen.prompt_len - 1).sum(axis=-1)  # (30, 3)
    assert gen.prompt_len > 3 * budget
    assert (held.sum(axis=-1) == 3 * budget).all()
    # per layer, ceil(share x 3) = 2 retrieval heads split the rest; the streaming head keeps its window
    assert all(sorted(row) == [streaming, (3 * budget - streaming) // 2, (3 * budget - streaming) // 2]
               for row in held.tolist())
    assert np.array_equal(gens["masked"].evicted_at, gens["freed"].evicted_at)


def test_head_roles_token_by_token_calibrate_on_the_first_rows_they_see(smollm):
    """Decoding token by token, head roles take their calibration rows from the first rows
    they see: at the step where a layer must first evict (a head holds budget + 1), on
    rows 0..budget, every head's role set before its first victim; masked and freed agree."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "examples" / "passkey.txt").read_text(encoding="utf-8")
    budget = 40
    # the text's first 64 tokens: calibration reads rows 0..budget, and 24 steps evict after it
    prompt = smollm[0](text, add_special_tokens=False)["input_ids"][:64]
    cfg = LoopConfig("headroles", {"scorer": "tova"}, budget)
    roles = make_policy("headroles", budget, scorer="tova")
    streaming = roles.stream_sinks + roles.stream_recent
    gens = {ev: generate(prompt, [cfg], 2, granularity="kv-head", prompt_mode="decode", model=smollm,
                         eviction=ev) for ev in ("masked", "freed")}
    gen = gens["masked"]
    ev = gen.evicted_at[1]
    assert ev[ev != NEVER].min() == budget  # nothing goes before the layer is over its total
    held = gen.held(1, gen.prompt_len - 1).sum(axis=-1)  # (30, 3)
    assert (held.sum(axis=-1) == 3 * budget).all()
    assert all(sorted(row) == [streaming, (3 * budget - streaming) // 2, (3 * budget - streaming) // 2]
               for row in held.tolist())
    assert np.array_equal(gens["masked"].new_ids, gens["freed"].new_ids)
    assert np.array_equal(gens["masked"].evicted_at, gens["freed"].evicted_at)


def test_the_freed_cache_holds_the_same_bytes_for_every_allocator_at_one_budget(smollm):
    """A layer's KV heads draw on one pool of heads x (budget + 1) slots: AdaKV, PyramidKV and
    head roles hold no more keys and values than TOVA at the same budget (within the
    newcomer's slot per layer and KV head), and less than the full cache."""
    from pathlib import Path

    prompt = (Path(__file__).resolve().parents[1] / "examples" / "passkey.txt").read_text(encoding="utf-8")
    budget = 40
    cfgs = [LoopConfig(name, params, budget) for name, params in (
        ("tova", {}), ("adakv", {"scorer": "tova"}), ("pyramidkv", {"scorer": "tova"}),
        ("headroles", {"scorer": "tova"}))]
    gen = generate(prompt, cfgs, 3, granularity="kv-head", prompt_mode="prefill", model=smollm, eviction="freed")
    mem = {r["label"]: r for r in gen.meta["memory_by_config"]}
    item = next(smollm[1].parameters()).element_size()
    slot = 2 * 64 * item  # one position's key and value in one KV head (head_dim 64)
    newcomer = 30 * 3 * slot  # one slot per layer and KV head
    tova = mem[cfgs[0].label]["kv_held_bytes"]
    assert tova == 30 * 3 * (budget + 1) * slot
    for cfg in cfgs[1:]:
        assert abs(mem[cfg.label]["kv_held_bytes"] - tova) <= newcomer, cfg.label
    full = mem["full"]["kv_held_bytes"]
    assert full == mem["full"]["full_cache_bytes"] > tova
    # the allocators really moved slots between heads (and layers) while holding those bytes
    held = gen.held(2, gen.prompt_len - 1).sum(axis=-1)
    assert (held != budget).any() and (held.sum(axis=-1) == 3 * budget).all()
    assert gen.meta["cache_bytes"] == sum(r["kv_held_bytes"] for r in gen.meta["memory_by_config"])


def test_an_allocator_plans_layer_budgets_from_every_layers_prompt_rows_in_the_loop(smollm):
    """`plan_layers` sees every layer's first prompt rows before the prompt's eviction: each
    layer then holds its planned total (the sum kept), masked and freed alike; token by
    token it plans from the first rows it sees (masked), and a freed cache, sized before
    any row is read, refuses it naming the allocator."""
    budget = 12
    cfg = LoopConfig("first-rows-planner", {"scorer": "tova"}, budget)
    gens = {ev: generate(PROMPT, [cfg], 3, granularity="kv-head", prompt_mode="prefill", model=smollm,
                         eviction=ev) for ev in ("masked", "freed")}
    first, second = FirstRowsPlanner.plans
    assert first == second and sum(first) == 30 * budget and first != [budget] * 30
    gen = gens["masked"]
    held = gen.held(1, gen.prompt_len - 1).sum(axis=-1)  # (30, 3) after the prompt's eviction
    assert gen.prompt_len > max(first)  # every layer evicted down to its plan
    assert held.sum(axis=-1).tolist() == [3 * b for b in first]
    assert np.array_equal(gens["masked"].new_ids, gens["freed"].new_ids)
    assert np.array_equal(gens["masked"].evicted_at, gens["freed"].evicted_at)
    FirstRowsPlanner.plans = []
    gen = generate(PROMPT, [cfg], 2, granularity="kv-head", prompt_mode="decode", model=smollm)
    (plan,) = FirstRowsPlanner.plans
    assert sum(plan) == 30 * budget
    held = gen.held(1, gen.prompt_len - 1).sum(axis=-1)
    assert held.sum(axis=-1).tolist() == [3 * b for b in plan]
    with pytest.raises(ValueError, match=r"first-rows-planner \(scorer tova\) sets its layers' budgets from the "
                                         r"first rows it reads \(plan_layers\), and a freed cache read token by "
                                         r"token is sized before any row is read"):
        generate(PROMPT, [cfg], 2, granularity="kv-head", prompt_mode="decode", model=smollm, eviction="freed")
