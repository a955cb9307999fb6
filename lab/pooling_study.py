"""What does SnapKV's max-pooling buy on real text? `python -m lab.pooling_study`.

Replays each trace (the three shipped SmolLM2 traces, every stored layer, and the canonical
trace) through tova, snapkv at pool_kernel 1/3/5/7 (other parameters at their defaults),
h2o and streaming-llm, and reports retained mass, heavy-hitter recall (kvviz.core.metrics) and
span integrity (kvviz.core.spans) for word spans and attention spans.

Span integrity here is averaged over checkpoints rather than read at the last step only:
at every `every`-th step from the budget (the first step that can evict) to the end, the
important spans that exist are judged whole / fragmented / dropped, and the counts are
pooled over checkpoints. One final-step snapshot of ~20 spans is too noisy to rank by.
Results go to docs/studies/pooling.md; no torch needed.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import pandas as pd

from kvviz.core.atomic import replacing
from kvviz.core.metrics import summary
from kvviz.core.policies import config_label
from kvviz.core.replay import run_policy
from kvviz.core.spans import DEFAULT_TOP, attention_spans, important_spans, judge, received, word_spans
from kvviz.core.trace import canonical, load_trace

TRACES = ("prose", "code", "table", "canonical")  # shipped names (kvviz.core.paths) or .npz paths
BUDGETS = (64, 128, 256)
KERNELS = (1, 3, 5, 7)


def configs(kernels=KERNELS, poolings=("max",)):
    """(label, policy name, params) in table order, labelled by config_label with the
    kernel always shown ("snapkv (poolKernel=5, pooling=avg)"). `poolings` max and/or avg:
    SnapKV's pooling kind (k=1 pools nothing, so it has no avg row)."""
    snap = [("snapkv", {"pool_kernel": k, **({} if pooling == "max" else {"pooling": pooling})})
            for pooling in poolings for k in kernels if pooling == "max" or k > 1]
    return [(config_label(name, params, keep=("pool_kernel",)), name, params)
            for name, params in [("tova", {}), *snap, ("h2o", {}), ("streaming-llm", {})]]


def load_all(specs, all_layers=True, head=None):
    """[(trace name, layer, trace)] for 'canonical' or .npz paths (every stored layer, at
    `head`: a stored head label, default "mean"; the canonical trace has the mean only)."""
    out = []
    for spec in specs:
        if spec == "canonical":
            if head not in (None, "mean"):
                raise ValueError(f"head {head} is not stored in the canonical trace; "
                                 "stored heads: mean")
            out.append(("canonical", None, canonical()))
            continue
        if not spec.endswith(".npz"):
            from kvviz.core.paths import trace_file

            spec = str(trace_file(spec))
        first = load_trace(spec, head=head)
        for layer in first.layers if all_layers else first.layers[:1]:
            t = load_trace(spec, layer=layer, head=head)
            out.append((t.name, t.layer, t))
    return out


def integrity(trace, run, spans, totals, checkpoints, top=DEFAULT_TOP) -> dict:
    """Whole / fragmented / dropped shares pooled over checkpoint steps.

    Also `intact` = whole / (whole + fragmented), and `peak` = the share of fragmented spans
    that still hold their peak (the span's position with the most attention received): the
    card's "keeps only its peak" case. Counting follows kvviz.core.spans.span_integrity.
    """
    chosen = important_spans(spans, totals, top)
    peaks = [a + int(np.argmax(totals[a:b])) for a, b in chosen]
    counts = {"whole": 0, "fragmented": 0, "dropped": 0}
    peak_kept = 0
    for step in checkpoints:
        held = run.held_mask(step)
        for (a, b), peak in zip(chosen, peaks):
            if b - 1 > step:
                continue
            verdict = judge(held, a, b)
            counts[verdict] += 1
            peak_kept += verdict == "fragmented" and bool(held[peak])
    whole, frag, dropped = counts["whole"], counts["fragmented"], counts["dropped"]
    n = whole + frag + dropped
    nan = float("nan")
    return {"whole": whole / n if n else nan, "frag": frag / n if n else nan,
            "dropped": dropped / n if n else nan,
            "intact": whole / (whole + frag) if whole + frag else nan,
            "peak": peak_kept / frag if frag else nan}


def study(traces, budgets=BUDGETS, kernels=KERNELS, every=16, top=DEFAULT_TOP,
          log=lambda msg: None, poolings=("max",)) -> pd.DataFrame:
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
            for label, policy, params in configs(kernels, poolings):
                run = run_policy(trace, policy, budget, **params)
                row = {"trace": name, "layer": layer, "head": getattr(trace, "head", "mean"),
                       "policy": label, "budget": budget}
                m = summary(trace, run)
                row.update(retained_mass=m["retained_mass"], hh_recall=m["hh_recall"])
                for kind in ("words", "attn"):
                    res = (integrity(trace, run, span_sets[kind], totals, checkpoints, top)
                           if kind in span_sets
                           else dict.fromkeys(("whole", "frag", "dropped", "intact", "peak"), np.nan))
                    row.update({f"{kind}_{k}": v for k, v in res.items()})
                rows.append(row)
    return pd.DataFrame(rows)


def pivot(df: pd.DataFrame, value: str) -> pd.DataFrame:
    """policy x budget, averaged over the given rows (layers, traces)."""
    order = list(dict.fromkeys(df["policy"]))
    p = df.pivot_table(index="policy", columns="budget", values=value, aggfunc="mean")
    return p.reindex(order)


GROUPS = (("retained_mass", "hh_recall"), ("attn_whole", "attn_dropped", "attn_intact"),
          ("words_whole", "words_dropped", "words_intact"), ("attn_frag", "attn_peak"))


def markdown(df: pd.DataFrame) -> str:
    """The tables of docs/studies/pooling.md: real-text means, canonical, per-trace retained mass."""
    def table(part, values):
        cols = [part.pivot_table(index="policy", columns="budget", values=v)
                .rename(columns=lambda b, v=v: f"{v} @{b}") for v in values]
        p = pd.concat(cols, axis=1).reindex(list(dict.fromkeys(part["policy"])))
        lines = ["| policy | " + " | ".join(p.columns) + " |", "|---|" + "---:|" * len(p.columns)]
        lines += [f"| {i} | " + " | ".join("–" if pd.isna(v) else f"{v:.3f}" for v in r) + " |"
                  for i, r in p.iterrows()]
        return "\n".join(lines)

    out = []
    for title, part in (("Real text (mean over prose, code, table x layers 0, 14, 29)",
                         df[df["trace"] != "canonical"]),
                        ("Canonical trace", df[df["trace"] == "canonical"])):
        if not len(part):
            continue
        out.append(f"#### {title}\n")
        for values in GROUPS:
            if part[list(values)].notna().any().any():
                out += [table(part, values), ""]
    real = df[df["trace"] != "canonical"]
    if len(real):
        out.append("#### Retained mass per trace (mean over layers)\n")
        for name in dict.fromkeys(real["trace"]):
            out += [f"{name}:\n", table(real[real["trace"] == name], ("retained_mass",)), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.pooling_study", description=__doc__.split("\n")[0])
    parser.add_argument("--traces", default=",".join(TRACES),
                        help="comma-separated .npz paths and/or 'canonical'")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--kernels", default=",".join(map(str, KERNELS)))
    parser.add_argument("--pooling", default="max",
                        help="SnapKV pooling kinds: max (the card's), avg, or max,avg")
    parser.add_argument("--every", type=int, default=16, help="checkpoint spacing for span integrity")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="heavy positions defining important spans")
    parser.add_argument("--head", default=None,
                        help="stored head label to study (mean, kv0.., q0..; default mean)")
    parser.add_argument("--csv", help="also write the full table here")
    parser.add_argument("--markdown", help="also write the summary tables as markdown here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        traces = load_all(args.traces.split(","), head=args.head)
    except ValueError as exc:
        parser.error(str(exc))
    log(f"head: {args.head or 'mean'}")
    poolings = [p.strip() for p in args.pooling.split(",") if p.strip()]
    bad = [p for p in poolings if p not in ("max", "avg")]
    if bad or not poolings:
        parser.error(f"--pooling must list max and/or avg, got {args.pooling!r}")
    df = study(traces, [int(b) for b in args.budgets.split(",")],
               [int(k) for k in args.kernels.split(",")], args.every, args.top, log, poolings)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_rows", 500)
    fmt = lambda v: f"{v:.3f}"  # noqa: E731
    print(df.to_string(index=False, float_format=fmt))
    real = df[df["trace"] != "canonical"]
    for value in ("retained_mass", "hh_recall", "attn_whole", "attn_dropped", "attn_intact",
                  "attn_frag", "attn_peak", "words_whole", "words_dropped", "words_intact"):
        for label, part in (("real traces, mean over traces and layers", real),
                            ("canonical", df[df["trace"] == "canonical"])):
            if len(part) and part[value].notna().any():
                print(f"\n{value} ({label})")
                print(pivot(part, value).to_string(float_format=fmt))
    if args.csv:  # atomic, and the folder (e.g. out/) is made if missing
        with replacing(args.csv) as fh:
            fh.write(df.to_csv(index=False).encode())
    if args.markdown:
        with replacing(args.markdown) as fh:
            fh.write((markdown(df) + "\n").encode())
    log(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
