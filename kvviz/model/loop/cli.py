"""`python -m kvviz loop ...`: run configs over a text; `--perf`: what the loop costs.

Every input is checked before the model loads (a bad policy should not cost 20 s).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvviz.core.atomic import replacing
from kvviz.core.cli import as_options, one_line_error
from kvviz.core.plugins import add_argument as add_plugin_argument
from kvviz.core.plugins import cli_load
from kvviz.core.policies import config_label
from kvviz.model.capture import add_device_arguments, add_threads_argument, parse_layers, require_stack
from kvviz.model.loop.config import EVICTIONS, GRANULARITIES, PREFILL_CHUNK, LoopConfig, check_fits, parse_policy
from kvviz.model.models import PROVENANCE, resolve, thread_count, use_threads

PERF_VARIANTS = {"snapkv": ("snapkv:pool_kernel=1",)}  # measured beside the default


def perf_policies() -> list[str]:
    """What `--perf` runs: every registered policy at its defaults, and the variants above."""
    from kvviz.core.policies import POLICIES

    return [x for name in POLICIES for x in (name, *PERF_VARIANTS.get(name, ()))]


def perf_configs(budget: int) -> tuple[list[LoopConfig], list[str]]:
    """`--perf`'s configurations at `budget`: full, then every perf policy the budget admits;
    and one line per policy it does not (a protected window as large as the budget), or
    that reads key and query vectors (one KV head's: --perf runs whole layers)."""
    from kvviz.core.policies import POLICIES

    configs, left_out = [LoopConfig("full")], []
    for spec in perf_policies():
        cls = POLICIES.get(spec.split(":")[0])
        if cls is not None and (cls.reads_keys or cls.reads_queries):
            left_out.append(f"{spec}: reads key and query vectors, one KV head's, and --perf runs "
                            "at layer granularity")
            continue
        try:
            configs.append(LoopConfig(*parse_policy(spec), budget))
        except ValueError as exc:
            left_out.append(f"{spec} at budget {budget}: {exc}")
    return configs, left_out


def read_text(path: str, option: str) -> str:
    """A UTF-8 text file given as `option`, or a ValueError naming the option and the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{option} {path}: cannot read it ({exc})") from None
    if not text.strip():
        raise ValueError(f"{option} {path} is empty")
    return text


def add_config_arguments(p) -> None:
    """--budget, --policy, --granularity: the batch's configurations (loop and generate)."""
    p.add_argument("--budget", type=int, action="append", default=[], help="positions held per layer (repeatable)")
    p.add_argument("--policy", action="append", default=[],
                   help="NAME[:k=v,...], e.g. snapkv:poolKernel=5 or streaming-llm:sinks=0 (repeatable)")
    p.add_argument("--granularity", choices=GRANULARITIES, default="layer")
    add_eviction_arguments(p)


def add_eviction_arguments(p, prefill: bool = False) -> None:
    """--eviction (and, where a prompt is read in one pass, --prefill-chunk)."""
    p.add_argument("--eviction", choices=EVICTIONS, default="masked",
                   help="masked: an evicted key is masked and stays in memory (what the policy decides, shown "
                        "exactly); freed: each cache holds only its kept positions, so memory follows the budget")
    if prefill:
        p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                       help="prompt queries per attention block when a prompt is read in one pass (memory grows "
                            "with chunk x prompt length)")


def count_tokens(model, text: str, limit: int | None = None) -> int:
    """How many tokens `text` is for the model's tokenizer (at most `limit`), tokenizer only."""
    from kvviz.model.models import load_tokenizer, tokenize

    return len(tokenize(load_tokenizer(model), text, limit or (1 << 40))[0])


MIB, KIB = 1024 * 1024, 1024  # what the memory lines print: MiB and KiB


def memory_line(meta: dict, per_config: bool = False) -> str:
    """The memories of a run side by side, as `meta` records them: the totals over its rows,
    then (`per_config`, when recorded) one line per configuration."""
    line = (f"eviction {meta['eviction']}: keys and values held {meta['cache_bytes'] / MIB:.1f} MiB "
            f"(the full cache: {meta['full_cache_bytes'] / MIB:.1f} MiB); the policies' own bookkeeping "
            f"{meta['policy_bytes'] / KIB:.1f} KiB")
    rows = [r for r in meta.get("memory_by_config") or [] if r.get("kv_held_bytes") is not None]
    if not per_config or not rows:
        return line
    names = [r.get("name") or r["label"] for r in rows]
    width = max(len(n) for n in names)
    # (indented: a line that starts with a configuration's label is its result row)
    out = [line, f"  {'per configuration':<{width}}  {'held MiB':>9}  {'full MiB':>9}  {'bookkeeping KiB':>15}"]
    out += [f"  {n:<{width}}  {r['kv_held_bytes'] / MIB:>9.2f}  {r['full_cache_bytes'] / MIB:>9.2f}  "
            f"{r['policy_bytes'] / KIB:>15.1f}" for n, r in zip(names, rows)]
    return "\n".join(out)


def speed_line(meta: dict, tokens: int, configs: int) -> str:
    """How fast a run read its text, and the policies' bookkeeping's share of each step."""
    model, book = meta["model_seconds"], meta["bookkeeping_seconds"]
    return (f"{tokens} tokens x {configs} configurations in {model + book:.1f} s: {tokens / (model + book):.1f} "
            f"tokens/s; model {model:.1f} s, bookkeeping {book:.1f} s ({book / (model + book):.0%} of a step)")


def add_model_arguments(p) -> None:
    """--model, --device, --dtype, --threads: which model runs, and where."""
    p.add_argument("--model", help="a local Hugging Face model folder, a .gguf file or an installed "
                   "model's name (default: the bundled SmolLM2-135M); never the hub")
    add_device_arguments(p)
    add_threads_argument(p)


def parser(sub=None, perf=None) -> argparse.ArgumentParser:
    """`kvviz loop`'s options: its own parser, or (given `sub`) its node in kvviz's tree.
    `perf` is the benchmark `--perf` runs (a study, so the CLI tree above passes it in: this
    layer does not import studies)."""
    kw = dict(prog="python -m kvviz loop",
              description="Decode a text with a model (default: SmolLM2) over its own evicted KV cache, every "
                          "policy at every budget in one batch, and compare with the full cache.")
    p = (sub.add_parser("loop", help="decode with the evicted cache and measure what the model loses "
                        "(needs pip install 'kvviz[capture]')", **kw)
         if sub is not None else argparse.ArgumentParser(**kw))
    p.error = one_line_error
    p.add_argument("--text", help="UTF-8 text file to read")
    p.add_argument("--max-tokens", type=int, default=1024, help="read the first N tokens")
    add_config_arguments(p)
    p.add_argument("--json", help="write {'results': [...]} here")
    p.add_argument("--out", help="write the full result (.npz: per-token NLL, eviction logs, rows)")
    add_model_arguments(p)
    p.add_argument("--rows-layers", default=None,
                   help="model layers whose attention rows --out keeps (default: first, middle, last)")
    p.add_argument("--rows-tokens", type=int, default=None, help="keep rows for the first N tokens only")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy's draws")
    p.add_argument("--perf", action="store_true", help="benchmark: bookkeeping share and batch efficiency")
    p.add_argument("--perf-tokens", type=int, default=384, help="tokens per --perf run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_plugin_argument(p)
    p.set_defaults(func=run, parser=p, perf_main=perf)
    return p


def build_configs(policies: list[str], budgets: list[int]) -> list[LoopConfig]:
    """Every policy at every budget, `full` first. ValueError names the bad input."""
    for b in budgets:
        if b < 1:
            raise ValueError(f"--budget must be >= 1, got {b}")
    parsed = [(spec, *parse_policy(spec)) for spec in policies]
    configs = [LoopConfig("full")]
    if any(name != "full" for _, name, _ in parsed) and not budgets:
        raise ValueError("--budget is required for any policy but full")
    for spec, name, params in parsed:
        if name == "full":
            continue
        for b in budgets:
            try:
                cfg = LoopConfig(name, params, b)
            except ValueError as exc:
                raise ValueError(f"--policy {spec} at --budget {b}: {exc}") from None
            if cfg.label not in [c.label for c in configs]:
                configs.append(cfg)
    return configs


class Progress:
    """A tqdm bar on stderr (tokens, tokens/s, ETA), as a `progress(done, total)` callable.
    tqdm is a main dependency (the sweep's bar is tqdm too)."""

    def __init__(self, label: str, quiet: bool = False, command: str = "loop"):
        self.label, self.quiet, self.bar, self.command = label, quiet, None, command

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"[kvviz {self.command}] {self.label}", unit="tok",
                            file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.bar.close()


def write_json(path, data) -> None:
    with replacing(path) as fh:
        fh.write(json.dumps(data, indent=1).encode())


TABLE_NOTE = ("ppl: over the whole text; after: over the tokens predicted after the configuration's first "
              "eviction; full: the full cache's perplexity on those same tokens; diff: after - full")


def table(results) -> str:
    """One line per configuration: whole-text perplexity, then the perplexity after its first
    eviction beside the full cache's on the same tokens and the difference, top-1, KL."""
    lines = [f"{'config':<58} {'ppl':>8} {'after':>9} {'full':>9} {'diff':>9} {'top1':>6} {'kl':>7}"]
    for r in results:
        after, full = r["perplexity_after_eviction"], r.get("full_perplexity_after_eviction")
        name = config_label(r["policy"], r["params"], budget=r["budget"])
        cells = ["-", "-", "-"] if after is None or full is None else \
            [format(after, ".3f"), format(full, ".3f"), format(after - full, "+.3f")]
        lines.append(f"{name:<58} {r['perplexity']:8.3f} {cells[0]:>9} {cells[1]:>9} {cells[2]:>9} "
                     f"{r['top1_agreement']:6.3f} {r['kl']:7.4f}")
    return "\n".join(lines + [TABLE_NOTE])


def main(argv=None) -> int:
    return run(parser().parse_args(argv))


def run_perf(args, command: str, budget: int) -> int:
    """`kvviz COMMAND --perf`: the study the command line passed in (`args.perf_main`) at the
    first --budget (else `budget`), on the threads the command uses; 2 with one line when it
    cannot run."""
    if args.perf_main is None:
        print(f"error: --perf is run by the kvviz command line (kvviz {command} --perf)", file=sys.stderr)
        return 2
    try:
        require_stack(f"{command} --perf")
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    use_threads(args.threads, command)
    return args.perf_main(args.perf_tokens, budget=(args.budget or [budget])[0], device=args.device,
                          dtype=args.dtype)


def run(args) -> int:
    if cli_load(args.plugin, "kvviz loop"):
        return 2
    try:
        thread_count(args.threads)  # a bad --threads or $KVVIZ_THREADS refused before anything loads
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.perf:
        return run_perf(args, "loop", 256)
    try:
        if not args.text:
            raise ValueError("--text is required")
        if args.max_tokens < 2:
            raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
        text = read_text(args.text, "--text")
        configs = build_configs(args.policy, args.budget)
        rows_layers = [] if args.rows_layers is not None and not args.rows_layers.strip() \
            else parse_layers(args.rows_layers)
        resolve(args.model)  # a missing or incomplete model refused before anything loads
        require_stack("loop", args.model)
        from kvviz.model.models import check_device, context_limit

        check_device(args.device, args.dtype)
        n = count_tokens(args.model, text, args.max_tokens)
        check_fits(n, args.budget, args.eviction, context_limit(args.model), f"--text {args.text}")
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from kvviz.model.loop import run_loop

    use_threads(args.threads, "loop")
    start = time.perf_counter()
    try:
        res = run_loop(text, configs, granularity=args.granularity, max_tokens=args.max_tokens,
                       progress=Progress(f"{Path(args.text).name} {args.granularity} x{len(configs)}", args.quiet),
                       rows_layers=rows_layers, rows_tokens=args.rows_tokens, seed=args.seed,
                       model=args.model, device=args.device, dtype=args.dtype, eviction=args.eviction)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {as_options(exc, ('rows_layers', 'rows_tokens', 'max_tokens'))}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    res.meta.update(name=Path(args.text).stem, text_file=str(args.text))
    print(table(res.results))
    print(memory_line(res.meta, per_config=True))
    print(speed_line(res.meta, len(res.tokens), len(configs)))
    if args.json:
        write_json(args.json, {"text": str(args.text), "n_tokens": len(res.tokens),
                               "granularity": args.granularity, "seconds": round(seconds, 1),
                               **{k: res.meta[k] for k in ("eviction", "cache_bytes", "full_cache_bytes",
                                                           "policy_bytes", "memory_by_config")},
                               **{k: res.meta[k] for k in PROVENANCE if k in res.meta},
                               "results": res.results})
    if args.out:
        res.save(args.out)
    return 0
