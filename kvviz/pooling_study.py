"""What does SnapKV's max-pooling buy on real text? `python -m kvviz.pooling_study`.

Replays each trace (the three shipped SmolLM2 traces, every stored layer, and the canonical
trace) through tova, snapkv at pool_kernel 1/3/5/7 (other parameters at their defaults),
h2o and streaming-llm, and reports retained mass, heavy-hitter recall (kvviz.metrics) and
span integrity (kvviz.spans) for word spans and attention spans.

Span integrity here is averaged over checkpoints rather than read at the last step only:
at every `every`-th step from the budget (the first step that can evict) to the end, the
important spans that exist are judged whole / fragmented / dropped, and the counts are
pooled over checkpoints. One final-step snapshot of ~20 spans is too noisy to rank by.
Results go to docs/pooling.md; no torch needed.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import pandas as pd

from .metrics import summary
from .replay import run_policy
from .spans import DEFAULT_TOP, attention_spans, received, span_integrity, word_spans
from .trace import canonical, load_trace

TRACES = ("traces/prose.npz", "traces/code.npz", "traces/table.npz", "canonical")
BUDGETS = (64, 128, 256)
KERNELS = (1, 3, 5, 7)


def configs(kernels=KERNELS):
    """(label, policy name, params) in table order."""
    out = [("tova", "tova", {})]
    out += [(f"snapkv k={k}", "snapkv", {"pool_kernel": k}) for k in kernels]
    out += [("h2o", "h2o", {}), ("streaming-llm", "streaming-llm", {})]
    return out


def load_all(specs, all_layers=True):
    """[(trace name, layer, trace)] for 'canonical' or .npz paths (every stored layer)."""
    out = []
    for spec in specs:
        if spec == "canonical":
            out.append(("canonical", None, canonical()))
            continue
        first = load_trace(spec)
        indices = range(len(first.layers)) if all_layers else [0]
        for i in indices:
            t = load_trace(spec, layer=i)
            out.append((t.name, t.layer, t))
    return out


def integrity(trace, run, spans, totals, checkpoints, top=DEFAULT_TOP) -> dict:
    """Whole / fragmented / dropped shares pooled over checkpoint steps."""
    counts = np.zeros(3)
    for step in checkpoints:
        r = span_integrity(trace, run, spans=spans, top=top, step=step, totals=totals)
        if r["n_spans"]:
            counts += r["n_spans"] * np.array([r["whole"], r["fragmented"], r["dropped"]])
    n = counts.sum()
    out = dict(zip(("whole", "frag", "dropped"), counts / n if n else [np.nan] * 3))
    touched = counts[0] + counts[1]
    # whole given at least partly held: "is a kept phrase kept whole, or only its peak?"
    out["intact"] = counts[0] / touched if touched else np.nan
    return out


def study(traces, budgets=BUDGETS, kernels=KERNELS, every=16, top=DEFAULT_TOP,
          log=lambda msg: None) -> pd.DataFrame:
    rows = []
    for name, layer, trace in traces:
        totals = received(trace)
        span_sets = {"attn": attention_spans(trace, totals=totals)}
        if trace.tokens is not None:
            span_sets["words"] = word_spans(trace.tokens)
        log(f"{name} layer {layer}: {trace.steps} steps, "
            + ", ".join(f"{len(v)} {k} spans" for k, v in span_sets.items()))
        for budget in budgets:
            checkpoints = list(range(budget, trace.steps, every)) + [trace.steps - 1]
            for label, policy, params in configs(kernels):
                run = run_policy(trace, policy, budget, **params)
                row = {"trace": name, "layer": layer, "policy": label, "budget": budget}
                m = summary(trace, run)
                row.update(retained_mass=m["retained_mass"], hh_recall=m["hh_recall"])
                for kind in ("words", "attn"):
                    res = (integrity(trace, run, span_sets[kind], totals, checkpoints, top)
                           if kind in span_sets else dict.fromkeys(("whole", "frag", "dropped", "intact"), np.nan))
                    row.update({f"{kind}_{k}": v for k, v in res.items()})
                rows.append(row)
    return pd.DataFrame(rows)


def pivot(df: pd.DataFrame, value: str) -> pd.DataFrame:
    """policy x budget, averaged over the given rows (layers, traces)."""
    order = list(dict.fromkeys(df["policy"]))
    p = df.pivot_table(index="policy", columns="budget", values=value, aggfunc="mean")
    return p.reindex(order)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvviz.pooling_study", description=__doc__.split("\n")[0])
    parser.add_argument("--traces", default=",".join(TRACES),
                        help="comma-separated .npz paths and/or 'canonical'")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--kernels", default=",".join(map(str, KERNELS)))
    parser.add_argument("--every", type=int, default=16, help="checkpoint spacing for span integrity")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="heavy positions defining important spans")
    parser.add_argument("--csv", help="also write the full table here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    traces = load_all(args.traces.split(","))
    df = study(traces, [int(b) for b in args.budgets.split(",")],
               [int(k) for k in args.kernels.split(",")], args.every, args.top, log)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_rows", 500)
    fmt = lambda v: f"{v:.3f}"  # noqa: E731
    print(df.to_string(index=False, float_format=fmt))
    real = df[df["trace"] != "canonical"]
    for value in ("retained_mass", "hh_recall", "attn_whole", "attn_dropped", "attn_intact",
                  "words_whole", "words_dropped", "words_intact"):
        for label, part in (("real traces, mean over traces and layers", real),
                            ("canonical", df[df["trace"] == "canonical"])):
            if len(part) and part[value].notna().any():
                print(f"\n{value} ({label})")
                print(pivot(part, value).to_string(float_format=fmt))
    if args.csv:
        df.to_csv(args.csv, index=False)
    log(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
