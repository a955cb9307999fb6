"""A batch of prompts of different lengths through the engine (kvviz.model.loop.batch):
each prompt gets the tokens and the eviction log it gets alone, in both prompt modes and
both eviction modes, on a tiny random-weight model built here (scripts/tiny_model.py)."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from tiny_model import build  # noqa: E402

LENGTHS = (23, 31, 17)  # three prompts, none the longest's length
NEW = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory, torch_stack):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tiny_model import save_tokenizer

    from kvviz.model.models import load_model

    tok_dir = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(tok_dir)
    return load_model(str(build("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=tok_dir)))


def configs():
    from kvviz.model.loop import LoopConfig

    return [LoopConfig("full"), LoopConfig("tova", {}, 8), LoopConfig("h2o", {"recent_window": 4}, 12),
            LoopConfig("snapkv", {"recent_window": 4, "obs_window": 4}, 10), LoopConfig("streaming-llm", {}, 8)]


def prompts():
    rng = np.random.default_rng(0)
    return [[int(x) for x in rng.integers(3, 1000, n)] for n in LENGTHS]


@pytest.mark.parametrize("prompt_mode", ["decode", "prefill"])
@pytest.mark.parametrize("eviction", ["masked", "freed"])
@pytest.mark.parametrize("granularity", ["layer", "kv-head"])
def test_a_batch_of_prompts_gives_each_what_it_gets_alone(pair, prompt_mode, eviction, granularity):
    from kvviz.model.loop import generate
    from kvviz.model.loop.batch import generate_batch

    kw = dict(model=pair, prompt_mode=prompt_mode, eviction=eviction, granularity=granularity, stop_at_eos=False)
    batch = generate_batch(prompts(), configs(), NEW, **kw)
    assert len(batch) == len(LENGTHS)
    for p, got in zip(prompts(), batch):
        alone = generate(p, configs(), NEW, **kw)
        assert got.prompt_ids.tolist() == p and got.labels == alone.labels
        assert np.array_equal(got.new_ids, alone.new_ids)
        assert got.evicted_at.shape == alone.evicted_at.shape == (5, 3, 1 if granularity == "layer" else 2,
                                                                  len(p) + NEW)
        assert np.array_equal(got.evicted_at, alone.evicted_at)
        assert (got.evicted_at[1:] != -1).any(axis=(1, 2, 3)).all()  # every evicting row evicted
        assert np.allclose(got.logprobs, alone.logprobs, atol=1e-4)  # batch-shape rounding only
        assert got.texts == alone.texts and got.meta["batch_prompts"] == 3


@pytest.mark.parametrize("prompt_mode", ["decode", "prefill"])
def test_a_batch_with_allocators_in_freed_slots_gives_each_what_it_gets_alone(pair, prompt_mode):
    """Allocators at kv-head granularity in a freed cache: AdaKV moves slots between a layer's
    KV heads (one pool per layer), PyramidKV gives each layer its own budget (slots per
    layer); each prompt's rows hold their own counts, joined to the most per layer (the
    four-token prompt's run sees 10 positions: fewer slots than PyramidKV's first layer)."""
    from kvviz.model.loop import LoopConfig, generate
    from kvviz.model.loop.batch import generate_batch

    cfgs = [LoopConfig("full"), LoopConfig("adakv", {"scorer": "tova"}, 6),
            LoopConfig("pyramidkv", {"scorer": "tova", "beta": 2}, 8), LoopConfig("tova", {}, 6)]
    kw = dict(model=pair, prompt_mode=prompt_mode, eviction="freed", granularity="kv-head", stop_at_eos=False)
    ps = prompts() + [prompts()[0][:4]]
    batch = generate_batch(ps, cfgs, NEW, **kw)
    for p, got in zip(ps, batch):
        alone = generate(p, cfgs, NEW, **kw)
        assert np.array_equal(got.new_ids, alone.new_ids)
        assert np.array_equal(got.evicted_at, alone.evicted_at)
        assert (got.evicted_at[1:] != -1).any(axis=(1, 2, 3)).all() or len(p) == 4
        held = (got.evicted_at[1, :, :, : len(p)] == -1).sum(axis=-1)  # AdaKV's count per KV head after the prompt
        assert (held.sum(axis=-1) <= 2 * 6).all()
        mem = got.meta["memory_by_config"]
        assert [m["label"] for m in mem] == got.labels
        assert all(m["kv_held_bytes"] > 0 for m in mem)
        assert mem[0]["kv_held_bytes"] > mem[1]["kv_held_bytes"]  # the full row holds the whole prompt


@pytest.mark.parametrize("eviction", ["masked", "freed"])
def test_a_batch_without_the_full_row_gives_each_what_it_gets_alone(pair, eviction):
    """full_cache=False: one evicting configuration per prompt, no reference row; alone, a
    freed prompt is evicted layer by layer while it is read, in the batch after the pass."""
    from kvviz.model.loop import LoopConfig, generate, generate_batch

    cfgs = [LoopConfig("tova", {}, 8)]
    kw = dict(model=pair, prompt_mode="prefill", eviction=eviction, granularity="kv-head", stop_at_eos=False,
              full_cache=False)
    batch = generate_batch(prompts(), cfgs, NEW, **kw)
    for p, got in zip(prompts(), batch):
        alone = generate(p, cfgs, NEW, **kw)
        assert got.labels == alone.labels == ["tova@8"] and got.meta["full_cache"] is False
        assert np.array_equal(got.new_ids, alone.new_ids)
        assert np.array_equal(got.evicted_at, alone.evicted_at) and (got.evicted_at != -1).any()
        assert got.agreement == [None]
    with pytest.raises(ValueError, match="configs must not include 'full'"):
        generate_batch(prompts(), [LoopConfig("full")] + cfgs, NEW, **kw)


def test_rows_stop_at_their_own_eos(pair):
    """A row that meets EOS stops (records nothing more) while the other prompts' rows go on:
    EOS is taken to be the token the full row of the shortest prompt generates second."""
    from kvviz.model.loop import generate
    from kvviz.model.loop.batch import generate_batch

    ps = prompts()
    first = generate(ps[2], configs(), NEW, model=pair, stop_at_eos=False)
    eos = int(first.new_ids[0, 1])
    tok, mdl = pair
    saved = mdl.generation_config.eos_token_id
    mdl.generation_config.eos_token_id = eos
    try:
        batch = generate_batch(ps, configs(), NEW, model=pair)
        for p, got in zip(ps, batch):
            alone = generate(p, configs(), NEW, model=pair)
            assert np.array_equal(got.new_ids, alone.new_ids) and got.stopped == alone.stopped
            assert np.array_equal(got.evicted_at, alone.evicted_at)
    finally:
        mdl.generation_config.eos_token_id = saved
    assert batch[2].stopped[0] == "eos" and batch[2].new_ids[0, 2] == -1


def test_an_empty_batch_is_refused():
    from kvviz.model.loop.batch import generate_batch

    with pytest.raises(ValueError, match="prompts is empty"):
        generate_batch([], configs(), 2)


def test_needle_reads_prompts_in_batches_as_it_reads_them_alone(pair, tmp_path):
    """The grid with --batch 3 writes the runs it writes one prompt at a time: the same
    answers, generated ids and eviction logs (a random policy seeded per prompt included),
    prompts of both prompt modes and two lengths batched apart by mode."""
    from kvviz.model.needle.grid import Grid
    from kvviz.model.needle.results import list_runs, load_run
    from kvviz.model.needle.run import run_grid

    grid = Grid([72, 90], [50], [0, 1], ["tova", "random"], [24], ["decode", "prefill"], ["layer"], 4)
    run_grid(grid, tmp_path / "one", model=pair, progress=False)
    run_grid(grid, tmp_path / "three", model=pair, progress=False, batch=3)
    ids = list_runs(tmp_path / "one")
    assert len(ids) == 8 and list_runs(tmp_path / "three") == ids
    for id_ in ids:
        a, b = load_run(tmp_path / "one", id_), load_run(tmp_path / "three", id_)
        assert a["meta"]["answers"] == b["meta"]["answers"] and a["meta"]["correct"] == b["meta"]["correct"]
        assert np.array_equal(a["new_ids"], b["new_ids"]) and np.array_equal(a["evicted_at"], b["evicted_at"])
        assert "batch_prompts" not in a["meta"]
    # four prompts per prompt mode: a batch of three (the shortest first), then one alone
    sizes = sorted(load_run(tmp_path / "three", i)["meta"].get("batch_prompts", 1) for i in ids)
    assert sizes == [1, 1, 3, 3, 3, 3, 3, 3]
    with pytest.raises(ValueError, match="--batch must be an integer >= 1, got 0"):
        run_grid(grid, tmp_path / "zero", model=pair, progress=False, batch=0)


def test_needle_batches_without_the_full_row(pair, tmp_path):
    """--batch with --no-full-cache: the runs it writes one prompt at a time, none with a
    full-cache row."""
    from kvviz.model.needle.grid import Grid
    from kvviz.model.needle.results import list_runs, load_run
    from kvviz.model.needle.run import run_grid

    grid = Grid([72, 90], [50], [0], ["tova"], [24], ["prefill"], ["kv-head"], 4)
    kw = dict(model=pair, progress=False, eviction="freed", full_cache=False)
    run_grid(grid, tmp_path / "one", **kw)
    run_grid(grid, tmp_path / "two", batch=2, **kw)
    ids = list_runs(tmp_path / "one")
    assert len(ids) == 2 and list_runs(tmp_path / "two") == ids
    for id_ in ids:
        a, b = load_run(tmp_path / "one", id_), load_run(tmp_path / "two", id_)
        assert [c["policy"] for c in b["meta"]["configs"]] == ["tova"] and b["meta"]["full_cache"] is False
        assert a["meta"]["answers"] == b["meta"]["answers"] and b["meta"]["batch_prompts"] == 2
        assert np.array_equal(a["new_ids"], b["new_ids"]) and np.array_equal(a["evicted_at"], b["evicted_at"])


@pytest.mark.parametrize("eviction", ["masked", "freed"])
@pytest.mark.parametrize("policy,params,granularity", [
    ("tova", {}, "kv-head"),
    ("snapkv", {"obs_window": 4, "recent_window": 2, "pool_kernel": 3}, "layer"),
    ("adakv", {"scorer": "tova"}, "kv-head"),
])
def test_hf_generate_on_a_left_padded_batch_is_each_prompt_alone(pair, eviction, policy, params, granularity):
    """kvviz.hf.evicting around plain generate on three left-padded prompts: each row's new
    tokens and eviction log (row(b)) are those of the prompt alone in its own block."""
    import torch

    import kvviz.hf

    _, mdl = pair
    ps, N = prompts(), NEW
    W = max(LENGTHS)
    ids = torch.tensor([[2] * (W - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (W - len(p)) + [1] * len(p) for p in ps])
    kw = dict(policy=policy, budget=8, granularity=granularity, eviction=eviction, **params)
    with kvviz.hf.evicting(mdl, **kw) as log:
        out = mdl.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False, pad_token_id=2)
    assert log.prompt_lens == list(LENGTHS) and log.evicted_at.shape[0] == 3
    for b, p in enumerate(ps):
        with kvviz.hf.evicting(mdl, **kw) as one:
            alone = mdl.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, pad_token_id=2)
        assert out[b, W:].tolist() == alone[0, len(p):].tolist()
        row = log.row(b)
        assert row.prompt_len == len(p) and row.evicted_at.shape == one.evicted_at.shape
        assert np.array_equal(row.evicted_at, one.evicted_at) and (row.evicted_at != -1).any()
    with pytest.raises(ValueError, match="take one row's with row"):
        log.held(3)


def test_hf_refuses_a_mask_not_padded_on_the_left(pair):
    import torch

    import kvviz.hf

    _, mdl = pair
    ids = torch.tensor([prompts()[2][:8], prompts()[2][:8]])
    mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    with pytest.raises(ValueError, match="padded on the left"):
        with kvviz.hf.evicting(mdl, policy="tova", budget=4):
            mdl(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match=r"follows the batch it began with \(2 rows\), got 1"):
        with kvviz.hf.evicting(mdl, policy="tova", budget=4):
            out = mdl(input_ids=ids, use_cache=True)
            mdl(input_ids=ids[:1, :1], cache=out.past_key_values)


TEXTS = ["The committee met at noon; the minutes record that the motion passed. Topological Sorter sorts a graph.",
         "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled",
         "Call me Ishmael. Some years ago, never mind how long"]


@pytest.mark.parametrize("eviction", ["masked", "freed"])
@pytest.mark.parametrize("granularity", ["layer", "kv-head"])
def test_the_loop_reads_a_batch_of_texts_as_each_alone(pair, eviction, granularity):
    """run_loop_batch: three texts of different lengths give the eviction logs, argmax tokens
    and recorded rows each gives alone; the losses within float rounding."""
    from kvviz.model.loop import run_loop, run_loop_batch

    kw = dict(model=pair, eviction=eviction, rows_layers=[0, 2], rows_tokens=20)
    got = run_loop_batch(TEXTS, configs(), granularity, 64, **kw)
    assert len({len(r.tokens) for r in got}) == 3
    for text, b in zip(TEXTS, got):
        a = run_loop(text, configs(), granularity, 64, **kw)
        assert b.tokens == a.tokens and b.evicted_at.shape == a.evicted_at.shape
        assert np.array_equal(b.evicted_at, a.evicted_at) and (b.evicted_at[1:] != -1).any()
        assert np.array_equal(b.top1, a.top1)
        assert np.allclose(b.nll, a.nll, atol=1e-4) and np.allclose(b.kl_tokens, a.kl_tokens, atol=1e-4)
        assert np.allclose(b.rows, a.rows, atol=1e-5) and b.meta["batch_texts"] == 3


def test_a_batch_takes_one_seed_for_all_or_one_per_item():
    from kvviz.model.loop.batch import per_item_seeds

    assert per_item_seeds(7, 3, "prompt") == [7, 7, 7]
    assert per_item_seeds((1, 2, 3), 3, "prompt") == [1, 2, 3]
    with pytest.raises(ValueError, match=r"^seed must be one integer or one per text \(3\), got 2$"):
        per_item_seeds([1, 2], 3, "text")
