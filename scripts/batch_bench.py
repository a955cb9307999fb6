"""Prompts one at a time against the same prompts in one batch (kvviz.model.loop.generate_batch).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/batch_bench.py --prompt-mode decode --lengths 256 256 256 256

Pass-key prompts (kvviz.model.needle.tasks, depths spread over the haystack) of the given
lengths, TOVA and StreamingLLM (sinks 4) at --budget beside the full cache, 8 new tokens,
on SmolLM2 (or --model) with one torch thread. Prints each way's seconds, the ratio and
whether every prompt's tokens and eviction log are the same, with the machine's load.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-mode", choices=("decode", "prefill"), default="prefill")
    p.add_argument("--eviction", choices=("masked", "freed"), default="masked")
    p.add_argument("--lengths", type=int, nargs="+", default=[200, 256, 300, 230])
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from kvviz.model.loop import LoopConfig, generate, generate_batch
    from kvviz.model.models import load_model
    from kvviz.model.needle.tasks import Task, build

    torch.set_num_threads(1)
    pair = load_model(args.model)
    n = len(args.lengths)
    prompts = [list(build(pair[0], Task(), length, 10 + 80 * i / max(n - 1, 1), i).ids)
               for i, length in enumerate(args.lengths)]
    cfgs = [LoopConfig("tova", {}, args.budget), LoopConfig("streaming-llm", {"sinks": 4}, args.budget)]
    kw = dict(model=pair, prompt_mode=args.prompt_mode, eviction=args.eviction)
    t = time.perf_counter()
    alone = [generate(p, cfgs, 8, **kw) for p in prompts]
    one = time.perf_counter() - t
    t = time.perf_counter()
    batch = generate_batch(prompts, cfgs, 8, **kw)
    together = time.perf_counter() - t
    same = all(np.array_equal(a.new_ids, b.new_ids) and np.array_equal(a.evicted_at, b.evicted_at)
               for a, b in zip(alone, batch))
    print(f"{n} prompts of {[len(p) for p in prompts]} tokens, {args.prompt_mode}, {args.eviction}: one at a time "
          f"{one:.1f} s, one batch {together:.1f} s ({one / together:.2f}x); same tokens and eviction logs: {same}; "
          f"load {os.getloadavg()[0]:.1f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
