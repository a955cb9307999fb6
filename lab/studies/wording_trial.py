"""The returns task's reminder wording, tried on the full cache before the study: every
wording in WORDINGS on the 24 haystacks at depth 50, seed 0 (the study's seeds start at 1),
256 tokens, three returns; the full cache's answers (prefill mode, beside TOVA at 128, whose
answers are not used). The wording the study uses is the one the full cache answers most
often; every wording's figure is written to traces/studies/wording/trial.csv. It ran with
the returns at 54-70 % of the prompt (kvviz.model.needle.tasks.RETURNS_AT = (0.70, 0.08),
snapped up to 8 tokens), the geometry of the time; re-run today it uses the current one.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m lab.studies.wording_trial
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvviz.model.needle import tasks

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "traces" / "studies" / "wording"
WORDINGS = ("Keep the pass key in mind.", "Remember the pass key.", "Do not forget the number above.")


def main() -> int:
    import pandas as pd

    from kvviz.model.needle.cli import read_haystacks
    from kvviz.model.needle.grid import Grid
    from kvviz.model.needle.run import run_grid

    hays = read_haystacks(ROOT / "traces" / "haystacks")
    rows = []
    for i, w in enumerate(WORDINGS):
        tasks.RETURN = w
        grid = Grid(lengths=[256], depths=[50], seeds=[0], policies=["tova"], budgets=[128],
                    prompt_modes=["prefill"], task=tasks.Task("returns", returns=3), haystacks=list(hays))
        df = run_grid(grid, f"/tmp/kvviz-wording/{i}", haystack=hays, progress=False)
        full = df[df["policy"] == "full"]
        rows.append({"wording": w, "prompts": len(full), "full_cache_right": int(full["correct"].sum())})
        print(rows[-1], file=sys.stderr)
    OUT.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(OUT / "trial.csv", index=False)
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
