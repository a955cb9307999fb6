"""The studies' cost from their run files: per cell (task and option, prompt mode,
granularity), the prompts, the configurations per prompt, the median seconds per prompt
(a run's generate-batch seconds over the prompts read in that batch) and their sum; the
first and last run file's times. What docs/benchmarks.md quotes.

    python -m lab.studies.cost                 # traces/studies/recall, span, vartrack
    python -m lab.studies.cost traces/studies/span
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("recall", "span", "span-amend", "vartrack")


def cells(folder: Path) -> dict:
    out: dict = {}
    for f in sorted((folder / "runs").glob("*.npz")):
        with np.load(f, allow_pickle=False) as z:
            m = json.loads(str(z["meta"]))
        opt = next((m.get(k) for k in ("returns", "hops", "phrase_words", "reminder_every")
                    if m.get(k) is not None), "")
        key = (m.get("task", "passkey"), opt, m["prompt_mode"], m["granularity"])
        c = out.setdefault(key, {"prompts": 0, "configs": len(m["configs"]), "seconds": [],
                                 "first": f.stat().st_mtime, "last": f.stat().st_mtime})
        c["prompts"] += 1
        c["seconds"].append(m["seconds"] / m.get("batch_prompts", 1))
        c["first"], c["last"] = min(c["first"], f.stat().st_mtime), max(c["last"], f.stat().st_mtime)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folders = [Path(a) for a in argv] or [ROOT / "traces" / "studies" / f for f in FOLDERS]
    print("| folder | task | mode | granularity | prompts | configurations per prompt | median s per prompt | sum s |")
    print("|---|---|---|---|---|---|---|---|")
    total = 0.0
    for d in folders:
        if not (d / "runs").is_dir():
            continue
        for (task, opt, mode, gran), c in cells(d).items():
            total += sum(c["seconds"])
            print(f"| {d.name} | {task} {opt} | {mode} | {gran} | {c['prompts']} | {c['configs']} | "
                  f"{statistics.median(c['seconds']):.1f} | {sum(c['seconds']):,.0f} |")
    print(f"\n{total:,.0f} s of prompts in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
