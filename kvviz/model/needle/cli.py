"""`python -m kvviz needle ...`: the pass-key grid, or one of its tasks (--task, with its
option: kvviz.model.needle.tasks). Every input is checked before the model loads (the key's
fit needs only the tokenizer); re-running the same command resumes."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvviz.core.cli import budget_arg, one_line_error
from kvviz.core.plugins import add_argument as add_plugin_argument
from kvviz.core.plugins import cli_load
from kvviz.core.policies import config_label
from kvviz.model.capture import add_device_arguments, add_threads_argument, require_stack
from kvviz.model.loop.cli import add_eviction_arguments
from kvviz.model.loop.config import GRANULARITIES, check_chunk, check_fits, refuse_ratio_freed
from kvviz.model.needle.grid import PROMPT_MODES, Grid
from kvviz.model.needle.tasks import Task


def _numbers(kind):
    """One or more values, space- or comma-separated: `--depths 10 50 90` or `--depths 10,50,90`."""
    def parse(text):
        return [kind(x) for x in text.split(",") if x.strip()]
    parse.__name__ = kind.__name__
    return parse


def parser(sub=None) -> argparse.ArgumentParser:
    """`kvviz needle`'s options: its own parser, or (given `sub`) its node in kvviz's tree."""
    kw = dict(prog="python -m kvviz needle",
              description="The pass-key test and its tasks: a key (or keys, or a phrase) hidden in a haystack at a "
                          "depth, then the question; every policy answers over its own evicted cache beside the "
                          "full cache. Re-running resumes.")
    p = (sub.add_parser("needle", help="the pass-key test under eviction (needs pip install 'kvviz[capture]')", **kw)
         if sub is not None else argparse.ArgumentParser(**kw))
    p.error = one_line_error
    p.add_argument("--out", help="results folder (runs/<id>.npz, results.csv, results.json)")
    p.add_argument("--lengths", nargs="+", type=_numbers(int), default=[[256]], help="prompt lengths in tokens")
    p.add_argument("--depths", nargs="+", type=_numbers(float), default=[[10, 50, 90]],
                   help="where the key sits, percent of the haystack (0-100)")
    p.add_argument("--seeds", nargs="+", type=_numbers(int), default=[[0]], help="seeds of the key's digits")
    p.add_argument("--policies", nargs="+", default=[],
                   help="NAME[:k=v,...] each, e.g. tova snapkv:poolKernel=1 streaming-llm:sinks=4")
    p.add_argument("--budgets", nargs="+", type=_numbers(budget_arg), default=[],
                   help="positions held per layer, or ratios of the tokens seen (0.25x)")
    p.add_argument("--prompt-modes", nargs="+", choices=PROMPT_MODES, default=["decode"])
    p.add_argument("--granularity", nargs="+", choices=GRANULARITIES, default=["layer"])
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per answer")
    p.add_argument("--task", default="passkey",
                   help="passkey (default), recall, distractors or phrase (kvviz/model/needle/tasks.py)")
    p.add_argument("--reminder-every", type=int, help="recall: a reminder of the key after every K-th "
                   "haystack sentence after it (default 20)")
    p.add_argument("--distractors", type=int, help="distractors: other people's keys besides the asked "
                   "one (default 2)")
    p.add_argument("--phrase-words", type=int, help="phrase: words in the pass phrase (default 4)")
    p.add_argument("--returns", type=int, help="returns: reminders of the key inside the eviction window, 0-3 "
                   "(default 3; 0 is the no-returns control)")
    p.add_argument("--hops", type=int, help="vartrack: assignments passing the value on, 0-3 (default 2)")
    add_eviction_arguments(p, prefill=True)
    p.add_argument("--batch", type=int, default=1,
                   help="prompts read together in one batch (of one prompt mode and granularity; each run's "
                        "tokens and evictions are what it gets alone); default 1")
    p.add_argument("--no-full-cache", action="store_true",
                   help="leave out the full-cache row: one forward per configuration, no full-cache gate or "
                        "agreement (the default runs it beside every configuration)")
    p.add_argument("--haystack", help="UTF-8 text file for the haystack (default: the pass-key filler)")
    p.add_argument("--haystacks", help="a folder of UTF-8 .txt haystacks (e.g. traces/haystacks): every prompt "
                   "of the grid once per file, the file's stem in the run id and the results' haystack column")
    p.add_argument("--model", help="a local Hugging Face model folder, a .gguf file or an installed "
                   "model's name (default: the bundled SmolLM2-135M); never the hub")
    add_device_arguments(p)
    add_threads_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_plugin_argument(p)
    p.set_defaults(func=run, parser=p)
    return p


def _flat(lists) -> list:
    return [x for part in lists for x in part]


def grid_from(args) -> Grid:
    if not args.out:
        raise ValueError("--out DIR is required")
    if not args.policies:
        raise ValueError("--policies: give at least one, e.g. --policies tova h2o")
    task = Task(args.task, reminder_every=args.reminder_every, distractors=args.distractors,
                phrase_words=args.phrase_words, returns=args.returns, hops=args.hops)
    hays = list(read_haystacks(args.haystacks)) if getattr(args, "haystacks", None) else [""]
    return Grid(lengths=_flat(args.lengths), depths=_flat(args.depths), seeds=_flat(args.seeds),
                policies=args.policies, budgets=_flat(args.budgets), prompt_modes=args.prompt_modes,
                granularities=args.granularity, max_new_tokens=args.max_new_tokens, task=task, haystacks=hays)


def read_haystacks(folder) -> dict[str, str]:
    """name (the file's stem) -> text of every .txt in `folder`, by name; ValueError naming
    --haystacks: no such folder, no .txt in it, a file that cannot be read or is empty."""
    from kvviz.model.needle.prompt import check_haystack

    d = Path(folder)
    if not d.is_dir():
        raise ValueError(f"--haystacks {folder}: not a folder")
    files = sorted(d.glob("*.txt"))
    if not files:
        raise ValueError(f"--haystacks {folder}: no .txt files in it")
    out = {}
    for f in files:
        try:
            out[f.stem] = check_haystack(f.read_text(encoding="utf-8"), f"--haystacks {f}")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--haystacks {f}: cannot read it ({exc})") from None
    return out


def read_haystack(path) -> str | None:
    from kvviz.model.needle.prompt import check_haystack

    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--haystack {path}: cannot read it ({exc})") from None
    return check_haystack(text, f"--haystack {path}")


def main(argv=None) -> int:
    return run(parser().parse_args(argv))


def run(args) -> int:
    if cli_load(args.plugin, "kvviz needle"):
        return 2
    try:
        from kvviz.model.models import thread_count

        thread_count(args.threads)  # a bad --threads or $KVVIZ_THREADS refused before anything loads
        grid = grid_from(args)
        if args.no_full_cache and all(c.is_full for c in grid.configs):
            raise ValueError("--no-full-cache leaves the full cache out: give a policy other than full")
        if args.eviction == "freed":
            refuse_ratio_freed(_flat(args.budgets), "--budgets")  # before anything loads
        if args.haystack and args.haystacks:
            raise ValueError("--haystack and --haystacks: give one (a file, or a folder of them)")
        haystack = read_haystacks(args.haystacks) if args.haystacks else read_haystack(args.haystack)
        from kvviz.model.models import resolve

        resolve(args.model)
        require_stack("needle", args.model)
        from kvviz.model.needle.run import check_lengths, context_limit, load_tokenizer

        check_chunk(args.prefill_chunk, "--prefill-chunk")
        check_chunk(args.batch, "--batch")
        from kvviz.model.models import check_device

        check_device(args.device, args.dtype)
        check_lengths(load_tokenizer(args.model), grid.lengths, grid.max_new_tokens, context_limit(args.model),
                      grid.task, grid.seeds)
        check_fits(max(grid.lengths) + grid.max_new_tokens - 1, _flat(args.budgets), args.eviction,
                   option="--budgets", what=f"the longest prompt (--lengths {max(grid.lengths)}) with its new tokens")
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from kvviz.model.models import use_threads
    from kvviz.model.needle.run import run_grid

    use_threads(args.threads, "needle")
    start = time.perf_counter()
    try:
        df = run_grid(grid, args.out, model=args.model, haystack=haystack,
                      haystack_name=Path(args.haystack).name if args.haystack else None,
                      progress=not args.quiet, device=args.device, dtype=args.dtype, eviction=args.eviction,
                      prefill_chunk=args.prefill_chunk, batch=args.batch, full_cache=not args.no_full_cache)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: finished prompts are saved; re-run the same command to resume", file=sys.stderr)
        return 130
    mine = df[df["id"].isin([s.id for s in grid.prompts()])]
    print(f"eviction: {args.eviction}")
    print(summary(mine))
    if args.no_full_cache:
        print("full cache: left out (--no-full-cache): no gate on its accuracy, no agreement with it")
    else:
        print(gate_note(mine))
    n = sum(not (c.is_full and args.no_full_cache) for c in grid.configs)
    print(f"{len(grid.prompts())} prompts x {n} configs in {time.perf_counter() - start:.0f} s "
          f"-> {Path(args.out) / 'results.csv'} and results.json")
    return 0


def summary(df) -> str:
    """Accuracy and key share held at the end of the prompt, per configuration
    (kvviz.core.policies.config_label) and prompt mode; the answer checks' outcomes, counted
    (right / wrong for the pass key and recall, right / distractor / no key, whole / partial / lost)."""
    df = df.assign(config=[config_label(p, json.loads(q) if isinstance(q, str) else q, budget=b)
                           for p, q, b in zip(df["policy"], df["params"], df["budget"])])
    g = df.groupby(["prompt_mode", "config"], sort=False).agg(
        runs=("correct", "size"), accuracy=("correct", "mean"), held_end=("held_end", "mean"))
    if "outcome" in df:
        g = g.join(df.groupby(["prompt_mode", "config"], sort=False)["outcome"].value_counts()
                   .unstack(fill_value=0))
    return g.to_string(float_format=lambda v: f"{v:.2f}")


def gate_note(df) -> str:
    """The full cache's accuracy per task and length, and which lengths a study keeps
    (kvviz.model.needle.results.gate)."""
    from kvviz.model.needle.results import GATE, OPTIONS, gate

    _, acc = gate(df)
    lines = [f"full-cache gate (a task's length stays in a study at >= {GATE:.0%} of its prompts answered):"]
    for _, r in acc.iterrows():
        opt = next((f" ({o.replace('_', ' ')} {int(r[o])})" for o in OPTIONS if o in r and r[o] >= 0), "")
        lines.append(f"  {r['task']}{opt} at {r['length']} tokens: {r['full_accuracy']:.0%} of {r['prompts']} prompts, "
                     + ("kept" if r["kept"] else "left out"))
    return "\n".join(lines)
