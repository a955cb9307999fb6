"""`python -m kvviz loop --perf`: what the loop's policy bookkeeping and batching cost.

Figures, not a timed test: (1) the model's own decode (eager attention, DynamicCache, no
masking) at batch N and 1; (2) the loop with its N configs (`perf_configs`: full, every
registered policy at its defaults and the variants, each the budget admits; their labels
are printed) at `budget`, layer and kv-head granularity: its forward (masked attention) and its policy bookkeeping per
token, averaged over the steps after the first eviction; (3) the loop with 1 config (the
full cache alone). Wall time, on a machine other jobs may share: read ratios, not absolutes.
"""
from __future__ import annotations

import time

import numpy as np

from kvviz.model.loop.cli import Progress, perf_configs

TEXT_NAME = "execmodel.txt"  # a shipped source, found by kvviz.core.paths.source_file


def plain_decode(mdl, ids, batch: int, progress=None) -> np.ndarray:
    """Seconds per step of the unmodified model (eager attention) decoding `ids` at `batch`."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=mdl.config)
    out = np.zeros(len(ids))
    dev = next(mdl.parameters()).device
    for t, i in enumerate(ids):
        s = time.perf_counter()
        with torch.no_grad():
            logits = mdl(input_ids=torch.full((batch, 1), i, dtype=torch.long, device=dev),
                         position_ids=torch.full((batch, 1), t, dtype=torch.long, device=dev),
                         cache=cache, use_cache=True).logits
            logits[:, -1, :1].cpu()  # the loop's one host copy per step (and a GPU sync)
        out[t] = time.perf_counter() - s
        if progress is not None:
            progress(t + 1, len(ids))
    return out


def main(tokens: int = 384, budget: int = 256, device: str = "cpu", dtype: str = "float32") -> int:
    import sys

    from kvviz.model.capture import require_stack
    from kvviz.model.loop.engine import run, tokenize
    from kvviz.model.models import load_model

    if tokens <= budget + 16:
        print(f"error: --perf-tokens must exceed the budget by more than 16, got {tokens} <= {budget} + 16",
              file=sys.stderr)
        return 2
    try:
        configs, left_out = perf_configs(budget)
        for line in left_out:
            print(f"left out: {line}", file=sys.stderr)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        require_stack("loop --perf")
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from kvviz.core.paths import source_file

    try:
        TEXT = source_file(TEXT_NAME)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        tok, mdl = load_model(None, "loop --perf", device, dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = TEXT.read_text(encoding="utf-8")
    ids = tokenize(tok, text, tokens)
    after = slice(budget + 1, len(ids))  # steps where every policy evicts
    rows = []

    def ms(x):
        return 1000 * float(np.mean(x[after]))

    n = len(configs)
    plain = {b: ms(plain_decode(mdl, ids, b, Progress(f"perf plain decode x{b}"))) for b in (1, n)}
    for gran in ("layer", "kv-head"):
        tm = {}
        run(text, configs, granularity=gran, max_tokens=tokens, rows_layers=(), timings=tm,
            model=(tok, mdl), progress=Progress(f"perf {gran} x{len(configs)}"))
        rows.append((gran, len(configs), ms(tm["model"]), ms(tm["bookkeeping"])))
    tm = {}
    run(text, configs[:1], granularity="layer", max_tokens=tokens, rows_layers=(), timings=tm,
        model=(tok, mdl), progress=Progress("perf layer x1"))
    rows.append(("layer", 1, ms(tm["model"]), ms(tm["bookkeeping"])))
    where = f"{next(mdl.parameters()).device} {next(mdl.parameters()).dtype}".replace("torch.", "")
    print(f"perf: {len(ids)} tokens of {TEXT.name}, budget {budget}, means over steps {budget + 1}.."
          f"{len(ids) - 1} (every policy evicting); wall ms per token; {where}")
    print(f"configs ({n}): {', '.join(c.label for c in configs)}")
    print(f"model's own decode (eager, no masking): batch 1 {plain[1]:.1f} ms, batch {n} {plain[n]:.1f} ms")
    print(f"{'granularity':<12}{'configs':>8}{'loop forward':>14}{'bookkeeping':>13}"
          f"{'book/decode':>13}{'book/forward':>14}")
    for gran, k, fwd, book in rows:
        base = plain[k]
        print(f"{gran:<12}{k:>8}{fwd:>14.1f}{book:>13.1f}{book / base:>13.1%}{book / fwd:>14.1%}")
    total_n = rows[0][2] + rows[0][3]
    total1 = rows[2][2] + rows[2][3]
    print(f"batch efficiency (layer): {n} configs {total_n:.1f} ms/token vs 1 config {total1:.1f} ms/token "
          f"= {total_n / total1:.2f}x (target <= 3x)")
    print(f"targets: bookkeeping <= 25% of decode (layer, {n} configs), <= 50% (kv-head)")
    return 0
