"""The torch side of generation under eviction: the loop's engine, continuing greedily.

Every config is one batch row of the loop's engine (kvviz.model.loop.engine: the same
attention function, the same `step`, the same policy objects). In prompt mode "decode"
each prompt token is one engine step, as in `run`; in "prefill" the prompt is one forward
pass over the full cache whose rows reach the policies a block of queries at a time
(engine.read_prompt), each policy then evicting once to its budget. Then each row feeds
back its own argmax. `eviction` says whether evicted keys are masked or their memory freed.
"""
from __future__ import annotations

import time

import numpy as np

from kvviz.core.replay import NEVER
from kvviz.model.loop.config import refuse_ratio_freed
from kvviz.model.loop.engine import (
    PREFILL_CHUNK,
    Lane,
    attached,
    check_architecture,
    evicts_by_layer,
    lane_bytes,
    lanes_after_prompt,
    lanes_for,
    make_policies,
    memory,
    read_prompt,
    refuse_uncalibrated,
    slot_cache,
    step,
)
from kvviz.model.loop.generation import Generation, check_request, with_reference


def eos_ids(tok, mdl) -> set[int]:
    """The ids that end a row: the model's generation config's, as HF generate stops on."""
    eos = getattr(getattr(mdl, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tok.eos_token_id
    return set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def greedy_stats(logits):
    """(C, 2) on the device: each row's argmax token and its log-probability (float64)."""
    import torch

    logp = torch.log_softmax(logits.double(), dim=-1)
    best, arg = logp.max(dim=-1)
    return torch.stack([arg.double(), best], 1)


def generate(prompt, configs, max_new_tokens, *, granularity="layer", prompt_mode="decode", model=None,
             progress=None, seed=0, device="cpu", dtype="float32", stop_at_eos=True, eviction="masked",
             prefill_chunk=PREFILL_CHUNK, full_cache=True) -> Generation:
    check_request(prompt, max_new_tokens, granularity, prompt_mode, eviction, prefill_chunk)
    configs = with_reference(configs, full_cache)
    if eviction == "freed":
        refuse_ratio_freed(configs)
    import torch

    from kvviz.model.models import attention_shape, load_model, model_provenance, token_strings, tokenize

    tok, mdl = load_model(model, "generate", device, dtype)
    check_architecture(mdl)
    start = time.perf_counter()
    if isinstance(prompt, str):
        ids, offsets, bos = tokenize(tok, prompt, 1 << 40)
        shown = token_strings(tok, ids, prompt, offsets)
    else:
        ids, bos = [int(i) for i in prompt], None
        shown = token_strings(tok, ids)
    T0, N, C = len(ids), int(max_new_tokens), len(configs)
    if T0 < 1:
        raise ValueError("prompt must tokenise to at least 1 token")
    T = T0 + N
    shape = attention_shape(mdl)
    L, Hk = shape.layers, shape.kv_heads
    G = 1 if granularity == "layer" else Hk
    policies = [make_policies(c, L, G, T, seed, vectorised=prompt_mode == "decode") for c in configs]
    evicted_at = np.full((C, L, G, T), NEVER, np.int64)
    new_ids = np.full((C, N), -1, np.int64)
    logprobs = np.full((C, N), np.nan)
    stopped = ["length"] * C
    active = np.ones(C, bool)
    eos = eos_ids(tok, mdl) if stop_at_eos else set()
    dev = next(mdl.parameters()).device
    model_s = book_s = 0.0
    report = progress or (lambda done, total: None)
    with attached(mdl):
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        t_prompt = time.perf_counter()
        if prompt_mode == "decode":
            refuse_uncalibrated(configs, policies, eviction=eviction)
            lanes = lanes_for(torch, configs, policies, eviction, L, Hk, G, T, dev)
            for t in range(T0):
                host, m, b = step(mdl, lanes, ids_t[t].expand(C), t, configs, policies, evicted_at,
                                  greedy_stats if t == T0 - 1 else None)
                model_s, book_s = model_s + m, book_s + b
                report(t + 1, T)
        else:
            # freed, one configuration, its policy per stream: the layers evict as they are read
            by_layer = eviction == "freed" and evicts_by_layer(policies)
            cache, logits, feed = read_prompt(mdl, torch, ids_t, configs, policies, evicted_at, G, prefill_chunk, dev,
                                              by_layer)
            host = np.repeat(greedy_stats(logits).cpu().numpy(), C, axis=0)
            t1 = time.perf_counter()
            if by_layer:
                st, layers = feed.on_layer.state(policies[0].capacity, T, dev, limit=T)
                st.place(T0)
                lanes = [Lane(np.arange(1), st, slot_cache(st, layers, seen=T0))]
                feed.on_layer = None
            else:
                lanes = lanes_after_prompt(torch, cache, configs, policies, evicted_at, eviction, T, dev)
            del cache
            model_s = t1 - t_prompt - feed.seconds
            book_s = feed.seconds + time.perf_counter() - t1
            report(T0, T)
        t_gen = time.perf_counter()
        prompt_s = t_gen - t_prompt
        for i in range(N):
            chosen = host[:, 0].astype(np.int64)
            for c in np.flatnonzero(active):
                new_ids[c, i], logprobs[c, i] = chosen[c], host[c, 1]
                if chosen[c] in eos:
                    active[c], stopped[c] = False, "eos"
            report(T0 + i + 1, T)
            if i == N - 1 or not active.any():
                break
            # a stopped row keeps decoding its last token, unrecorded and unevicted: rows are independent
            host, m, b = step(mdl, lanes, torch.tensor(chosen, device=dev), T0 + i, configs, policies,
                              evicted_at, greedy_stats, active)
            model_s, book_s = model_s + m, book_s + b
        held_bytes = lane_bytes(lanes, len(configs))  # per configuration
        del lanes
    gen_s = time.perf_counter() - t_gen
    if progress is not None:
        progress(T, T)
    texts = [tok.decode([int(x) for x in row[row >= 0]], skip_special_tokens=True) for row in new_ids]
    pieces = [token_strings(tok, [int(x) for x in row[row >= 0]]) for row in new_ids]
    meta = {**model_provenance(mdl), "bos": bos, "seed": seed, "prompt_mode": prompt_mode,
            "granularity": granularity, "stop_at_eos": bool(stop_at_eos), "eos_ids": sorted(eos),
            "model_seconds": model_s, "bookkeeping_seconds": book_s, "prompt_seconds": prompt_s,
            "generation_seconds": gen_s, "eviction": eviction, "full_cache": bool(full_cache),
            **memory(mdl, configs, policies, evicted_at, held_bytes, T0 + int((new_ids >= 0).sum(axis=1).max()) - 2),
            "seconds": time.perf_counter() - start}
    return Generation(configs=configs, granularity=granularity, prompt_mode=prompt_mode,
                      prompt_ids=np.array(ids, np.int64), tokens=shown, new_ids=new_ids, logprobs=logprobs,
                      texts=texts, stopped=stopped, evicted_at=evicted_at, meta=meta, pieces=pieces)
