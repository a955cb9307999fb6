"""headroles with a role table (`roleTable`), and `kvviz calibrate headroles`, which writes
one from pass-key prompts kvviz builds."""
import json

import numpy as np
import pytest

from kvviz.core.layers import load_layers, replay_layers
from kvviz.core.policies import make_policy
from kvviz.core.policies.headroles import read_roles


def _table(path, layers: dict):
    path.write_text(json.dumps({"layers": {str(k): v for k, v in layers.items()}}))
    return str(path)


def test_the_table_sets_each_layers_roles_before_the_first_step(tmp_path):
    table = _table(tmp_path / "r.json", {0: [0.1, 0.9, 0.5], 14: [0.7, 0.2, 0.1], 29: [0.0, 0.0, 0.3]})
    grid = load_layers("traces/code-kv.npz")  # layers 0, 14, 29 x kv0..kv2, 512 steps
    alloc = make_policy("headroles", 64, role_table=table, share=0.34)  # ceil(0.34 x 3) = 2 retrieve
    assert alloc.calibration_rows() == 0  # nothing read from the run
    run = replay_layers(grid, alloc)
    # the two largest proxies retrieve (ties: the lower head), worked from the table by hand
    assert [s.retrieval for s in run.states] == [(False, True, True), (True, True, False), (True, False, True)]
    # a streaming head keeps its 4 sinks and its 28 newest; the two retrieval heads share the rest
    T = grid[0][0].steps
    for d, state in enumerate(run.states):
        for g, retrieves in enumerate(state.retrieval):
            held = run.runs[d][g].held_at(T - 1)
            if retrieves:
                assert len(held) == (3 * 64 - 32) // 2
            else:
                assert held.tolist() == [0, 1, 2, 3, *range(T - 28, T)]


def test_the_table_is_checked_by_name(tmp_path):
    with pytest.raises(ValueError, match="role_table must be empty, or a path .*no such file: nope.json"):
        make_policy("headroles", 64, role_table="nope.json")
    bad = _table(tmp_path / "bad.json", {0: [0.5, 1.5, 0.1]})
    with pytest.raises(ValueError, match=r"layer 0 must give a list of shares in 0\.\.1"):
        make_policy("headroles", 64, role_table=bad)
    two = _table(tmp_path / "two.json", {0: [0.5, 0.1]})
    with pytest.raises(ValueError, match="gives layer 0 2 heads, and this layer has 3 KV heads"):
        make_policy("headroles", 64, role_table=two).group(0, 30, 3)
    with pytest.raises(ValueError, match=r"has no layer 5 \(it gives layers \[0\]\)"):
        make_policy("headroles", 64, role_table=two).group(5, 30, 3)


def test_the_shipped_table_gives_smollm2s_heads_and_runs():
    table = read_roles("traces/heads/headroles-smollm2.json")
    assert sorted(table) == list(range(30)) and all(len(row) == 3 for row in table.values())
    grid = load_layers("traces/code-kv.npz")
    run = replay_layers(grid, make_policy("headroles", 64, role_table="traces/heads/headroles-smollm2.json"))
    for d, layer in enumerate((0, 14, 29)):  # share 0.5 of 3 heads: the two largest retrieve
        top = sorted(range(3), key=lambda g: (-table[layer][g], g))[:2]
        assert [g for g, r in enumerate(run.states[d].retrieval) if r] == sorted(top)


# -- the calibration, on a tiny random-weight Llama --------------------------------------

def test_calibrate_headroles_is_the_share_outside_sinks_and_window_at_the_answer(tiny_llama, tmp_path,
                                                                                torch_stack):
    import torch

    from kvviz.model.calibrate import streaming_loss, write_roles
    from kvviz.model.models import attention_shape
    from kvviz.model.needle.prompt import build

    tok, mdl = tiny_llama
    sinks, recent, length = 2, 5, 96
    got = streaming_loss(tok, mdl, prompts=1, length=length, sinks=sinks, recent=recent)
    shape = attention_shape(mdl)
    assert len(got) == shape.layers and all(len(row) == shape.kv_heads for row in got)
    # the rule written out, in Python floats, from one eager pass over the same tokens
    prompt = build(tok, length, 50.0, 0)
    answer = tok.encode(" " + prompt.key, add_special_tokens=False)
    ids = list(prompt.ids) + list(answer)
    mdl.set_attn_implementation("eager")
    with torch.no_grad():
        attn = mdl(torch.tensor([ids]), output_attentions=True).attentions
    group = shape.heads // shape.kv_heads
    for layer in range(shape.layers):
        for kv in range(shape.kv_heads):
            shares = []
            for h in range(kv * group, (kv + 1) * group):
                for q in range(len(prompt.ids) - 1, len(ids) - 1):
                    row = [float(x) for x in attn[layer][0, h, q, : q + 1]]
                    shares.append(sum(row[sinks: q + 1 - recent]) / sum(row))
            assert got[layer][kv] == pytest.approx(sum(shares) / len(shares), abs=2e-6)
    path = write_roles(tmp_path / "r.json", got, "tiny", 1, length, sinks, recent)
    assert read_roles(path)[0] == got[0]
    alloc = make_policy("headroles", 64, role_table=str(path))
    group = alloc.group(0, shape.layers, shape.kv_heads)
    want = sorted(range(shape.kv_heads), key=lambda g: (-got[0][g], g))[: alloc.retrieval_count(shape.kv_heads)]
    assert [g for g, r in enumerate(group.state.retrieval) if r] == sorted(want)
    with pytest.raises(ValueError, match="--stream-recent must be an integer >= 1"):
        streaming_loss(tok, mdl, prompts=1, length=length, sinks=2, recent=0)
    np.testing.assert_array_equal(np.isfinite(np.array(got)), True)
