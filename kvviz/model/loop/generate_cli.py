"""`kvviz generate ...`: continue a prompt greedily under every policy at once; `--perf`:
what it costs. Every input is checked before the model loads."""
from __future__ import annotations

import argparse
import sys

from kvviz.core.cli import one_line_error
from kvviz.core.plugins import add_argument as add_plugin_argument
from kvviz.core.plugins import cli_load
from kvviz.core.policies import config_label
from kvviz.model.capture import require_stack
from kvviz.model.loop.cli import (
    Progress,
    add_config_arguments,
    add_model_arguments,
    build_configs,
    count_tokens,
    memory_line,
    read_text,
    run_perf,
)
from kvviz.model.loop.config import PREFILL_CHUNK, check_chunk, check_fits, refuse_ratio_freed
from kvviz.model.loop.generation import PROMPT_MODES, check_request
from kvviz.model.models import resolve, thread_count, use_threads

MARK = "|>"


def parser(sub=None, perf=None) -> argparse.ArgumentParser:
    """`kvviz generate`'s options: its own parser, or (given `sub`) its node in kvviz's tree.
    `perf` is the benchmark `--perf` runs (a study, so the CLI tree above passes it in: this
    layer does not import studies)."""
    kw = dict(prog="python -m kvviz generate",
              description="Continue a prompt greedily with a model (default: SmolLM2) over its own evicted KV "
                          "cache, every policy at every budget in one batch beside the full cache.")
    p = (sub.add_parser("generate", help="greedy generation under eviction, side by side with the full cache "
                        "(needs pip install 'kvviz[capture]')", **kw)
         if sub is not None else argparse.ArgumentParser(**kw))
    p.error = one_line_error
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="UTF-8 file holding the prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="generate at most N tokens per config")
    add_config_arguments(p)
    p.add_argument("--prompt-mode", choices=PROMPT_MODES, default="decode",
                   help="decode: every prompt token is a step that may evict; prefill: read the prompt in one "
                        "pass with the full cache, then each policy evicts once to its budget")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="prompt queries per attention block in prefill mode (memory grows with chunk x prompt "
                        "length, never with its square)")
    p.add_argument("--no-eos", action="store_true", help="do not stop a row at EOS")
    p.add_argument("--no-full-cache", action="store_true",
                   help="leave out the full-cache row (the reference agreement and departure are measured "
                        "against): one configuration then costs one forward per token")
    p.add_argument("--json", help="write the whole generation (texts, log-probs, eviction logs) here")
    add_model_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy's draws")
    p.add_argument("--perf", action="store_true",
                   help="benchmark: up to 8 configs (printed) against 1, bookkeeping share, prefill against decode")
    p.add_argument("--perf-tokens", type=int, default=512, help="prompt tokens per --perf run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_plugin_argument(p)
    p.set_defaults(func=run, parser=p, perf_main=perf)
    return p


def side_by_side(gen) -> str:
    """One line per config, the full cache first: agreement, departure, stop, and the
    continuation with MARK where it first departs from the full cache's (without the full
    row, "-" for both and no MARK)."""
    f = gen.full_index
    order = ([] if f is None else [f]) + [c for c in range(len(gen.configs)) if c != f]
    names = [config_label(cfg.policy, cfg.params, budget=cfg.budget) for cfg in gen.configs]
    width = max(len(names[c]) for c in order)
    lines = [f"{'config':<{width}}  {'agree':>5}  {'departs':>7}  {'stop':<6}  continuation "
             f"({MARK} marks the first token that differs from full)"]
    for c in order:
        d, a = gen.departure[c], gen.agreement[c]
        lines.append(f"{names[c]:<{width}}  {'-' if a is None else f'{a:5.3f}':>5}  "
                     f"{'-' if d is None or d < 0 else d:>7}  "
                     f"{gen.stopped[c]:<6}  {gen.marked(c, MARK)}")
    return "\n".join(lines)


def read_prompt(args) -> str:
    if args.prompt is None and args.prompt_file is None:
        raise ValueError("--prompt or --prompt-file is required")
    if args.prompt_file is not None:
        return read_text(args.prompt_file, "--prompt-file")
    if not args.prompt.strip():
        raise ValueError("--prompt is empty: give the model something to read")
    return args.prompt


def run(args) -> int:
    if cli_load(args.plugin, "kvviz generate"):
        return 2
    try:
        thread_count(args.threads)  # a bad --threads or $KVVIZ_THREADS refused before anything loads
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.perf:
        return run_perf(args, "generate", 128)
    try:
        prompt = read_prompt(args)
        if args.max_new_tokens is None:
            raise ValueError("--max-new-tokens is required")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        configs = build_configs(args.policy, args.budget)
        if args.eviction == "freed":
            refuse_ratio_freed(args.budget, "--budget")  # before anything loads
        if args.no_full_cache:
            configs = [c for c in configs if not c.is_full]
            if not configs:
                raise ValueError("--no-full-cache leaves the full cache out: give a --policy other than full")
        check_chunk(args.prefill_chunk, "--prefill-chunk")
        check_request(prompt, args.max_new_tokens, args.granularity, args.prompt_mode)
        resolve(args.model)  # a missing or incomplete model refused before anything loads
        require_stack("generate", args.model)
        from kvviz.model.models import check_device, context_limit

        check_device(args.device, args.dtype)
        n = count_tokens(args.model, prompt) + args.max_new_tokens - 1  # the last new token is never read
        check_fits(n, args.budget, args.eviction, context_limit(args.model),
                   f"the prompt with --max-new-tokens {args.max_new_tokens}")
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from kvviz.model.loop import generate

    use_threads(args.threads, "generate")
    try:
        gen = generate(prompt, configs, args.max_new_tokens, granularity=args.granularity,
                       prompt_mode=args.prompt_mode, model=args.model, seed=args.seed, device=args.device,
                       dtype=args.dtype, stop_at_eos=not args.no_eos, eviction=args.eviction,
                       prefill_chunk=args.prefill_chunk, full_cache=not args.no_full_cache,
                       progress=Progress(f"{args.prompt_mode} {args.granularity} x{len(configs)}", args.quiet,
                                         command="generate"))
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = gen.meta
    print(f"prompt: {gen.prompt_len} tokens, {args.prompt_mode} mode, {args.granularity} granularity; "
          f"{m['seconds']:.1f} s ({m['model_seconds']:.1f} s model, {m['bookkeeping_seconds']:.1f} s bookkeeping)")
    print(memory_line(m, per_config=True))
    if not m.get("full_cache", True):
        print("full cache: left out (--no-full-cache): no agreement or departure to measure")
    print(side_by_side(gen))
    if args.json:
        gen.save(args.json)
    return 0


def main(argv=None) -> int:
    return run(parser().parse_args(argv))
