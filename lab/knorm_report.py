"""Print the knorm / average-pooling companion study's figures (docs/studies/loop.md quotes them).

    .venv/bin/python -m lab.knorm_report --dir out/knorm-study [--csv out/knorm.csv]

Reads the `<text>-kv-head.json` files that `lab/loop_ship.py --policies ...` wrote and
prints, per text and budget, each configuration's perplexity after the first eviction as a
ratio to the full cache's over the same tokens, and its KL to the full cache.
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path


def rows(folder: Path) -> list[dict]:
    out = []
    for path in sorted(folder.glob("*-kv-head.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        for r in d["results"]:
            if r["policy"] == "full":
                continue
            ratio = r["perplexity_after_eviction"] / r["full_perplexity_after_eviction"]
            out.append({"text": d["text"], "n_tokens": d["n_tokens"], "label": r["label"],
                        "policy": r["policy"], "budget": r["budget"], "ratio_to_full": ratio,
                        "kl_after_eviction": r["kl_after_eviction"],
                        "top1_after_eviction": r["top1_agreement_after_eviction"]})
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--csv")
    args = p.parse_args()
    table = rows(Path(args.dir))
    if not table:
        raise SystemExit(f"no *-kv-head.json in {args.dir}")
    short = {}
    for r in table:
        name = r["label"].split("@")[0]
        short[name] = (name.replace("snapkv(obs_window=16,pool_kernel=5,recent_window=32,pooling=", "snapkv-")
                       .replace(")", "").replace("streaming-llm(sinks=4", "streaming-llm"))
    names = list(dict.fromkeys(r["label"].split("@")[0] for r in table))
    print("perplexity after the first eviction / full cache's (KL in brackets), per KV head")
    print(f"{'text':6} {'budget':>6} " + " ".join(f"{short[n]:>22}" for n in names))
    for text in dict.fromkeys(r["text"] for r in table):
        for b in sorted({r["budget"] for r in table}):
            cells = {r["label"].split("@")[0]: r for r in table if r["text"] == text and r["budget"] == b}
            print(f"{text:6} {b:>6} " + " ".join(
                f"{cells[n]['ratio_to_full']:>12.3f} ({cells[n]['kl_after_eviction']:.3f})" for n in names))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
