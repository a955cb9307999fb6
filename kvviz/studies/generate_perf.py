"""`python -m kvviz generate --perf`: what generation under eviction costs.

Figures, not a timed test. A prompt of `tokens` tokens of a shipped text, then `new`
generated tokens (EOS ignored) per run: 8 configs (full + 7 policies at `budget`) against
the full cache alone, in both prompt modes, layer granularity. Printed: seconds to read the
prompt, ms per generated token, the bookkeeping's share of the model's time, and the two
targets (8 configs <= 3x one; prefill reads the prompt >= 5x faster than decode). Wall
time, on a machine other jobs may share: read ratios, not absolutes.
"""
from __future__ import annotations

import sys

from kvviz.model.loop.cli import Progress, perf_configs
from kvviz.studies.loop_perf import TEXT_NAME


def main(tokens: int = 512, budget: int = 128, new: int = 32, device: str = "cpu", dtype: str = "float32") -> int:
    from kvviz.core.paths import source_file
    from kvviz.model.capture import require_stack
    from kvviz.model.models import load_model

    if tokens <= budget:
        print(f"error: --perf-tokens must exceed the budget, got {tokens} <= {budget}", file=sys.stderr)
        return 2
    try:
        configs, left_out = perf_configs(budget)
        configs = configs[:8]
        for line in left_out:
            print(f"left out: {line}", file=sys.stderr)
        require_stack("generate --perf")
        text = source_file(TEXT_NAME).read_text(encoding="utf-8")
        tok, mdl = load_model(None, "generate --perf", device, dtype)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from kvviz.model.loop import generate
    from kvviz.model.models import tokenize

    ids = tokenize(tok, text, tokens)[0]
    runs = {}
    for mode in ("decode", "prefill"):
        for cfgs in (configs, configs[:1]):
            runs[mode, len(cfgs)] = generate(ids, cfgs, new, prompt_mode=mode, model=(tok, mdl), stop_at_eos=False,
                                             progress=Progress(f"perf {mode} x{len(cfgs)}", command="generate"))
    where = f"{next(mdl.parameters()).device} {next(mdl.parameters()).dtype}".replace("torch.", "")
    print(f"generate --perf: {len(ids)}-token prompt of {TEXT_NAME}, {new} new tokens, budget {budget}, "
          f"layer granularity; {where}")
    n = len(configs)
    print(f"configs ({n}): {', '.join(c.label for c in configs)}")
    print(f"{'mode':<9}{'configs':>8}{'prompt s':>10}{'ms/new token':>14}{'model s':>9}{'book s':>8}{'book/model':>12}")
    per_token = {}
    for (mode, n), g in runs.items():
        m = g.meta
        per_token[mode, n] = 1000 * m["generation_seconds"] / (new - 1)  # the first token comes with the prompt
        print(f"{mode:<9}{n:>8}{m['prompt_seconds']:>10.2f}{per_token[mode, n]:>14.1f}{m['model_seconds']:>9.2f}"
              f"{m['bookkeeping_seconds']:>8.2f}{m['bookkeeping_seconds'] / m['model_seconds']:>12.1%}")
    for mode in ("decode", "prefill"):
        whole = {k: runs[mode, k].meta["prompt_seconds"] + runs[mode, k].meta["generation_seconds"] for k in (n, 1)}
        print(f"{n} configs vs 1 ({mode}): whole run {whole[n]:.1f} s vs {whole[1]:.1f} s = "
              f"{whole[n] / whole[1]:.2f}x, per new token {per_token[mode, n] / per_token[mode, 1]:.2f}x "
              "(target <= 3x)")
    dec, pre = runs["decode", n].meta["prompt_seconds"], runs["prefill", n].meta["prompt_seconds"]
    print(f"reading the prompt, {n} configs: decode {dec:.1f} s, prefill {pre:.2f} s = {dec / pre:.1f}x faster "
          "(target >= 5x)")
    return 0
