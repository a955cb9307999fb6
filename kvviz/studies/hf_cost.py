"""What one evicting configuration costs over the model's own `generate`: a benchmark, not a test.

    OMP_NUM_THREADS=1 python -m kvviz.studies.hf_cost --lengths 2048 8184

For each length, the pass-key prompt of that many tokens (kvviz.studies.cache_perf.prompt_ids:
deterministic, no file to bring) is continued by `new` greedy tokens (EOS ignored), back to
back in one process, one torch thread:

- plain: the model's own `generate` (sdpa), the full cache, no kvviz;
- hf masked / hf freed: the same `generate` inside `kvviz.hf.evicting` (one configuration,
  `--policy` at `--budget`, kv-head granularity);
- generate masked / generate freed: `kvviz.model.loop.generate` in prefill mode, the same
  configuration, without the full-cache row (`full_cache=False`).

plain runs first and last; each kvviz run is printed as a multiple of the mean of the two, in
wall time and in CPU time (the process's own: steadier than wall time on a machine other jobs
share). `--runs NAME --lengths N` runs one of them alone, for a peak-memory reading by
`/usr/bin/time -v` (one process per run: the peak resident set never goes down).
"""
from __future__ import annotations

import argparse
import sys
import time

RUNS = ("plain", "hf-masked", "hf-freed", "generate-masked", "generate-freed")


def timed(fn) -> tuple[float, float, list]:
    """(wall seconds, CPU seconds of this process, the new tokens) of one run."""
    wall, cpu = time.perf_counter(), time.process_time()
    new = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, new


def runner(pair, ids: list[int], name: str, policy: str, budget: int, new: int):
    """A callable doing run `name` (RUNS) on `ids`, returning its new token ids."""
    import torch

    tok, mdl = pair
    dev = next(mdl.parameters()).device
    x = torch.tensor([ids], device=dev)

    def hf_generate():
        with torch.no_grad():
            out = mdl.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
        return out[0, len(ids):].tolist()

    if name == "plain":
        def run():
            previous = mdl.config._attn_implementation
            mdl.set_attn_implementation("sdpa")
            try:
                return hf_generate()
            finally:
                mdl.set_attn_implementation(previous)
        return run
    kind, eviction = name.split("-")
    if kind == "hf":
        import kvviz.hf

        def run():
            with kvviz.hf.evicting(mdl, policy=policy, budget=budget, eviction=eviction):
                return hf_generate()
        return run
    from kvviz.model.loop import LoopConfig, generate
    from kvviz.model.loop.config import parse_policy

    cfg = LoopConfig(*parse_policy(policy), budget)
    return lambda: generate(ids, [cfg], new, granularity="kv-head", prompt_mode="prefill", model=pair,
                            stop_at_eos=False, eviction=eviction, full_cache=False).new_ids[0].tolist()


def measure(pair, length: int, policy: str, budget: int, new: int, names=RUNS, log=print) -> dict:
    """{name: (wall s, CPU s, new ids)} for `names` at `length`, plain first and again last."""
    from kvviz.studies.cache_perf import prompt_ids

    ids = prompt_ids(pair, length)
    order = list(names) + (["plain"] if "plain" in names and len(names) > 1 else [])
    out = {}
    for name in order:
        key = name if name not in out else "plain again"
        out[key] = timed(runner(pair, ids, name, policy, budget, new))
        log(f"{length} tokens, {key}: {out[key][0]:.1f} s wall, {out[key][1]:.1f} s CPU")
    return out


def table(results: dict) -> str:
    lines = [f"{'tokens':>7}  {'run':<16}{'wall s':>8}{'CPU s':>8}{'x plain wall':>14}{'x plain CPU':>13}  new tokens"]
    for length, runs in results.items():
        plain = [runs[k] for k in ("plain", "plain again") if k in runs]
        base_w = sum(r[0] for r in plain) / len(plain) if plain else None
        base_c = sum(r[1] for r in plain) / len(plain) if plain else None
        for name, (w, c, ids) in runs.items():
            ratio = (("", "") if base_w is None or name.startswith("plain")
                     else (f"{w / base_w:.2f}x", f"{c / base_c:.2f}x"))
            lines.append(f"{length:>7}  {name:<16}{w:>8.1f}{c:>8.1f}{ratio[0]:>14}{ratio[1]:>13}  {ids}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvviz.studies.hf_cost", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 8184], help="prompt lengths in tokens")
    p.add_argument("--policy", default="tova", help="the one configuration's policy (NAME[:k=v,...])")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--new", type=int, default=8, help="new tokens per run (EOS ignored)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="which runs (default all; one alone for /usr/bin/time -v's peak memory)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one: what these figures assume)")
    args = p.parse_args(argv)
    try:
        if args.budget < 1 or args.budget >= min(args.lengths):
            raise ValueError(f"--budget must be in 1..{min(args.lengths) - 1} (below every length), got {args.budget}")
        if args.new < 1:
            raise ValueError(f"--new must be >= 1, got {args.new}")
        from kvviz.model.loop.config import LoopConfig, parse_policy

        LoopConfig(*parse_policy(args.policy), args.budget)
        import torch

        from kvviz.model.models import load_model

        torch.set_num_threads(args.threads)
        pair = load_model(None, "hf_cost")
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(args.runs))
    results = {n: measure(pair, n, args.policy, args.budget, args.new, names,
                          log=lambda s: print(s, file=sys.stderr, flush=True)) for n in args.lengths}
    print(f"hf_cost: {pair[1].kvviz_provenance.get('model', 'model')}, {args.threads} thread(s), {args.policy} at "
          f"budget {args.budget}, kv-head granularity, {args.new} new tokens, the pass-key prompt")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
