"""One configuration at the cost of one: generate and needle without the full-cache row,
and freed eviction that frees each layer's evicted memory while the prompt is read.

Refusals run without the model; the rest share the session's SmolLM2 (tests/conftest.py)."""
import json
import sys

import numpy as np
import pytest

from kvviz.model.loop import LoopConfig, generate, load_generation

PROMPT = ("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid. "
          "The capital of Germany is Berlin. The capital of Portugal is")
SAME_BUDGET = [LoopConfig("tova", {}, 12), LoopConfig("snapkv", {"recent_window": 4}, 12),
               LoopConfig("h2o", {"recent_window": 4}, 12)]


# -- refusals: before anything loads ---------------------------------------------

@pytest.mark.parametrize("configs,full_cache,needle", [
    ([LoopConfig("full"), LoopConfig("tova", {}, 8)], False, "configs must not include 'full'"),
    ([], False, "give at least one evicting configuration"),
    ([LoopConfig("tova", {}, 8)], "no", "full_cache must be True or False, got 'no'"),
])
def test_leaving_the_full_row_out_is_refused_when_it_cannot_be(monkeypatch, configs, full_cache, needle):
    monkeypatch.setitem(sys.modules, "torch", None)  # a refusal must come before torch
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        generate("hello", configs, 4, full_cache=full_cache)


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "hi", "--max-new-tokens", "4", "--policy", "full", "--no-full-cache"],
    ["needle", "--out", "{out}", "--policies", "full", "--no-full-cache"],
])
def test_cli_refuses_no_full_cache_with_only_the_full_cache(tmp_path, monkeypatch, capsys, command):
    from kvviz.__main__ import main

    for name in ("torch", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main([a.format(out=tmp_path / "o") for a in command]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--no-full-cache leaves the full cache out" in lines[0], err
    assert out == ""


# -- with the model ------------------------------------------------------------------

def _same(a, b, rows_a, rows_b):
    """The same evictions and tokens; log-probabilities within float rounding."""
    assert np.array_equal(a.evicted_at[rows_a], b.evicted_at[rows_b])
    assert np.array_equal(a.new_ids[rows_a], b.new_ids[rows_b])
    assert np.abs(a.logprobs[rows_a] - b.logprobs[rows_b]).max() < 1e-3


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("eviction", ["masked", "freed"])
def test_without_the_full_row_each_row_is_what_it_is_beside_it(smollm, mode, eviction):
    cfgs = [LoopConfig("tova", {}, 12), LoopConfig("h2o", {"recent_window": 4}, 16)]
    beside = generate(PROMPT, cfgs, 6, prompt_mode=mode, model=smollm, eviction=eviction)
    alone = generate(PROMPT, cfgs, 6, prompt_mode=mode, model=smollm, eviction=eviction, full_cache=False)
    assert beside.labels == ["full", *alone.labels] and alone.labels == [c.label for c in cfgs]
    _same(beside, alone, [1, 2], [0, 1])
    assert alone.full_index is None and alone.agreement == [None, None] and alone.departure == [None, None]
    assert alone.meta["full_cache"] is False and beside.meta["full_cache"] is True
    # one forward's cache fewer: the full row's keys and values are not held
    assert alone.meta["cache_bytes"] < beside.meta["cache_bytes"]
    assert "|>" not in alone.marked(0) and alone.results[0]["agreement"] is None


def _watch_layers(monkeypatch):
    """Each call of LayerEviction (layer l's rows read): the positions every cache layer
    holds at that moment, recorded after the layer's own eviction."""
    from kvviz.model.loop import prompt

    seen = []
    call = prompt.LayerEviction.__call__

    def watched(self, layer):
        call(self, layer)
        seen.append([lay.keys.shape[2] if getattr(lay, "keys", None) is not None and lay.keys.dim() == 4 else 0
                     for lay in self.cache.layers])

    monkeypatch.setattr(prompt.LayerEviction, "__call__", watched)
    return seen


def _evicted_while_read(seen, T0, budget):
    """Layer by layer: when layer l has been read, layers 0..l hold at most the budget, and
    no later layer holds anything yet; so the full keys of at most one layer were alive."""
    assert len(seen) == 30
    for layer, sizes in enumerate(seen):
        assert all(0 < n <= budget for n in sizes[: layer + 1]), (layer, sizes)
        assert all(n == 0 for n in sizes[layer + 1:]), (layer, sizes)
    assert T0 > 2 * budget


@pytest.mark.parametrize("granularity", ["layer", "kv-head"])
def test_one_freed_configuration_evicts_each_layer_as_it_is_read_and_equals_masked(smollm, monkeypatch,
                                                                                   granularity):
    for cfg in SAME_BUDGET:
        masked = generate(PROMPT, [cfg], 6, granularity=granularity, prompt_mode="prefill", model=smollm,
                          full_cache=False)
        seen = _watch_layers(monkeypatch)
        freed = generate(PROMPT, [cfg], 6, granularity=granularity, prompt_mode="prefill", model=smollm,
                         eviction="freed", full_cache=False)
        _evicted_while_read(seen, freed.prompt_len, 12)
        _same(masked, freed, slice(None), slice(None))
        n = freed.prompt_len + 6 - 1
        per_position = 30 * 3 * 64 * 2 * 4
        assert freed.meta["cache_bytes"] == 13 * per_position and masked.meta["cache_bytes"] == n * per_position
    # two configurations share the prompt's cache: they evict after the whole prompt, as before
    seen = _watch_layers(monkeypatch)
    both = generate(PROMPT, SAME_BUDGET[:2], 6, granularity=granularity, prompt_mode="prefill", model=smollm,
                    eviction="freed", full_cache=False)
    assert seen == [] and both.meta["cache_bytes"] == 2 * 13 * 30 * 3 * 64 * 2 * 4


def test_kvviz_hf_freed_evicts_each_layer_as_it_is_read_and_equals_masked(smollm, monkeypatch):
    import torch

    import kvviz.hf

    tok, mdl = smollm
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    outs = {}
    for ev in ("masked", "freed"):
        seen = _watch_layers(monkeypatch)
        with torch.no_grad(), kvviz.hf.evicting(mdl, "tova", 12, eviction=ev) as log:
            outs[ev] = (mdl.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist(), log.evicted_at.copy())
        assert (len(seen) == 30) == (ev == "freed")
    _evicted_while_read(seen, ids.shape[1], 12)
    assert outs["masked"][0] == outs["freed"][0]
    assert np.array_equal(outs["masked"][1], outs["freed"][1])


def test_generate_cli_without_the_full_row_says_so(smollm, tmp_path, capsys):
    from kvviz.__main__ import main

    out = tmp_path / "g.json"
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--policy", "tova", "--budget", "12",
                 "--prompt-mode", "prefill", "--eviction", "freed", "--no-full-cache", "--json", str(out),
                 "--quiet"]) == 0
    printed = capsys.readouterr().out.splitlines()
    gen = load_generation(out)
    assert gen.labels == ["tova@12"] and gen.meta["full_cache"] is False and gen.agreement == [None]
    assert "full cache: left out (--no-full-cache): no agreement or departure to measure" in printed
    header = next(i for i, line in enumerate(printed) if line.startswith("config") and "agree" in line)
    row = next(line for line in printed[header:] if line.startswith("tova"))  # the side-by-side table's
    assert row.split()[3:5] == ["-", "-"], row  # "tova @ 12", then agreement and departure: none to measure
    assert not any(line.startswith("full cache ") for line in printed)


def test_needle_without_the_full_row_says_so_in_every_run(smollm, tmp_path, capsys):
    from kvviz.__main__ import main
    from kvviz.model.needle.results import list_runs, load_results, load_run

    out = tmp_path / "o"
    assert main(["needle", "--out", str(out), "--lengths", "160", "--depths", "50", "--policies", "tova",
                 "--budgets", "64", "--prompt-modes", "prefill", "--no-full-cache", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "full cache: left out (--no-full-cache)" in printed and "full-cache gate (" not in printed
    assert "1 prompts x 1 configs" in printed
    (run_id,) = list_runs(out)
    meta = load_run(out, run_id)["meta"]
    assert meta["full_cache"] is False and [c["label"] for c in meta["configs"]] == ["tova@64"]
    assert meta["agreement"] == [None]
    df = load_results(out)
    assert list(df["policy"]) == ["tova"] and json.dumps(meta["correct"]) in ("[true]", "[false]")
