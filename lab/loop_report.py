"""The tables of docs/studies/loop.md, and its CSV, from the shipped loop results.

    python -m lab.loop_report [--dir traces/loop] [--csv OUT.csv]   # print (and write OUT.csv)
    python -m lab.loop_report --write                                # also rewrite docs/studies/loop.csv

No torch. Adds to every closed-loop row the replay's retained mass for the same policy,
parameters and budget: the shipped head-mean trace of the same text (traces/NAME.npz),
cut to the loop's token count, replayed at each of its layers 0, 14 and 29, averaged.
Prints markdown tables and the figures the four questions need.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from kvviz.core.metrics import retained_mass
from kvviz.core.paths import traces_or_default
from kvviz.core.policies import config_label
from kvviz.core.replay import Replay
from kvviz.core.trace import ArrayTrace, load_trace
from kvviz.model.loop import LoopConfig
from lab import REPO, STUDIES

KEEP = ("pool_kernel", "sinks")  # the parameters the report compares, named even at their default


def short(policy: str, params: dict) -> str:
    """The row's configuration label (config_label) from the parameters in KEEP only: the
    report's columns are policies, SnapKV's kernels and StreamingLLM's sinks."""
    return config_label(policy, {k: v for k, v in params.items() if k in KEEP}, keep=KEEP)


TOVA, H2O, SCISSORS, RANDOM = "tova", "h2o", "scissorhands", "random"
PK1, PK5 = (short("snapkv", {"pool_kernel": k}) for k in (1, 5))
SINKS4, SINKS0 = (short("streaming-llm", {"sinks": n}) for n in (4, 0))


def shipped_layers(name: str, steps: int) -> list[ArrayTrace]:
    """The shipped trace's stored layers, each cut to `steps` rows (index or model-layer API)."""
    path = traces_or_default() / f"{name}.npz"
    first = load_trace(path)
    out = []
    for i, layer in enumerate(first.layers):
        try:
            tr = load_trace(path, layer=layer)
            if tr.layer != layer:
                raise ValueError
        except ValueError:
            tr = load_trace(path, layer=i)
        out.append(ArrayTrace(tr._packed, steps, name=tr.name, layers=tr.layers, layer=layer))
    return out


def replay_mass(traces, cfg: LoopConfig) -> float:
    return float(np.mean([retained_mass(Replay(tr, cfg.make(0, 0)).run()) for tr in traces]))


def frame(folder: Path) -> pd.DataFrame:
    rows, cache = [], {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        name, T = data["text"], data["n_tokens"]
        if name not in cache:
            cache[name] = shipped_layers(name, T)
        for r in data["results"]:
            cfg = LoopConfig(r["policy"], r["params"], r["budget"])
            rows.append({
                "text": name, "granularity": r["granularity"], "n_tokens": T, "policy": r["policy"],
                "short": short(r["policy"], r["params"]),
                "params": ";".join(f"{k}={v}" for k, v in r["params"].items()),
                "budget": r["budget"], "perplexity": r["perplexity"],
                "perplexity_after_eviction": r["perplexity_after_eviction"],
                "full_perplexity_after_eviction": r["full_perplexity_after_eviction"],
                "top1_agreement": r["top1_agreement"], "kl": r["kl"],
                "top1_agreement_after_eviction": r["top1_agreement_after_eviction"],
                "kl_after_eviction": r["kl_after_eviction"], "first_eviction": r["first_eviction"],
                "replay_retained_mass": None if cfg.is_full else replay_mass(cache[name], cfg),
                "seconds": data["seconds"],
            })
    df = pd.DataFrame(rows)
    df["budget"] = df["budget"].astype("Int64")
    df["first_eviction"] = df["first_eviction"].astype("Int64")
    return df


def spearman(a, b) -> float:
    return float(pd.Series(a).rank().corr(pd.Series(b).rank()))


def report(df: pd.DataFrame) -> None:
    ev = df[df.policy != "full"].copy()
    order = [TOVA, H2O, PK1, PK5, SINKS4, SINKS0, SCISSORS, RANDOM]
    for gran in ("layer", "kv-head"):
        sub = ev[ev.granularity == gran]
        if sub.empty:
            continue
        piv = sub.pivot_table(index=["text", "budget"], columns="short", values="perplexity_after_eviction")
        full = sub.groupby(["text", "budget"]).full_perplexity_after_eviction.first()
        piv.insert(0, "full", full)
        print(f"\n### perplexity after the first eviction, {gran} granularity\n")
        cols = ["full"] + [c for c in order if c in piv.columns]
        print("| text | budget | " + " | ".join(cols) + " |")
        print("|---|---:|" + "---:|" * len(cols))
        for (text, b), row in piv[cols].iterrows():
            print(f"| {text} | {b} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
        mass = sub.pivot_table(index=["text", "budget"], columns="short", values="replay_retained_mass")
        print("\n### replay retained mass (shipped head-mean traces, layers 0/14/29 averaged)\n")
        cols2 = [c for c in order if c in mass.columns]
        print("| text | budget | " + " | ".join(cols2) + " |")
        print("|---|---:|" + "---:|" * len(cols2))
        for (text, b), row in mass[cols2].iterrows():
            print(f"| {text} | {b} | " + " | ".join(f"{row[c]:.3f}" for c in cols2) + " |")
        print(f"\n### Spearman(replay retained mass, closed-loop perplexity after eviction), {gran}\n")
        for (text, b), g in sub.groupby(["text", "budget"]):
            rho = spearman(g.replay_retained_mass, g.perplexity_after_eviction)
            rm = g.replay_retained_mass.rank(ascending=False)
            pp = g.perplexity_after_eviction.rank()
            off = [f"{s} (mass #{int(a)}, ppl #{int(p)})" for s, a, p in zip(g.short, rm, pp) if abs(a - p) >= 3]
            print(f"- {text} {b}: rho = {rho:+.2f}; rank gaps >= 3: {', '.join(off) or 'none'}")


def answers(df: pd.DataFrame) -> None:
    """The figures the four questions quote: ratios to full, win counts, pk5 against pk1."""
    ev = df[df.policy != "full"]
    print("\n### figures for the answers\n")
    for gran in ("layer", "kv-head"):
        sub = ev[ev.granularity == gran]
        if sub.empty:
            continue
        ppl = sub.pivot_table(index=["text", "budget"], columns="short",
                              values="perplexity_after_eviction")
        full = sub.groupby(["text", "budget"]).full_perplexity_after_eviction.first()
        print(f"{gran}:")
        for col in (SINKS0, SINKS4):
            r = ppl[col] / full
            print(f"  {col} / full: " + ", ".join(f"{t} {b} x{v:.2f}" for (t, b), v in r.items()))
        for other in (H2O, SINKS4, PK1):
            wins = int((ppl[TOVA] < ppl[other]).sum())
            print(f"  tova beats {other} in {wins} of {len(ppl)}: " + ", ".join(
                f"{t} {b} {a:.2f}/{o:.2f}" for (t, b), a, o in zip(ppl.index, ppl[TOVA], ppl[other])))
        worse = int((ppl[PK5] > ppl[PK1]).sum())
        rel = (ppl[PK5] / ppl[PK1] - 1) * 100
        print(f"  {PK5} worse than {PK1} in {worse} of {len(ppl)}: " + ", ".join(
            f"{t} {b} {v:+.1f}%" for (t, b), v in rel.items()))
        best = ppl.drop(columns=[SINKS0, RANDOM]).idxmin(axis=1)
        print("  best policy: " + ", ".join(f"{t} {b} {v}" for (t, b), v in best.items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.loop_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=str(traces_or_default() / "loop"))
    p.add_argument("--csv", help="write every row here")
    p.add_argument("--write", action="store_true", help="write every row to docs/studies/loop.csv")
    args = p.parse_args(argv)
    df = frame(Path(args.dir))
    for path in [args.csv] * bool(args.csv) + [REPO / STUDIES / "loop.csv"] * args.write:
        df.to_csv(path, index=False, float_format="%.6g")
        print(f"wrote {path}: {len(df)} rows")
    report(df)
    answers(df)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
