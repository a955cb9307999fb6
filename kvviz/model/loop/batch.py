"""A batch of prompts through the engine: `generate_batch` continues several prompts of
different lengths at once, each (prompt, configuration) pair one batch row with its own
eviction state, and gives each prompt the Generation that `generate` gives it alone.

How the rows line up:
- "decode": no padding. Every row reads position t at step t: its prompt's token while its
  prompt lasts, then its own argmax. A row whose prompt is shorter starts generating
  earlier; a row that is done (EOS, or its new tokens counted) rides along unrecorded and
  unevicted, as a stopped row does in `generate`.
- "prefill": the prompts are read in one pass, left-padded to the longest (`read_prompts`:
  the padding's keys take no weight, each prompt's rows go to its own PromptFeed), and
  every configuration evicts once; then the rows continue together, each at its own
  position (engine.step with one position per row). Masked rows share the prompts' cache,
  each prompt's row repeated per config: a row's cache index is its position plus its
  padding (State.pad), and the padding's keys are masked. Freed rows hold their kept
  positions in slots (positions are explicit there): each prompt's rows are gathered to
  slots as alone, then joined.
"""
from __future__ import annotations

import time

import numpy as np

from kvviz.core.replay import NEVER
from kvviz.model.loop.config import PREFILL_CHUNK, check_configs, refuse_ratio_freed
from kvviz.model.loop.generation import Generation, check_request, with_reference


def per_item_seeds(seed, n: int, item: str) -> list[int]:
    """One seed per batch item: `seed` is one integer for all `n`, or a sequence of `n`
    (ValueError naming `seed` otherwise)."""
    seeds = [int(x) for x in seed] if isinstance(seed, (list, tuple, np.ndarray)) else [int(seed)] * n
    if len(seeds) != n:
        raise ValueError(f"seed must be one integer or one per {item} ({n}), got {len(seeds)}")
    return seeds


def _tokens(tok, prompt):
    from kvviz.model.models import token_strings, tokenize

    if isinstance(prompt, str):
        ids, offsets, bos = tokenize(tok, prompt, 1 << 40)
        return ids, token_strings(tok, ids, prompt, offsets), bos
    ids = [int(i) for i in prompt]
    return ids, token_strings(tok, ids), None


def generate_batch(prompts, configs, max_new_tokens, *, granularity="layer", prompt_mode="decode", model=None,
                   progress=None, seed=0, device="cpu", dtype="float32", stop_at_eos=True, eviction="masked",
                   prefill_chunk=PREFILL_CHUNK, full_cache=True) -> list[Generation]:
    """Greedy continuations of every prompt in `prompts` (texts or token-id lists) under every
    config, all in one batch: one Generation per prompt, in order, each what
    kvviz.model.loop.generate gives that prompt alone (the same arguments). `progress(done,
    total)` counts steps. `seed`: one for every prompt, or one per prompt (each prompt's
    policies seeded as generate seeds them)."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    seeds = per_item_seeds(seed, len(prompts), "prompt")
    for p in prompts:
        check_request(p, max_new_tokens, granularity, prompt_mode, eviction, prefill_chunk)
    configs = with_reference(configs, full_cache)
    if eviction == "freed":
        refuse_ratio_freed(configs)
    import torch

    from kvviz.model.loop.engine import (
        attached,
        check_architecture,
        lane_bytes,
        lanes_for,
        make_policies,
        memory,
        refuse_uncalibrated,
        step,
    )
    from kvviz.model.loop.greedy import eos_ids, greedy_stats
    from kvviz.model.models import attention_shape, load_model, model_provenance, token_strings

    tok, mdl = load_model(model, "generate", device, dtype)
    check_architecture(mdl)
    start = time.perf_counter()
    read = [_tokens(tok, p) for p in prompts]
    if any(len(ids) < 1 for ids, _, _ in read):
        raise ValueError("prompt must tokenise to at least 1 token")
    P, C, N = len(prompts), len(configs), int(max_new_tokens)
    T0 = np.array([len(ids) for ids, _, _ in read], np.int64)
    T = int(T0.max()) + N
    shape = attention_shape(mdl)
    L, Hk = shape.layers, shape.kv_heads
    G = 1 if granularity == "layer" else Hk
    R = P * C  # row r = prompt r // C, config r % C
    of = np.repeat(np.arange(P), C)
    start_t = T0[of]  # each row's prompt length: its first generated position
    rows_cfg = [configs[r % C] for r in range(R)]
    policies = [make_policies(rows_cfg[r], L, G, T, seeds[of[r]], vectorised=prompt_mode == "decode")
                for r in range(R)]
    evicted_at = np.full((R, L, G, T), NEVER, np.int64)
    new_ids = np.full((R, N), -1, np.int64)
    logprobs = np.full((R, N), np.nan)
    stopped = ["length"] * R
    count = np.zeros(R, np.int64)  # tokens each row recorded
    done = np.zeros(R, bool)  # stopped at EOS, or its N tokens recorded
    eos = eos_ids(tok, mdl) if stop_at_eos else set()
    dev = next(mdl.parameters()).device
    report = progress or (lambda done_, total: None)

    def record(host, rows) -> None:
        for r in rows:
            new_ids[r, count[r]], logprobs[r, count[r]] = int(host[r, 0]), host[r, 1]
            count[r] += 1
            if int(host[r, 0]) in eos:
                done[r], stopped[r] = True, "eos"
            elif count[r] == N:
                done[r] = True

    with attached(mdl):
        if prompt_mode == "decode":
            refuse_uncalibrated(rows_cfg, policies)
            lanes = lanes_for(torch, rows_cfg, policies, eviction, L, Hk, G, T, dev)
            ids = np.zeros((P, int(T0.max())), np.int64)
            for p, (pid, _, _) in enumerate(read):
                ids[p, : len(pid)] = pid
            chosen = np.zeros(R, np.int64)
            last = int((start_t + N - 2).max(initial=0))
            last = max(last, int(T0.max()) - 1)
            for t in range(last + 1):
                in_prompt = t < start_t
                feed = np.where(in_prompt, ids[of, np.minimum(t, start_t - 1)], chosen)
                live = in_prompt | ~done
                recording = (t >= start_t - 1) & ~done
                host, _, _ = step(mdl, lanes, torch.as_tensor(feed, device=dev), t, rows_cfg, policies, evicted_at,
                                  greedy_stats if recording.any() else None, None if live.all() else live)
                if recording.any():
                    chosen = np.where(recording, host[:, 0].astype(np.int64), chosen)
                    record(host, np.flatnonzero(recording))
                report(t + 1, last + 1)
                if done.all():
                    break
        else:
            cache, logits = read_prompts(mdl, torch, [ids for ids, _, _ in read], configs, policies, evicted_at, G,
                                         prefill_chunk, dev)
            host = np.repeat(greedy_stats(logits).cpu().numpy(), C, axis=0)
            lanes = joined_lanes(torch, cache, rows_cfg, policies, evicted_at, eviction, T0, of, T, dev)
            del cache
            record(host, np.arange(R))
            for i in range(N - 1):
                if done.all():
                    break
                live = ~done
                host, _, _ = step(mdl, lanes, torch.as_tensor(host[:, 0].astype(np.int64), device=dev),
                                  start_t + i, rows_cfg, policies, evicted_at, greedy_stats, live)
                record(host, np.flatnonzero(live))
                report(i + 1, N - 1)
        shares = lane_bytes(lanes, R)
        del lanes
    seconds = time.perf_counter() - start
    out = []
    for p, (ids, shown, bos) in enumerate(read):
        rows = slice(p * C, (p + 1) * C)
        Tp = int(T0[p]) + N
        ev = evicted_at[rows, ..., :Tp].copy()
        made = new_ids[rows]
        texts = [tok.decode([int(x) for x in row[row >= 0]], skip_special_tokens=True) for row in made]
        pieces = [token_strings(tok, [int(x) for x in row[row >= 0]]) for row in made]
        last_step = int(T0[p]) + int((made >= 0).sum(axis=1).max()) - 2
        meta = {**model_provenance(mdl), "bos": bos, "seed": seeds[p], "prompt_mode": prompt_mode,
                "granularity": granularity, "stop_at_eos": bool(stop_at_eos), "eos_ids": sorted(eos),
                "eviction": eviction, "full_cache": bool(full_cache), "batch_prompts": P, "batch_index": p,
                **memory(mdl, configs, policies[rows], ev, shares[rows], last_step),
                "seconds": seconds}
        out.append(Generation(configs=configs, granularity=granularity, prompt_mode=prompt_mode,
                              prompt_ids=np.array(ids, np.int64), tokens=shown, new_ids=made,
                              logprobs=logprobs[rows], texts=texts, stopped=stopped[rows], evicted_at=ev,
                              meta=meta, pieces=pieces))
    return out


PAD = -1e9  # a padding key's bias while prompts are read together: no weight, yet a finite row for a padding query


def read_prompts(mdl, torch, prompts, configs, policies, evicted_at, G: int, chunk: int, device):
    """Prompts (token-id lists) read in one pass, left-padded to the longest: each prompt's
    rows go to its own PromptFeed (kvviz.model.loop.prompt) from its padding on, then each
    of its configs (rows p x C .. p x C + C - 1 of `policies` and `evicted_at`) evicts once.
    The padding's keys get a finite bias (PAD), so they take no weight while a padding
    query's own row stays finite. Returns (the P-row cache, the last position's logits (P, V))."""
    from transformers import DynamicCache

    from kvviz.model.loop.attention import use
    from kvviz.model.models import attention_shape

    shape = attention_shape(mdl)
    L, Hk = shape.layers, shape.kv_heads
    P, C = len(prompts), len(configs)
    width = max(len(p) for p in prompts)
    pads = np.array([width - len(p) for p in prompts], np.int64)
    ids = np.zeros((P, width), np.int64)
    for p, pid in enumerate(prompts):
        ids[p, pads[p]:] = pid
    st = padded_prompt_state(torch, pads, width, configs, policies, L, Hk, G, chunk, device)
    cache = DynamicCache()
    pos = np.maximum(np.arange(width)[None, :] - pads[:, None], 0)
    use(mdl, st)
    try:
        with torch.no_grad():
            out = mdl(input_ids=torch.as_tensor(ids, device=device), position_ids=torch.as_tensor(pos, device=device),
                      cache=cache, use_cache=True, logits_to_keep=1)  # every prompt ends at the last index
            logits = out.logits[:, -1]
            del out
    finally:
        use(mdl, None)
    for p, _, feed in st.feeds:
        feed.evict(configs, policies[p * C:(p + 1) * C], evicted_at[p * C:(p + 1) * C])
    return cache, logits


def padded_prompt_state(torch, pads, width: int, configs, policies, L: int, Hk: int, G: int, chunk: int, device):
    """The State prompts left-padded to `width` (`pads` (P,)) are read through in one pass:
    by cache index (State.pad), the padding's keys at PAD, one PromptFeed per prompt for its
    configs (rows p x C .. p x C + C - 1 of `policies`)."""
    from kvviz.model.loop.cache import State
    from kvviz.model.loop.prompt import PromptFeed

    C = len(configs)
    st = State(torch, len(pads), L, Hk, G, width, device)
    for p, pad in enumerate(pads):
        st.bias[p, ..., :pad] = PAD
    if not st.on_host:
        st.bias_t.copy_(st.bias_h)
    st.pad[:] = pads
    st.feeds = [(p, int(pad), PromptFeed(width - int(pad), configs, policies[p * C:(p + 1) * C], L, G, chunk))
                for p, pad in enumerate(pads)]
    return st


def joined_lanes(torch, cache, configs, policies, evicted_at, eviction: str, T0, of, T: int, device) -> list:
    """The lanes after the prompts were read together (`cache`: one row per prompt,
    left-padded; `evicted_at` (R, L, G, T) holding each row's prompt victims). Masked: every
    row over the cache, each prompt's row repeated per config. Freed: the full rows so (they
    evict nothing), the evicting rows in one lane per SlotPlan (read after the eviction, as
    kvviz.model.loop.cache.lanes_after_prompt reads it), over slots gathered per prompt and
    joined."""
    from kvviz.model.loop.cache import Lane, by_plan, gathered, slot_cache

    R, L = len(configs), evicted_at.shape[1]
    width = int(T0.max())
    if eviction == "masked":
        return [padded_lane(torch, cache, np.arange(R), evicted_at, T0, of, T, device)]
    lanes = []
    full = np.array([r for r in range(R) if configs[r].is_full], np.int64)
    if len(full):
        lanes.append(padded_lane(torch, cache, full, evicted_at, T0, of, T, device))
    for plan, rest in by_plan(configs, policies, L):
        parts = []
        for p in sorted(set(of[rest])):
            mine = rest[of[rest] == p]
            Tp = int(T0[p])
            parts.append((mine, *gathered(torch, RowCache(cache, p, width - Tp), evicted_at[mine][..., :Tp] == NEVER,
                                          plan, Tp + T - width, device, limit=Tp + T - width)))
        index = np.concatenate([m for m, _, _ in parts])
        st, layers = joined_slots(torch, [(s, lay) for _, s, lay in parts], T, device)
        st.place(T0[of[index]])
        lanes.append(Lane(index, st, slot_cache(st, layers, seen=width)))
    return lanes


class RowCache:
    """Row b of a left-padded cache, its padding cut off, as a batch-1 cache (what
    kvviz.model.loop.cache.gathered reads: `layers`, each with `keys` and `values`)."""

    def __init__(self, cache, b: int, pad: int):
        self.layers = [_Layer(lay.keys[b:b + 1, :, pad:], lay.values[b:b + 1, :, pad:]) for lay in cache.layers]


class _Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


def padded_lane(torch, cache, rows, evicted_at, T0, of, T: int, device):
    """Masked `rows` over the prompts' left-padded cache (each row its prompt's row of it),
    their prompt victims and the padding masked; State.pad says where each row's position 0
    lies (`bias`, `cur` by cache index)."""
    from transformers import DynamicCache

    from kvviz.model.loop.cache import Lane, masked_state

    width = int(T0.max())
    pad = width - T0[of[rows]]
    B, (_, L, G, _) = len(rows), evicted_at.shape
    pick = torch.as_tensor(of[rows], device=device)
    joined = DynamicCache()
    for layer, lay in enumerate(cache.layers):
        joined.update(lay.keys.index_select(0, pick), lay.values.index_select(0, pick), layer)
    Hk = cache.layers[0].keys.shape[1]
    ev = np.full((B, L, G, width), NEVER, np.int64)
    for i, (r, gap) in enumerate(zip(rows, pad)):
        ev[i, ..., :gap] = 0  # the padding: never a key
        ev[i, ..., gap:] = evicted_at[r, ..., : width - gap]
    st = masked_state(torch, ev, Hk, T, device)  # by cache index: the longest prompt, then the new tokens
    st.pad[:] = pad
    return Lane(np.asarray(rows), st, joined)


def joined_slots(torch, parts, T: int, device):
    """Freed States over slots (and their layers' keys and values), one per prompt, as one:
    each layer with the most slots any part has there (`State.layer_slots`), a part's extra
    slots empty (masked) and its keys and values padded to that count. The parts share one
    layout (pooled or not: one SlotPlan)."""
    from kvviz.model.loop.cache import State

    first = parts[0][0]
    if any(st.pooled != first.pooled for st, _ in parts):
        raise ValueError("joined_slots joins parts of one SlotPlan: pooled and per-head slots differ in layout")
    slots = np.max([st.layer_slots for st, _ in parts], axis=0)  # (L,)
    B = sum(st.B for st, _ in parts)
    out = State(torch, B, first.L, first.Hk, first.G, T, device, slots=slots, pooled=first.pooled)
    layers = [[[], []] for _ in parts[0][1]]
    b = 0
    for st, lays in parts:
        rows = slice(b, b + st.B)
        mine = out.slot_pos[rows, ..., : st.S]
        out.slot_pos[rows, ..., : st.S] = np.where(st.slot_pos == -2, mine, st.slot_pos)  # -2: past the part's
        out.bias[rows, ..., : st.S] = st.bias
        for layer, (k, v) in enumerate(lays):
            gap = int(slots[layer]) - k.shape[2]
            layers[layer][0].append(torch.nn.functional.pad(k, (0, 0, 0, gap)))
            layers[layer][1].append(torch.nn.functional.pad(v, (0, 0, 0, gap)))
        b += st.B
    if not out.on_host:
        out.bias_t.copy_(out.bias_h)
    return out, [(torch.cat(k), torch.cat(v)) for k, v in layers]


def run_batch(texts, configs, granularity="layer", max_tokens=1024, progress=None, model=None, rows_layers=None,
              rows_tokens=None, seed=0, device="cpu", dtype="float32", eviction="masked") -> list:
    """`kvviz.model.loop.run` (the teacher-forced loop) for several texts of different
    lengths in one batch: every (text, config) pair one row, each reading position t at step
    t (no padding; a text that has ended rides along unevicted). One LoopResult per text, in
    order, with the eviction logs and argmax tokens it gets alone (its losses within float
    rounding). The arguments are run's; `seed` may be one per text."""
    from kvviz.model.loop.engine import check_inputs

    texts = list(texts)
    if not texts:
        raise ValueError("texts is empty: give at least one text")
    for text in texts:
        check_inputs(text, granularity, max_tokens, eviction)
    seeds = per_item_seeds(seed, len(texts), "text")
    configs = check_configs(configs)
    if eviction == "freed":
        refuse_ratio_freed(configs)
    import torch

    from kvviz.core.trace import packed_offset
    from kvviz.model.loop.engine import (
        attached,
        check_architecture,
        lane_bytes,
        lanes_for,
        make_policies,
        memory,
        refuse_uncalibrated,
        step,
    )
    from kvviz.model.loop.result import LoopResult
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
    read = [tokens(tok, text, int(max_tokens)) for text in texts]
    if any(len(ids) < 2 for ids, _, _ in read):
        raise ValueError("text must tokenise to at least 2 tokens")
    P, C = len(texts), len(configs)
    lens = np.array([len(ids) for ids, _, _ in read], np.int64)
    T = int(lens.max())
    shape = attention_shape(mdl)
    L, Hk = shape.layers, shape.kv_heads
    G = 1 if granularity == "layer" else Hk
    rows_layers = default_layers(L) if rows_layers is None else check_layers(rows_layers, L, "rows_layers")
    Tr = [int(n) if rows_tokens is None else max(0, min(int(rows_tokens), int(n))) for n in lens]
    R = P * C
    of = np.repeat(np.arange(P), C)
    f = next(i for i, c in enumerate(configs) if c.is_full)
    full_of = of * C + f  # each row's full row: the same text's
    rows_cfg = [configs[r % C] for r in range(R)]
    policies = [make_policies(rows_cfg[r], L, G, T, seeds[of[r]]) for r in range(R)]
    evicted_at = np.full((R, L, G, T), NEVER, np.int64)
    rows = [np.zeros((C, len(rows_layers), G, packed_offset(n)), np.float32) if rows_layers else None for n in Tr]
    nll, kl = np.zeros((R, T - 1)), np.zeros((R, T - 1))
    top1 = np.zeros((R, T - 1), np.int64)
    ids = np.zeros((P, T + 1), np.int64)
    for p, (pid, _, _) in enumerate(read):
        ids[p, : len(pid)] = pid
    dev = next(mdl.parameters()).device
    refuse_uncalibrated(rows_cfg, policies, "loop")
    model_s = book_s = 0.0
    with attached(mdl):
        lanes = lanes_for(torch, rows_cfg, policies, eviction, L, Hk, G, T, dev)
        full_t = torch.as_tensor(full_of, device=dev)
        for t in range(T):
            live = t < lens[of]
            target = torch.as_tensor(ids[of, t + 1], device=dev)

            def stats(logits, target=target):  # (R, 3): nll, argmax, KL(the text's full row || the row)
                logp = torch.log_softmax(logits.double(), dim=-1)
                full = logp[full_t]
                return torch.stack([-logp.gather(1, target[:, None])[:, 0], logp.argmax(dim=-1).double(),
                                    (full.exp() * (full - logp)).sum(dim=-1).clamp_min(0)], 1)

            scoring = t < lens[of] - 1
            host, m, b = step(mdl, lanes, torch.as_tensor(ids[of, t], device=dev), t, rows_cfg, policies, evicted_at,
                              stats if scoring.any() else None, None if live.all() else live)
            model_s, book_s = model_s + m, book_s + b
            if host is not None:
                nll[scoring, t], top1[scoring, t] = host[scoring, 0], host[scoring, 1].astype(np.int64)
                kl[scoring, t] = host[scoring, 2]
            for p in range(P):  # `cur` is still step t's
                if t < Tr[p] and rows[p] is not None:
                    off = packed_offset(t)
                    for lane in lanes:
                        mine = np.flatnonzero(of[lane.index] == p)
                        if len(mine):
                            got = lane.state.cur[mine][:, rows_layers, :, :t]
                            rows[p][lane.index[mine] % C, :, :, off:off + t] = got
            if progress is not None:
                progress(t + 1, T)
        shares = lane_bytes(lanes, R)
        del lanes
    out = []
    for p, (pid, offsets, bos) in enumerate(read):
        sel, n = slice(p * C, (p + 1) * C), int(lens[p])
        ev = evicted_at[sel, ..., :n].copy()
        out.append(LoopResult(
            configs=configs, granularity=granularity, tokens=token_strings(tok, pid, texts[p], offsets),
            token_ids=np.array(pid, np.int64), nll=nll[sel, : n - 1].copy(), p_true=np.exp(-nll[sel, : n - 1]),
            kl_tokens=kl[sel, : n - 1].copy(), top1=top1[sel, : n - 1].copy(), evicted_at=ev, layers=list(range(L)),
            rows=rows[p], rows_layers=rows_layers, rows_tokens=Tr[p],
            meta={"model_seconds": model_s, "bookkeeping_seconds": book_s, "seed": seeds[p], "bos": bos,
                  "eviction": eviction, "batch_texts": P, "batch_index": p,
                  **memory(mdl, configs, policies[sel], ev, shares[sel], n - 1),
                  **model_provenance(mdl)}))
    return out
