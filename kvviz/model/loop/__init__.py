"""The model in the loop: a model (SmolLM2 by default) decodes a text over its own evicted cache.

Every other number in kvviz comes from replaying recorded attention, which says what a
policy *covers*. This package measures what eviction *costs*: the model reads a text
token by token (teacher forcing), each layer (or layer x KV head) keeps at most `budget`
positions chosen by the ordinary kvviz policy objects, and the next-token losses are
compared with the full cache.

    from kvviz.model.loop import LoopConfig, run_loop, load_loop_result
    cfgs = [LoopConfig("full"), LoopConfig("snapkv", {"pool_kernel": 5}, 128)]
    res = run_loop(text, cfgs, granularity="kv-head", max_tokens=256)
    res.results[1]["perplexity"]; res.run(1, layer=14, head=2); res.save("x.npz")

`generate` continues a prompt greedily under eviction with the same engine (every config
one batch row; prompt read token by token, "decode", or in one pass, "prefill"):

    gen = generate("The pass key is 60494. ...", cfgs, 16, prompt_mode="prefill")
    gen.texts; gen.departure; gen.held(1, gen.prompt_len - 1); gen.save("g.json")

`generate_batch` runs several prompts of different lengths in one batch (each prompt x
config one row with its own eviction state) and gives each the Generation it gets alone.

torch is imported lazily (by the engine, kvviz/model/loop/engine.py and the modules it uses,
and greedy.py), so this module, the result classes and the CLI's input checks work without it.
"""
from __future__ import annotations

from kvviz.model.loop.config import GRANULARITIES, PREFILL_CHUNK, LoopConfig, check_configs, parse_policy
from kvviz.model.loop.generation import PROMPT_MODES, Generation, load_generation
from kvviz.model.loop.result import LoopResult, load_loop_result

__all__ = ["GRANULARITIES", "PROMPT_MODES", "Generation", "LoopConfig", "LoopResult", "check_configs",
           "generate", "generate_batch", "load_generation", "load_loop_result", "parse_policy", "run_loop",
           "run_loop_batch"]


def run_loop(text: str, configs, granularity: str = "layer", max_tokens: int = 1024,
             progress=None, model=None, rows_layers=None, rows_tokens=None,
             seed: int = 0, device: str = "cpu", dtype: str = "float32", eviction: str = "masked") -> LoopResult:
    """Run every config over `text` as one batch; return a LoopResult.

    - `configs`: LoopConfig list; a `full` (no eviction) row is added first if absent,
      since agreement and KL are measured against it.
    - `granularity`: "layer" (one policy per layer, fed the mean over all query heads)
      or "kv-head" (one per layer and KV head, fed the mean over its query heads).
    - `progress(done, total)` is called after every token.
    - `model`: a (tokenizer, model) pair, or a spec for kvviz.model.models.resolve (a local
      folder, a .gguf file, an installed model's name); None loads SmolLM2 offline.
    - `rows_layers` / `rows_tokens`: which model layers' attention rows to keep (None: the
      model's first, middle and last), and for how many leading tokens (None = all), so
      the app can open the run in its views.
    - `device` ("auto", "cpu", "cuda") and `dtype` (float32; bfloat16 or float16 on CUDA)
      apply when `model` is a spec; a loaded pair runs where it is.
    - `seed`: each policy gets rng default_rng([seed, layer, head]) (only `random` uses it).
    - `eviction`: "masked" (evicted keys masked; every row holds the full cache) or "freed"
      (each row's cache holds only its kept positions, in budget + 1 slots per layer and
      KV head; the full row reads in its own forward). Same tokens either way, within
      float rounding; `meta` says the bytes each held.
    """
    from kvviz.model.loop.engine import run  # torch lives there

    return run(text, configs, granularity=granularity, max_tokens=max_tokens,
               progress=progress, model=model, rows_layers=rows_layers,
               rows_tokens=rows_tokens, seed=seed, device=device, dtype=dtype, eviction=eviction)


def run_loop_batch(texts, configs, granularity: str = "layer", max_tokens: int = 1024, progress=None, model=None,
                   rows_layers=None, rows_tokens=None, seed=0, device: str = "cpu", dtype: str = "float32",
                   eviction: str = "masked") -> list[LoopResult]:
    """`run_loop` for several texts (of any lengths) in one batch: every (text, config) pair
    one row with its own eviction state; one LoopResult per text, in order, with the
    eviction logs, argmax tokens and recorded rows it gets alone (its losses within float
    rounding: the batch's shape changes the sums' order). The arguments are run_loop's;
    `seed` may be one per text."""
    from kvviz.model.loop.batch import run_batch  # torch lives there

    return run_batch(texts, configs, granularity=granularity, max_tokens=max_tokens, progress=progress, model=model,
                     rows_layers=rows_layers, rows_tokens=rows_tokens, seed=seed, device=device, dtype=dtype,
                     eviction=eviction)


def generate(prompt, configs, max_new_tokens, *, granularity="layer", prompt_mode="decode", model=None,
             progress=None, seed=0, device="cpu", dtype="float32", stop_at_eos=True, eviction="masked",
             prefill_chunk=PREFILL_CHUNK, full_cache=True) -> Generation:
    """Greedy continuation of `prompt` under every config at once; a Generation.

    - `prompt`: text (tokenised as the loop does, BOS by the tokenizer's convention) or a
      list of token ids used as they are.
    - `configs`: LoopConfig list; a `full` row is put first if absent (agreement and
      departure are measured against it). Each row continues with its own tokens.
    - `full_cache`: False leaves the full-cache row out (configs then must not include
      `full`): one configuration costs one forward per token; agreement and departure are
      None and `meta["full_cache"]` says so.
    - `prompt_mode`: "decode" (each prompt token is one step of the loop's contract,
      evicting as it goes) or "prefill" (one forward pass over the full cache; each
      policy observes every recorded prompt row, then evicts once to its budget).
    - A row stops at EOS (the model's generation config's, if `stop_at_eos`) or after
      `max_new_tokens`; a stopped row records nothing more.
    - `eviction`: as for run_loop; `prefill_chunk`: prompt queries per attention block in
      prefill mode (memory grows with chunk x prompt length, never with its square).
    - `model`, `device`, `dtype`, `seed`, `granularity`: as for run_loop;
      `progress(done, total)` counts prompt and generated tokens.
    """
    from kvviz.model.loop.greedy import generate as run  # torch lives there (not in a module named generate: importing
    # it would rebind this package's `generate` to the module)

    return run(prompt, configs, max_new_tokens, granularity=granularity, prompt_mode=prompt_mode,
               model=model, progress=progress, seed=seed, device=device, dtype=dtype,
               stop_at_eos=stop_at_eos, eviction=eviction, prefill_chunk=prefill_chunk, full_cache=full_cache)


def generate_batch(prompts, configs, max_new_tokens, *, granularity="layer", prompt_mode="decode", model=None,
                   progress=None, seed=0, device="cpu", dtype="float32", stop_at_eos=True, eviction="masked",
                   prefill_chunk=PREFILL_CHUNK, full_cache=True) -> list[Generation]:
    """`generate` for several prompts (texts or token-id lists, of any lengths) in one batch:
    every (prompt, config) pair is one batch row with its own eviction state, and each
    prompt's Generation holds the tokens and eviction log it gets alone (its log-probabilities
    within float rounding: the batch's shape changes the sums' order). One Generation per
    prompt, in order; the arguments are generate's (kvviz.model.loop.batch says how the
    rows line up)."""
    from kvviz.model.loop.batch import generate_batch as run  # torch lives there

    return run(prompts, configs, max_new_tokens, granularity=granularity, prompt_mode=prompt_mode, model=model,
               progress=progress, seed=seed, device=device, dtype=dtype, stop_at_eos=stop_at_eos,
               eviction=eviction, prefill_chunk=prefill_chunk, full_cache=full_cache)
