"""kvviz's policies in your own Hugging Face code: evict what a policy evicts during `generate`.

    import kvviz.hf
    with kvviz.hf.evicting(model, policy="tova", budget=128, granularity="kv-head") as log:
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    log.evicted_at  # (layers, KV heads, positions): the step each position was evicted, -1 never

It runs the loop's own machinery (kvviz.model.loop.engine): the same registered attention
function adds -inf to each evicted key before the softmax (exactly removal: keys are
cached after RoPE), and the same bookkeeping (kvviz.core.harness through engine.bookkeeping)
steps the same policy objects. By default it masks: the cache still holds every key and
value, so this measures what eviction does to the output, not what it saves; with
`eviction="freed"` the cache's layers are replaced after the prompt by slots that hold only
the kept positions (kvviz.model.loop.engine.slot_cache), so the memory is the budget's.

`generate` reads the prompt in one forward pass, so this is kvviz's prompt_mode="prefill":
the policy observes every prompt row (per layer, or per KV head), evicts once down to its
budget at the end of the prompt, then one step per generated token. Greedy generate inside
the block gives what kvviz.model.loop.generate(..., prompt_mode="prefill") gives for the same
config. One sequence at a time (batch 1), one generate call per block.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvviz.core.replay import NEVER
from kvviz.model.loop.config import GRANULARITIES, PREFILL_CHUNK, LoopConfig, check_eviction


@dataclass
class EvictionLog:
    """What one `evicting` block did: `evicted_at` int64 (L, G, positions seen), the step at
    which each position was evicted (NEVER if never; prompt victims at step prompt_len - 1)."""

    config: LoopConfig
    granularity: str
    prompt_len: int = 0
    evicted_at: np.ndarray | None = None

    def held(self, step: int) -> np.ndarray:
        """bool (L, G, step + 1): the positions held after step `step`'s eviction."""
        if self.evicted_at is None or not 0 <= step < self.evicted_at.shape[-1]:
            raise ValueError(f"step must be a position this block saw, got {step}")
        ev = self.evicted_at[..., : step + 1]
        return (ev == NEVER) | (ev > step)


def _input_ids(args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise ValueError("kvviz.hf.evicting needs input_ids (not inputs_embeds)")
    return ids


def _cache_length(kwargs) -> int | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return None if cache is None else int(cache.get_seq_length())


def full_layers(kwargs) -> dict:
    """The forward's keyword arguments with a cache whose layers keep every position: a
    sliding-window layer (DynamicSlidingWindowLayer, which transformers builds for a
    sliding-window model) drops keys past its window, so a cache index would no longer be
    a position; the window itself is applied by the eviction attention, as the model
    applies it. Given no cache (and use_cache not False), a plain DynamicCache is passed."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        if kwargs.get("use_cache") is False:
            return kwargs
        kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"}
        return {**kwargs, "cache": DynamicCache()}
    layers = getattr(cache, "layers", None) or []
    for i, lay in enumerate(layers):
        if getattr(lay, "is_sliding", False):
            layers[i] = DynamicLayer()
    return kwargs


@contextmanager
def evicting(model, policy: str = "tova", budget: int = 128, granularity: str = "kv-head", seed: int = 0,
             eviction: str = "masked", prefill_chunk: int = PREFILL_CHUNK, **params):
    """Inside the block, `model`'s forward passes evict by `policy` at `budget` (per layer,
    or per layer and KV head); yields the EvictionLog, filled as the model runs. The
    model's attention implementation is restored on exit, error or not.

    `eviction`: "masked" (evicted keys masked, the cache keeps them) or "freed" (after the
    prompt the cache's layers are replaced by fixed slots holding only the kept
    positions: the memory is the budget's). `prefill_chunk`: prompt queries per attention
    block (memory grows with chunk x prompt length, never with its square). Works with
    or without gradients enabled: the bookkeeping runs under no_grad on detached weights,
    and the output keeps its gradients (a freed cache is then written out of place). A
    sliding-window model's window is applied as the model applies it (its sliding cache
    layers are swapped for full ones when the prompt is read). A model kvviz cannot evict
    in (ALiBi, an attention outside AttentionInterface) is refused on entry, in one line."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    check_eviction(eviction)
    cfg = LoopConfig(policy, params, budget)
    import torch

    from kvviz.model.loop.engine import (
        Lane,
        attached,
        bookkeeping,
        gathered,
        make_policies,
        mark_query_rows,
        masked_state,
        prompt_state,
        slot_cache,
        use,
    )
    from kvviz.model.models import attention_shape

    shape = attention_shape(model)
    L, Hk = shape.layers, shape.kv_heads
    G = 1 if granularity == "layer" else Hk
    dev = next(model.parameters()).device
    policies = [make_policies(cfg, L, G, 0, seed, vectorised=False)]
    log = EvictionLog(cfg, granularity, evicted_at=np.full((L, G, 0), NEVER, np.int64))
    evicted = [np.full((1, L, G, 256), NEVER, np.int64)]
    seen = [0]  # positions fed so far
    lane = [None]

    def grow(T):
        if T > evicted[0].shape[-1]:
            grown = np.full((1, L, G, max(2 * evicted[0].shape[-1], T)), NEVER, np.int64)
            grown[..., : evicted[0].shape[-1]] = evicted[0]
            evicted[0] = grown
        lane[0].state.grow(torch, evicted[0].shape[-1])

    def before(module, args, kwargs):
        ids = _input_ids(args, kwargs)
        B, q = ids.shape
        if B != 1:
            raise ValueError(f"kvviz.hf.evicting follows one sequence (batch 1), got batch {B}")
        past = _cache_length(kwargs)
        if past is not None and past != seen[0]:
            raise ValueError("kvviz.hf.evicting follows one sequence: open a new block for each generate call "
                             f"(the cache holds {past} positions, this block has seen {seen[0]})")
        if seen[0] and q != 1:
            raise ValueError(f"kvviz.hf.evicting reads the prompt once, then one token per step; got {q} tokens")
        if not seen[0]:
            lane[0] = Lane(np.zeros(1, np.int64), prompt_state(torch, q, [cfg], policies, L, Hk, G, prefill_chunk,
                                                               dev), None)
            kwargs = full_layers(kwargs)
        else:
            grow(seen[0] + 1)
            if lane[0].state.freed:
                with torch.no_grad():
                    lane[0].state.place(seen[0])
                    lane[0].state.push(torch)
            mark_query_rows(lane[0].state, policies)
        use(model, lane[0].state)
        return args, kwargs

    def after(module, args, kwargs, output):
        with torch.no_grad():  # the bookkeeping reads detached weights, with or without gradients
            _after(args, kwargs, output)

    def _after(args, kwargs, output):
        q = _input_ids(args, kwargs).shape[1]
        if not seen[0]:
            feed = lane[0].state.feed
            grow(q + 1)
            feed.evict([cfg], policies, evicted[0])
            cache = kwargs.get("cache", kwargs.get("past_key_values")) or getattr(output, "past_key_values", None)
            if eviction == "freed":
                if cache is None:
                    raise ValueError("kvviz.hf.evicting with eviction='freed' needs the model's cache (use_cache)")
                st, layers = gathered(torch, cache, evicted[0][..., :q] == NEVER, policies[0].capacity,
                                      evicted[0].shape[-1], dev)
                cache.layers[:] = slot_cache(st, layers, seen=q).layers
            else:
                st = masked_state(torch, evicted[0][..., :q], Hk, evicted[0].shape[-1], dev)
            lane[0] = Lane(np.zeros(1, np.int64), st, cache)
            log.prompt_len = q
        else:
            lane[0].state.pull(torch, None, seen[0])
            bookkeeping(lane[0], [cfg], policies, evicted[0], seen[0])
            lane[0].state.push(torch)
        use(model, None)
        seen[0] += q
        log.evicted_at = evicted[0][0, :, :, : seen[0]].copy()

    with attached(model):
        hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
                 model.register_forward_hook(after, with_kwargs=True)]
        try:
            yield log
        finally:
            for h in hooks:
                h.remove()
