"""The torch side of the loop: one batched teacher-forced decode under eviction.

The engine's parts live by job: the cache state and its slots (kvviz.model.loop.cache),
the attention function with Falcon's route (attention), the prompt read in one pass
(prompt) and the policies' bookkeeping (bookkeeping); this module holds the step contract
(`step`: one forward per lane, the host copy, each configuration's bookkeeping) and `run`,
and re-exports the interface the rest of the package uses (`__all__`).
"""
from __future__ import annotations

import time

import numpy as np

from kvviz.core.replay import NEVER
from kvviz.core.trace import packed_offset
from kvviz.model.loop.attention import (
    ALIBI,
    ATTN_NAME,
    attached,
    attention,
    bind,
    check_architecture,
    falcon_forward,
    interface_settable,
    no_mask,
    register,
    routed,
    use,
)
from kvviz.model.loop.bookkeeping import (
    READ_IN_ONE_PASS,
    LaneInputs,
    bookkeeping,
    make_policies,
    mark_query_rows,
    mark_victims,
    memory,
    reads_query_rows,
    refuse_uncalibrated,
)
from kvviz.model.loop.cache import (
    Lane,
    State,
    by_budget,
    cache_bytes,
    gathered,
    lane_bytes,
    lanes_after_prompt,
    lanes_for,
    masked_state,
    slot_cache,
    slot_layer_class,
)
from kvviz.model.loop.config import GRANULARITIES, PREFILL_CHUNK, check_configs, check_eviction, refuse_ratio_freed
from kvviz.model.loop.prompt import LayerEviction, PromptFeed, evicts_by_layer, prompt_state, read_prompt
from kvviz.model.loop.result import LoopResult

__all__ = ["ALIBI", "ATTN_NAME", "LayerEviction", "MOVED", "PREFILL_CHUNK", "READ_IN_ONE_PASS", "Lane", "LaneInputs",
           "PromptFeed", "State", "attached", "attention", "bind", "bookkeeping", "by_budget", "cache_bytes",
           "check_architecture", "check_inputs", "evicts_by_layer", "falcon_forward", "gathered", "interface_settable",
           "lanes_after_prompt", "lanes_for", "make_policies", "mark_query_rows", "mark_victims", "masked_state",
           "memory", "no_mask", "prompt_state", "read_prompt", "reads_query_rows", "refuse_uncalibrated", "register",
           "routed", "run", "slot_cache", "slot_layer_class", "step", "tokenize", "use"]


MOVED = [0]  # bytes brought from the device to the host by `step`, since the process started


def tokenize(tok, text: str, max_tokens: int) -> list[int]:
    """As kvviz.model.capture does (kvviz.model.models.tokenize): BOS as the tokenizer's convention says."""
    from kvviz.model.models import tokenize as tokens

    return tokens(tok, text, max_tokens)[0]


def check_inputs(text, granularity, max_tokens, eviction="masked") -> None:
    check_eviction(eviction)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text is empty: give the loop something to read")
    if isinstance(max_tokens, bool) or int(max_tokens) != max_tokens or max_tokens < 2:
        raise ValueError(f"max_tokens must be an integer >= 2, got {max_tokens!r}")


def step(mdl, lanes, ids, t, configs, policies, evicted_at, stats=None, active=None) -> tuple:
    """The step contract, shared by `run` and generation: one forward per lane of token
    `ids` (C,) at position t through the eviction attention, `stats(logits (C, V))` on the
    device, each lane's one host copy, each active config's bookkeeping, the bias pushed.
    `t` is one position for every row, or one per row (C,) (a batch of prompts whose rows
    stand at different positions; a masked lane's rows then carry their left padding in
    `State.pad`). Returns (host stats or None, model seconds, bookkeeping seconds)."""
    import torch

    C = ids.shape[0]
    rows_t = None if np.ndim(t) == 0 else np.asarray(t, np.int64)
    t0 = time.perf_counter()
    for lane in lanes:
        mark_query_rows(lane.state, policies)
    with torch.no_grad():
        logits = None
        for lane in lanes:
            n = len(lane.index)
            use(mdl, lane.state)
            pos = (torch.full((n, 1), t, dtype=torch.long, device=ids.device) if rows_t is None else
                   torch.as_tensor(rows_t[lane.index], device=ids.device).reshape(n, 1))
            out = mdl(input_ids=ids[lane.index].reshape(n, 1) if len(lanes) > 1 else ids.reshape(C, 1),
                      position_ids=pos, cache=lane.cache, use_cache=True)
            last = out.logits[:, -1]
            if len(lanes) == 1:
                logits = last
            else:
                if logits is None:
                    logits = last.new_empty(C, last.shape[-1])
                logits[torch.as_tensor(lane.index, device=last.device)] = last
            del out
        use(mdl, None)
        s = None if stats is None else stats(logits)
        host = lanes[0].state.pull(torch, s, _index(lanes[0], t, rows_t))
        for lane in lanes[1:]:
            lane.state.pull(torch, None, _index(lane, t, rows_t))
        moved = sum(lane.state.moved for lane in lanes)
    t1 = time.perf_counter()
    MOVED[0] += moved
    for lane in lanes:
        bookkeeping(lane, configs, policies, evicted_at, t, active)
        if lane.state.freed and (t if rows_t is None else rows_t[lane.index].min()) + 1 < lane.state.T:
            lane.state.place(t + 1 if rows_t is None else rows_t[lane.index] + 1,
                             None if active is None else active[lane.index])
        lane.state.push(torch)
    return host, t1 - t0, time.perf_counter() - t1


def _index(lane, t, rows_t) -> int:
    """The last cache index this step wrote in `lane` (its rows' positions plus their padding)."""
    return t if rows_t is None else int((rows_t[lane.index] + lane.state.pad).max())


def run(text, configs, granularity="layer", max_tokens=1024, progress=None, model=None,
        rows_layers=None, rows_tokens=None, seed=0, timings=None, device="cpu",
        dtype="float32", eviction="masked") -> LoopResult:
    check_inputs(text, granularity, max_tokens, eviction)
    configs = check_configs(configs)
    if eviction == "freed":
        refuse_ratio_freed(configs)
    import torch

    from kvviz.model.models import (
        attention_shape,
        check_layers,
        default_layers,
        load_model,
        model_provenance,
        token_strings,
    )
    from kvviz.model.models import tokenize as tokens

    tok, mdl = load_model(model, "loop", device, dtype)
    check_architecture(mdl)
    ids, offsets, bos = tokens(tok, text, int(max_tokens))
    T = len(ids)
    if T < 2:
        raise ValueError("text must tokenise to at least 2 tokens")
    shape = attention_shape(mdl)
    L, Hk = shape.layers, shape.kv_heads
    G = 1 if granularity == "layer" else Hk
    rows_layers = default_layers(L) if rows_layers is None else check_layers(rows_layers, L, "rows_layers")
    Tr = T if rows_tokens is None else max(0, min(int(rows_tokens), T))
    C = len(configs)
    policies = [make_policies(c, L, G, T, seed) for c in configs]
    evicted_at = np.full((C, L, G, T), NEVER, np.int64)
    rows = np.zeros((C, len(rows_layers), G, packed_offset(Tr)), np.float32) if rows_layers else None
    nll = np.zeros((C, T - 1))
    p_true = np.zeros((C, T - 1))
    kl = np.zeros((C, T - 1))
    top1 = np.zeros((C, T - 1), np.int64)
    f = next(i for i, c in enumerate(configs) if c.is_full)
    model_s = np.zeros(T)
    book_s = np.zeros(T)
    device = next(mdl.parameters()).device
    refuse_uncalibrated(configs, policies, "loop", eviction)
    with attached(mdl):
        lanes = lanes_for(torch, configs, policies, eviction, L, Hk, G, T, device)
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        for t in range(T):
            def stats(logits, t=t):  # (C, 3): nll, argmax, KL(full || config), on the device
                logp = torch.log_softmax(logits.double(), dim=-1)
                return torch.stack([-logp[:, ids[t + 1]], logp.argmax(dim=-1).double(),
                                    (logp[f].exp() * (logp[f] - logp)).sum(dim=-1).clamp_min(0)], 1)

            host, model_s[t], book_s[t] = step(mdl, lanes, ids_t[t].expand(C), t, configs, policies,
                                               evicted_at, stats if t < T - 1 else None)
            if host is not None:
                nll[:, t], top1[:, t], kl[:, t] = host[:, 0], host[:, 1].astype(np.int64), host[:, 2]
            if t < Tr and rows is not None:  # `cur` is still step t's: the bookkeeping reads it only
                off = packed_offset(t)
                for lane in lanes:
                    rows[lane.index, :, :, off:off + t] = lane.state.cur[:, rows_layers, :, :t]
            if progress is not None:
                progress(t + 1, T)
        held_bytes = lane_bytes(lanes, len(configs))  # per configuration
    np.exp(-nll, out=p_true)
    if timings is not None:
        timings.update(model=model_s, bookkeeping=book_s)
    return LoopResult(configs=configs, granularity=granularity, tokens=token_strings(tok, ids, text, offsets),
                      token_ids=np.array(ids, np.int64), nll=nll, p_true=p_true, kl_tokens=kl, top1=top1,
                      evicted_at=evicted_at, layers=list(range(L)), rows=rows, rows_layers=rows_layers,
                      rows_tokens=Tr,
                      meta={"model_seconds": float(model_s.sum()), "bookkeeping_seconds": float(book_s.sum()),
                            "seed": seed, "bos": bos, "eviction": eviction,
                            **memory(mdl, configs, policies, evicted_at, held_bytes, T - 1),
                            **model_provenance(mdl)})
