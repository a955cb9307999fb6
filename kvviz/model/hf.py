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
`eviction="freed"` the cache's layers are replaced by slots that hold only the kept
positions (kvviz.model.loop.engine.slot_cache), so the memory is the budget's. Where each
stream has its own policy (not an allocator) one sequence's prompt is evicted layer by
layer while it is read (engine.LayerEviction: the same victims), so the full keys and
values of at most one layer are ever alive and the peak stays below the full cache's (a
batch of prompts evicts after its pass, each row's slots gathered as alone).

`generate` reads the prompt in one forward pass, so this is kvviz's prompt_mode="prefill":
the policy observes every prompt row (per layer, or per KV head), evicts once down to its
budget at the end of the prompt, then one step per generated token. Greedy generate inside
the block gives what kvviz.model.loop.generate(..., prompt_mode="prefill") gives for the same
config. One generate call per block: one sequence, or a batch of prompts padded on the
left (the tokenizer's padding_side="left", with their attention_mask), each row with its own
policies and eviction state and the tokens and log it gets alone (`log.row(b)`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvviz.core.replay import NEVER
from kvviz.model.loop import engine
from kvviz.model.loop.batch import RowCache, joined_slots, padded_prompt_state
from kvviz.model.loop.cache import slot_plan
from kvviz.model.loop.config import GRANULARITIES, PREFILL_CHUNK, LoopConfig, check_eviction, refuse_ratio_freed


@dataclass
class EvictionLog:
    """What one `evicting` block did: `evicted_at` int64 (L, G, positions seen), the step at
    which each position was evicted (NEVER if never; prompt victims at step prompt_len - 1).

    A batch of B prompts (left-padded): `evicted_at` is (B, L, G, most positions seen), each
    row by its own positions (NEVER past its own), `prompt_lens` each row's prompt length,
    and `row(b)` row b's log alone."""

    config: LoopConfig
    granularity: str
    prompt_len: int = 0
    evicted_at: np.ndarray | None = None
    prompt_lens: list | None = None  # a batch's: each row's prompt length (None: one sequence)

    def held(self, step: int) -> np.ndarray:
        """bool (L, G, step + 1): the positions held after step `step`'s eviction."""
        if self.prompt_lens is not None:
            raise ValueError("this log holds a batch: take one row's with row(b)")
        if self.evicted_at is None or not 0 <= step < self.evicted_at.shape[-1]:
            raise ValueError(f"step must be a position this block saw, got {step}")
        ev = self.evicted_at[..., : step + 1]
        return (ev == NEVER) | (ev > step)

    def row(self, b: int) -> "EvictionLog":
        """Row b of a batch: its own log (its positions only), as a one-sequence block gives it."""
        if self.prompt_lens is None:
            raise ValueError("this log follows one sequence: it has no rows")
        if not 0 <= b < len(self.prompt_lens):
            raise ValueError(f"row must be in 0..{len(self.prompt_lens) - 1}, got {b}")
        seen = self.evicted_at.shape[-1] - (max(self.prompt_lens) - self.prompt_lens[b])
        return EvictionLog(self.config, self.granularity, self.prompt_lens[b], self.evicted_at[b, ..., :seen].copy())


def _padding(mask, B: int, q: int) -> np.ndarray:
    """Each row's left padding (B,), from the prompt's attention_mask (None: none); a mask
    that is not zeros then ones in every row, or a row of padding only, is refused."""
    if mask is None:
        return np.zeros(B, np.int64)
    m = mask.detach().cpu().numpy().astype(bool).reshape(B, q)
    pads = q - m.sum(axis=1)
    ok = all(not m[b, : pads[b]].any() and m[b, pads[b]:].all() for b in range(B))
    if not ok or (pads >= q).any():
        raise ValueError("kvviz.hf.evicting reads a batch padded on the left: each row's attention_mask must be "
                         "zeros, then ones, with at least one token (tokenizer padding_side='left')")
    return pads.astype(np.int64)


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


class Follower:
    """One `evicting` block: follows one sequence, or one batch of left-padded prompts (each
    row its own policies and eviction state), through `model`'s forward passes, over the
    loop engine's public interface (kvviz.model.loop.engine). Its forward pre-hook binds
    the model to the lane the pass runs; its forward hook does that pass's bookkeeping. The
    first pass is the prompt, read in one pass (a PromptFeed per row), after which each row
    evicts once and the cache is masked or gathered to slots; every later pass is one token
    (one engine bookkeeping step). `log` is filled as the model runs.

    A batch's rows keep their cache indices (position + left padding, `State.pad`) in a
    masked cache and their positions in slots; the padding's keys are masked, and the
    attention_mask is then dropped from the forward (the eviction attention masks)."""

    def __init__(self, model, cfg: LoopConfig, granularity: str, seed: int, eviction: str, prefill_chunk: int):
        import torch

        from kvviz.model.models import attention_shape

        shape = attention_shape(model)
        self.torch, self.model, self.cfg, self.seed = torch, model, cfg, seed
        self.eviction, self.chunk = eviction, prefill_chunk
        self.L, self.Hk = shape.layers, shape.kv_heads
        self.G = 1 if granularity == "layer" else self.Hk
        self.device = next(model.parameters()).device
        self.policies = [engine.make_policies(cfg, self.L, self.G, 0, seed, vectorised=False)]
        self.log = EvictionLog(cfg, granularity, evicted_at=np.full((self.L, self.G, 0), NEVER, np.int64))
        self.evicted = np.full((1, self.L, self.G, 256), NEVER, np.int64)  # (B, L, G, room)
        self.pads = np.zeros(1, np.int64)  # each row's left padding
        self.batch = False  # B > 1 or padded: the batch path
        self.seen = 0  # cache positions fed so far (padding included)
        self.lane = None
        self.layered = None  # freed: the prompt's eviction layer by layer (engine.LayerEviction)

    def _room(self, T: int) -> None:
        """Room for T positions in the log."""
        if T > self.evicted.shape[-1]:
            grown = np.full(self.evicted.shape[:-1] + (max(2 * self.evicted.shape[-1], T),), NEVER, np.int64)
            grown[..., : self.evicted.shape[-1]] = self.evicted
            self.evicted = grown

    def _grow(self, T: int) -> None:
        """Room for T positions in the log and the lane's state."""
        self._room(T)
        self.lane.state.grow(self.torch, self.evicted.shape[-1])

    def before(self, module, args, kwargs):
        """The forward pre-hook: check the pass follows the sequence, bind the model's lane."""
        ids = _input_ids(args, kwargs)
        B, q = ids.shape
        if self.seen and B != len(self.pads):
            raise ValueError(f"kvviz.hf.evicting follows the batch it began with ({len(self.pads)} rows), got {B}")
        past = _cache_length(kwargs)
        if past is not None and past != self.seen:
            raise ValueError("kvviz.hf.evicting follows one sequence: open a new block for each generate call "
                             f"(the cache holds {past} positions, this block has seen {self.seen})")
        if self.seen and q != 1:
            raise ValueError(f"kvviz.hf.evicting reads the prompt once, then one token per step; got {q} tokens")
        if not self.seen:
            self.pads = _padding(kwargs.get("attention_mask"), B, q)
            self.batch = B > 1 or bool(self.pads.any())
            if self.batch:
                self._begin_batch(B, q)
            else:
                state = engine.prompt_state(self.torch, q, [self.cfg], self.policies, self.L, self.Hk, self.G,
                                            self.chunk, self.device)
                self.lane = engine.Lane(np.zeros(1, np.int64), state, None)
            kwargs = full_layers(kwargs)
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if (not self.batch and self.eviction == "freed" and cache is not None
                    and engine.evicts_by_layer(self.policies)):
                self._room(q + 1)  # each layer evicts as its rows are read, its cache freed at once
                self.layered = engine.LayerEviction(self.torch, cache, state.feed, [self.cfg], self.policies,
                                                    self.evicted)
        else:
            self._grow(self.seen + 1)
            if self.lane.state.freed:
                with self.torch.no_grad():
                    self.lane.state.place(self.seen - self.pads if self.batch else self.seen)
                    self.lane.state.push(self.torch)
            engine.mark_query_rows(self.lane.state, self.policies)
        if self.batch:
            kwargs = self._positions(kwargs, q)
        engine.use(self.model, self.lane.state)
        return args, kwargs

    def _begin_batch(self, B: int, q: int) -> None:
        """A batch's prompt pass: one policy group, log row and PromptFeed per row; the
        padding's keys masked (finitely, so a padding query's row stays finite:
        kvviz.model.loop.batch.padded_prompt_state)."""
        torch = self.torch
        self.policies = [engine.make_policies(self.cfg, self.L, self.G, 0, self.seed, vectorised=False)
                         for _ in range(B)]
        self.evicted = np.full((B, self.L, self.G, max(256, q + 1)), NEVER, np.int64)
        state = padded_prompt_state(torch, self.pads, q, [self.cfg], self.policies, self.L, self.Hk, self.G,
                                    self.chunk, self.device)
        self.lane = engine.Lane(np.arange(B), state, None)

    def _positions(self, kwargs, q: int) -> dict:
        """A batch's forward: each row's positions (if the caller gave none), no attention_mask
        (the padding is masked by the eviction attention)."""
        kwargs = dict(kwargs, attention_mask=None)
        if kwargs.get("position_ids") is None:
            pos = np.arange(self.seen, self.seen + q)[None, :] - self.pads[:, None]
            kwargs["position_ids"] = self.torch.as_tensor(np.maximum(pos, 0), device=self.device)
        return kwargs

    def after(self, module, args, kwargs, output):
        """The forward hook: the pass's bookkeeping, on detached weights (gradients or not)."""
        with self.torch.no_grad():
            q = _input_ids(args, kwargs).shape[1]
            if not self.seen:
                self._evict_prompt(q, kwargs, output)
            else:
                self._step()
        engine.use(self.model, None)
        self.seen += q
        if self.batch:
            self.log.evicted_at = self.evicted[..., : self.seen - int(self.pads.min())].copy()
        else:
            self.log.evicted_at = self.evicted[0, :, :, : self.seen].copy()

    def _evict_prompt(self, q: int, kwargs, output) -> None:
        """The configuration's one-shot eviction at the prompt's last row, then the lane the
        tokens after it run: the cache masked, or its layers replaced by slots (freed)."""
        torch = self.torch
        self._grow(q + 1)
        cache = kwargs.get("cache", kwargs.get("past_key_values")) or getattr(output, "past_key_values", None)
        if self.layered is not None:  # evicted layer by layer during the pass
            state, layers = self.layered.state(self.policies[0].capacity, self.evicted.shape[-1], self.device)
            cache.layers[:] = engine.slot_cache(state, layers, seen=q).layers
            self.layered = None
            self.lane = engine.Lane(np.zeros(1, np.int64), state, cache)
            self.log.prompt_len = q
            return
        if self.batch:
            for b, _, feed in self.lane.state.feeds:
                feed.evict([self.cfg], [self.policies[b]], self.evicted[b:b + 1])
        else:
            self.lane.state.feed.evict([self.cfg], self.policies, self.evicted)
        lengths = q - self.pads
        room = self.evicted.shape[-1]
        if self.eviction == "freed":
            if cache is None:
                raise ValueError("kvviz.hf.evicting with eviction='freed' needs the model's cache (use_cache)")
            if self.batch:
                parts = [engine.gathered(torch, RowCache(cache, b, int(pad)),
                                         self.evicted[b:b + 1, ..., : lengths[b]] == NEVER,
                                         slot_plan(self.policies[b], self.L), room, self.device)
                         for b, pad in enumerate(self.pads)]
                state, layers = joined_slots(torch, parts, room, self.device)
            else:
                state, layers = engine.gathered(torch, cache, self.evicted[..., :q] == NEVER,
                                                slot_plan(self.policies[0], self.L), room, self.device)
            cache.layers[:] = engine.slot_cache(state, layers, seen=q).layers
        else:
            held = np.full(self.evicted.shape[:-1] + (q,), NEVER, np.int64)  # by cache index
            for b, pad in enumerate(self.pads):
                held[b, ..., :pad] = 0  # the padding: never a key
                held[b, ..., pad:] = self.evicted[b, ..., : lengths[b]]
            state = engine.masked_state(torch, held, self.Hk, room, self.device)
            state.pad[:] = self.pads
        self.lane = engine.Lane(np.arange(len(self.pads)), state, cache)
        self.log.prompt_len = int(lengths.max()) if self.batch else q
        if self.batch:
            self.log.prompt_lens = [int(x) for x in lengths]

    def _step(self) -> None:
        """One generated token: the host copy, each row's step, the bias pushed."""
        state = self.lane.state
        state.pull(self.torch, None, self.seen)
        t = self.seen - self.pads if self.batch else self.seen
        engine.bookkeeping(self.lane, [self.cfg] * len(self.pads), self.policies, self.evicted, t)
        state.push(self.torch)


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
    if eviction == "freed":
        refuse_ratio_freed([budget])
    follower = Follower(model, LoopConfig(policy, params, budget), granularity, seed, eviction, prefill_chunk)
    with engine.attached(model):
        hooks = [model.register_forward_pre_hook(follower.before, with_kwargs=True),
                 model.register_forward_hook(follower.after, with_kwargs=True)]
        try:
            yield follower.log
        finally:
            for h in hooks:
                h.remove()
