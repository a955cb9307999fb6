"""HeadKV (Fu et al. 2024): per-head budgets from a head-score table, a base per head plus a
pool shared by score; within a head its scorer evicts. Expected values are worked by hand in
the comments; `kvviz calibrate headkv` writes the table from pass-key prompts."""
import json

import numpy as np
import pytest

from kvviz.core import harness
from kvviz.core.check_alloc import check_reference
from kvviz.core.layers import load_layers, replay_layers
from kvviz.core.policies import make_policy
from kvviz.core.policies.headkv import HeadKV, default_table, read_table
from kvviz.core.reference_alloc import RefHeadKV


def write_table(path, layers: dict):
    path.write_text(json.dumps({"layers": {str(k): v for k, v in layers.items()}}))
    return str(path)


@pytest.fixture
def table(tmp_path):
    return write_table(tmp_path / "heads.json", {0: [1, 3], 1: [0, 2]})


def test_the_head_budgets_worked_by_hand(table):
    # budget b = 10, window w = 2 (SnapKV's recent window): B' = 8, each head gives
    # floor(8 / 1.005) = floor(7.96) = 7 to the pool and keeps 8 - 7 = 1; pool 2 x 7 = 14.
    # Layer 0, scores 1 and 3: shares 14 x 1/4 = 3.5 and 14 x 3/4 = 10.5 -> 3 and 10, the slot
    # left to the larger fraction (a tie, .5 and .5: the lower head) -> 4 and 10.
    # Head budgets 2 + 1 + 4 = 7 and 2 + 1 + 10 = 13 (sum 20 = 2 x 10).
    alloc = make_policy("headkv", 10, scores=table, window=2)
    assert alloc.group(0, 2, 2).state == [7, 13]
    # Layer 1, scores 0 and 2: shares 0 and 14 -> 3 and 17.
    assert alloc.group(1, 2, 2).state == [3, 17]
    # beta 2: each head gives floor(8 / 2) = 4 and keeps 4; pool 8: layer 0 shares 2 and 6
    # -> 2 + 4 + 2 = 8 and 2 + 4 + 6 = 12.
    assert make_policy("headkv", 10, scores=table, window=2, beta=2.0).group(0, 2, 2).state == [8, 12]
    # temp 2: weights 1 and 9, shares 14 x 1/10 = 1.4 and 12.6 -> 1 and 12, the slot left to
    # head 1 (.6 > .4) -> 1 and 13: budgets 4 and 16.
    assert make_policy("headkv", 10, scores=table, window=2, temp=2.0).group(0, 2, 2).state == [4, 16]


def test_each_head_evicts_to_its_own_budget_by_its_scorer_worked_by_hand(table):
    # scorer TOVA (no recent window: w = 0), budget 3: B' = 3, floor(3 / 1.005) = 2 given,
    # base 1, pool 4; layer 0's scores 1 and 3 share it 1 and 3: head budgets 2 and 4.
    alloc = make_policy("headkv", 3, scores=table, scorer="tova")
    group = alloc.group(0, 2, 2)
    assert group.state == [2, 4]
    rows = {0: [[], [1.0], [0.7, 0.3], [0.4, 0.6], [0.9, 0.1], [0.2, 0.8]],
            1: [[], [1.0], [0.5, 0.5], [0.2, 0.3, 0.5], [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]}
    victims = []
    for t in range(6):
        for g, p in enumerate(group.policies):
            harness.feed(p, t, np.asarray(rows[g][t], np.float32))
        victims.append([v.tolist() for v in harness.evict_layer(group, t)])
    # Head 0 (budget 2), TOVA: the lowest weight on the latest row goes. Step 2 (held 0, 1, 2;
    # row .7 .3 over 0, 1): 1. Step 3 (row .4 .6 over 0, 2): 0. Step 4 (.9 .1 over 2, 3): 3.
    # Step 5 (.2 .8 over 2, 4): 2. Head 1 (budget 4): step 4 (row .1 .2 .3 .4 over 0..3): 0;
    # step 5 (.4 .3 .2 .1 over 1..4): 4.
    assert victims == [[[], []], [[], []], [[1], []], [[0], []], [[3], [0]], [[2], [4]]]
    assert [p.held().tolist() for p in group.policies] == [[4, 5], [1, 2, 3, 5]]


def test_it_matches_its_reference():
    # the check's scenarios draw 1-4 heads over 1-3 layers and keep the shipped table (3 KV
    # heads a layer): the 3-head scenarios run, the others are refused by both
    assert check_reference(HeadKV, RefHeadKV, scenarios=30).passed

    class Wrong(RefHeadKV):  # the pool shared equally: caught
        def budgets(self, layer, b, heads):
            return [b] * heads

    assert not check_reference(HeadKV, Wrong, scenarios=30).passed


def test_the_table_parameter_is_checked_by_name(tmp_path):
    with pytest.raises(ValueError, match="scores: no such file: nope.json"):
        make_policy("headkv", 64, scores="nope.json")
    bad = write_table(tmp_path / "bad.json", {0: [0, 0, 0]})
    with pytest.raises(ValueError, match="layer 0 scores every head 0"):
        make_policy("headkv", 64, scores=bad)
    two = write_table(tmp_path / "two.json", {0: [1, 2]})
    with pytest.raises(ValueError, match="gives layer 0 2 scores, and the layer has 3 KV heads"):
        make_policy("headkv", 64, scores=two).group(0, 30, 3)
    with pytest.raises(ValueError, match="beta"):
        make_policy("headkv", 64, beta=0.5)


def test_the_shipped_table_scores_smollm2s_heads():
    table = read_table(default_table())
    assert sorted(table) == list(range(30)) and all(len(s) == 3 for s in table.values())
    grid = load_layers("traces/code-kv.npz")  # layers 0, 14, 29 x kv0..kv2
    run = replay_layers(grid, make_policy("headkv", 64))
    want = [make_policy("headkv", 64).budgets(layer, 64, 3) for layer in (0, 14, 29)]
    assert [sum(w) for w in want] == [3 * 64] * 3 and any(len(set(w)) > 1 for w in want)
    assert run.held[:, :, -1].tolist() == want  # each head at its own budget at the end


def test_calibrate_writes_a_table_headkv_reads(smollm, tmp_path):
    from kvviz.model.calibrate import head_scores
    from kvviz.model.calibrate import write_table as write

    tok, model = smollm
    scores = head_scores(tok, model, prompts=1, length=96)
    assert len(scores) == 30 and all(len(row) == 3 for row in scores)
    assert all(0 <= s <= 1 for row in scores for s in row) and max(max(row) for row in scores) > 0
    path = write(tmp_path / "h.json", scores, "SmolLM2-135M-Instruct", 1, 96)
    assert read_table(path)[5] == scores[5]
    with pytest.raises(ValueError, match="--prompts must be a positive integer"):
        head_scores(tok, model, prompts=0)


def test_the_model_loop_holds_each_heads_budget(smollm):
    from kvviz.model.loop import LoopConfig, generate

    prompt = ("The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is "
              "Berlin. Our meeting moved to Thursday at noon, in the blue room. The capital of Spain is")
    cfg = LoopConfig("headkv", {"window": 4}, 12)
    gen = generate(prompt, [cfg], 2, granularity="kv-head", prompt_mode="prefill", model=smollm)
    held = gen.held(1, gen.prompt_len - 1).sum(axis=-1)  # (30, 3) after the prompt's eviction
    alloc = make_policy("headkv", 12, window=4)
    want = [[min(b, gen.prompt_len) for b in alloc.budgets(layer, 12, 3)] for layer in range(30)]
    assert held.tolist() == want
