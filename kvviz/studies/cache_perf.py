"""What freeing evicted memory buys: decode speed and cache bytes, full against masked and freed.

    python -m kvviz.studies.cache_perf --lengths 2048 4096 8192 --budgets 256 1024 --batches 1 8

For each prompt length the prompt (the pass-key prompt, or seeded random tokens for a model
without a tokenizer) is read once in one pass, every configuration evicting once at its end
(kvviz.model.loop.engine.read_prompt); then, per budget and batch size, `steps` greedy
tokens are decoded three ways from that same prompt cache:

- full: the model's own decode over the whole cache (PyTorch's fused attention, sdpa,
  no kvviz), `batch` sequences;
- masked: kvviz's engine, `batch` configurations (distinct policies at the budget),
  evicted keys masked (every row holds the whole cache);
- freed: the same configurations, each row's cache gathered to its kept positions.

Printed per row: ms per decode step, tokens per second (batch x steps / seconds), the keys
and values held, the bytes a step brought from the device to the host (0 on the CPU:
host and device are one memory), and the speed as a multiple of full's. Wall time on a machine other
jobs may share: read the ratios within one run. Figures, not a test.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

POLICIES = ("tova", "snapkv", "h2o", "scissorhands", "streaming-llm", "knorm", "random", "snapkv:pool_kernel=1")


def batch_configs(budget: int, batch: int):
    from kvviz.model.loop.config import LoopConfig, parse_policy

    if not 1 <= batch <= len(POLICIES):
        raise ValueError(f"--batches: a batch is 1..{len(POLICIES)} distinct policies, got {batch}")
    return [LoopConfig(*parse_policy(p), budget) for p in POLICIES[:batch]]


def prompt_ids(pair, length: int) -> list[int]:
    """The pass-key prompt of `length` tokens, or seeded random ids without a tokenizer."""
    tok, mdl = pair
    if tok is not None:
        from kvviz.model.needle.prompt import build

        return list(build(tok, length, 50, 0).ids)
    vocab = mdl.config.get_text_config().vocab_size
    return np.random.default_rng(length).integers(0, vocab, length).tolist()


def clone(torch, cache):
    from transformers import DynamicCache

    out = DynamicCache()
    for i, lay in enumerate(cache.layers):
        out.update(lay.keys.clone(), lay.values.clone(), i)
    return out


def measure(pair, lengths, budgets, batches, steps: int = 32, log=print) -> list[dict]:
    """One row per (length, budget, batch, mode); see the module's docstring."""
    import torch

    from kvviz.core.replay import NEVER
    from kvviz.model.loop.config import PREFILL_CHUNK
    from kvviz.model.loop.engine import (
        MOVED,
        attached,
        cache_bytes,
        lanes_after_prompt,
        make_policies,
        read_prompt,
        step,
    )
    from kvviz.model.loop.greedy import greedy_stats
    from kvviz.model.models import text_config

    tok, mdl = pair
    dev = next(mdl.parameters()).device
    cfg = text_config(mdl)
    L = cfg.num_hidden_layers
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for n in lengths:
        ids = prompt_ids(pair, n)
        T = n + steps
        everything = [c for b in budgets for c in batch_configs(b, max(batches))]
        policies = [make_policies(c, L, 1, T, 0, vectorised=False) for c in everything]
        evicted = np.full((len(everything), L, 1, T), NEVER, np.int64)
        ids_t = torch.tensor(ids, device=dev)
        t0 = time.perf_counter()
        with attached(mdl):
            prompt, logits, feed = read_prompt(mdl, torch, ids_t, everything, policies, evicted, 1, PREFILL_CHUNK, dev)
        sync()
        log(f"{n} tokens: prompt read, {len(everything)} configurations evicted, in {time.perf_counter() - t0:.1f} s")
        first = greedy_stats(logits).cpu().numpy()[0, 0]
        for b in budgets:
            for batch in batches:
                pick = [i for i, c in enumerate(everything) if c.budget == b][:batch]
                configs = [everything[i] for i in pick]
                pols = [policies[i] for i in pick]  # each decodes on from its own prefill state, once
                for mode in ("full", "masked", "freed"):
                    cache = clone(torch, prompt)
                    tokens = torch.full((batch,), int(first), device=dev)
                    moved = MOVED[0]
                    if mode == "full":
                        cache.batch_repeat_interleave(batch)
                        previous = mdl.config._attn_implementation
                        mdl.set_attn_implementation("sdpa")  # the model's fastest own attention
                        try:
                            sync()
                            start = time.perf_counter()
                            with torch.no_grad():
                                for t in range(steps):
                                    out = mdl(input_ids=tokens.view(batch, 1), cache=cache, use_cache=True,
                                              position_ids=torch.full((batch, 1), n + t, device=dev))
                                    tokens = out.logits[:, -1].argmax(-1)
                            sync()
                        finally:
                            mdl.set_attn_implementation(previous)
                        secs, held = time.perf_counter() - start, cache_bytes([cache])
                    else:
                        import copy

                        ev = evicted[pick].copy()
                        run_pols = copy.deepcopy(pols)
                        with attached(mdl):
                            lanes = lanes_after_prompt(torch, cache, configs, run_pols, ev, mode, T, dev)
                            sync()
                            start = time.perf_counter()
                            for t in range(steps):
                                host, _, _ = step(mdl, lanes, tokens, n + t, configs, run_pols, ev, greedy_stats)
                                tokens = torch.as_tensor(host[:, 0].astype(np.int64), device=dev)
                            sync()
                            secs, held = time.perf_counter() - start, cache_bytes(lane.cache for lane in lanes)
                    row = {"length": n, "budget": b, "batch": batch, "mode": mode, "steps": steps,
                           "ms_per_step": 1000 * secs / steps, "tokens_per_s": batch * steps / secs,
                           "cache_bytes": held, "kv_held_bytes_per_row": held // batch,
                           "host_bytes_per_step": (MOVED[0] - moved) // steps}
                    rows.append(row)
                    log(f"  budget {b:>5} batch {batch}: {mode:<6} {row['ms_per_step']:8.1f} ms/step "
                        f"{row['tokens_per_s']:8.1f} tokens/s  cache {held / 2**20:8.1f} MiB")
                    del cache
    return rows


def table(rows) -> str:
    """The rows as the docs quote them: freed's and masked's speed as a multiple of full's."""
    full = {(r["length"], r["budget"], r["batch"]): r for r in rows if r["mode"] == "full"}
    lines = [f"{'length':>6} {'budget':>6} {'batch':>5} {'mode':<6} {'ms/step':>8} {'tokens/s':>9} "
             f"{'cache MiB':>9} {'host KiB/step':>13} {'x full':>7}"]
    for r in rows:
        f = full[r["length"], r["budget"], r["batch"]]
        lines.append(f"{r['length']:>6} {r['budget']:>6} {r['batch']:>5} {r['mode']:<6} {r['ms_per_step']:>8.1f} "
                     f"{r['tokens_per_s']:>9.1f} {r['cache_bytes'] / 2**20:>9.1f} "
                     f"{r['host_bytes_per_step'] / 1024:>13.1f} "
                     f"{r['tokens_per_s'] / f['tokens_per_s']:>6.2f}x")
    return "\n".join(lines)


def floor(pair, length: int, new: int = 8) -> dict:
    """The floor a long run is measured against: the pass-key prompt's plain full-cache
    prefill and greedy generation, by the model's own `generate` (sdpa), no kvviz."""
    import torch

    tok, mdl = pair
    ids = torch.tensor([prompt_ids(pair, length)], device=next(mdl.parameters()).device)
    previous = mdl.config._attn_implementation
    mdl.set_attn_implementation("sdpa")
    try:
        start = time.perf_counter()
        with torch.no_grad():
            out = mdl.generate(ids, max_new_tokens=new, do_sample=False)
        secs = time.perf_counter() - start
    finally:
        mdl.set_attn_implementation(previous)
    text = tok.decode(out[0, length:]) if tok is not None else ""
    return {"length": length, "new_tokens": new, "seconds": secs, "text": text}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvviz.studies.cache_perf", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192])
    p.add_argument("--budgets", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per row")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one: what these figures assume)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--floor", type=int, metavar="LENGTH",
                   help="only time the plain full-cache prefill and greedy generation (8 new tokens) of the "
                        "LENGTH-token pass-key prompt, the floor a long run is measured against")
    args = p.parse_args(argv)
    try:
        for b in args.budgets:
            if b < 1 or b >= min(args.lengths):
                raise ValueError(f"--budgets: {b} must be in 1..{min(args.lengths) - 1} (below every length)")
        for x in args.batches:
            batch_configs(min(args.budgets), x)
        import torch

        from kvviz.model.models import load_model

        torch.set_num_threads(args.threads)
        pair = load_model(None, "cache_perf", args.device)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.floor:
        f = floor(pair, args.floor)
        print(f"floor: the {f['length']}-token pass-key prompt's plain full-cache prefill and greedy generation "
              f"({f['new_tokens']} new tokens, the model's own generate, sdpa): {f['seconds']:.1f} s; "
              f"answer {f['text']!r}")
        return 0
    rows = measure(pair, args.lengths, args.budgets, args.batches, args.steps,
                   log=lambda s: print(s, file=sys.stderr, flush=True))
    where = f"{next(pair[1].parameters()).device}, {args.threads} thread(s)"
    print(f"cache_perf: {pair[1].kvviz_provenance.get('model', 'model')}, {where}, {args.steps} decode steps per row")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
