"""Run the pre-registered recall and span studies (lab/studies/PREREGISTRATION.md), cell by
cell in the registered order, each cell one `kvviz needle` command over the 24 haystacks of
traces/haystacks. Resumable: every command skips the prompts whose run file is already there
(kvviz.model.needle.run.done), so killing this and starting it again continues where it
stopped. After each cell (and at the end) it writes traces/studies/STATUS.md: per cell, the
prompts done of those planned, its seconds, the machine's load.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m lab.studies.run            # every cell
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m lab.studies.run --list     # the cells and commands
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m lab.studies.run --cells P1 S1.1   # some cells
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m lab.studies.run --status   # STATUS.md only

`--deadline HH:MM` (UTC) stops starting new cells after that time (a cell that runs past it
is left to finish its batch and is then stopped by the caller's kill; it resumes later).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HAY = "traces/haystacks"
COMMON = ["--haystacks", HAY, "--lengths", "256", "--seeds", "1", "--threads", "1", "--quiet"]
RECALL = ["--prompt-modes", "decode", "--granularity", "layer", "--max-new-tokens", "8", "--batch", "4"]
DECODE_POLICIES = ["--policies", "tova", "h2o", "scissorhands", "scissorhands:tie_break=attention"]
SPAN_POLICIES = ["--policies", "snapkv:poolKernel=1", "snapkv:poolKernel=3", "snapkv:poolKernel=5",
                 "snapkv:poolKernel=7", "--budgets", "64", "128"]
SPAN = ["--prompt-modes", "prefill", "--max-new-tokens", "16", "--batch", "8"]
BUDGET = "192"  # the recall study's budget (PREREGISTRATION.md)


@dataclass
class Cell:
    name: str      # the pre-registration's contrast it serves
    out: str       # its results folder under traces/studies/
    args: list     # the `kvviz needle` arguments beyond COMMON
    prompts: int   # planned

    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvviz", "needle", "--out", f"traces/studies/{self.out}", *COMMON, *self.args]


CELLS = [
    Cell("P1", "recall", ["--task", "returns", "--returns", "3", "--depths", "10", "50", "90", *DECODE_POLICIES,
                          "--budgets", BUDGET, *RECALL], 72),
    Cell("P2", "span", ["--task", "phrase", "--phrase-words", "8", "--depths", "10", "50", "90",
                        "--granularity", "layer", *SPAN_POLICIES, *SPAN], 72),
    Cell("S2.1", "span", ["--task", "phrase", "--phrase-words", "1", "--depths", "10", "50", "90",
                          "--granularity", "layer", *SPAN_POLICIES, *SPAN], 72),
    Cell("S1.1", "recall", ["--task", "returns", "--returns", "0", "--depths", "10", "50", "90",
                            "--policies", "tova", "h2o", "--budgets", BUDGET, *RECALL], 72),
    Cell("S2.spans", "span", ["--task", "phrase", "--phrase-words", "2", "--depths", "50",
                              "--granularity", "layer", *SPAN_POLICIES, *SPAN], 24),
    Cell("S2.spans4", "span", ["--task", "phrase", "--phrase-words", "4", "--depths", "50",
                               "--granularity", "layer", *SPAN_POLICIES, *SPAN], 24),
    Cell("S2.5", "span", ["--task", "phrase", "--phrase-words", "8", "--depths", "50",
                          "--granularity", "kv-head", *SPAN_POLICIES, *SPAN], 24),
    Cell("S2.5-1", "span", ["--task", "phrase", "--phrase-words", "1", "--depths", "50",
                            "--granularity", "kv-head", *SPAN_POLICIES, *SPAN], 24),
    Cell("A2", "span-amend", ["--task", "phrase", "--phrase-words", "8", "--depths", "10", "50", "90",
                              "--granularity", "layer", "--policies", "snapkv:poolKernel=1", "snapkv:poolKernel=3",
                              "snapkv:poolKernel=5", "snapkv:poolKernel=7", "--budgets", "160", "192", *SPAN], 72),
    Cell("S1.5-gate", "vartrack", ["--task", "vartrack", "--hops", "1", "--depths", "50", "--policies", "tova",
                                   "--budgets", BUDGET, "--prompt-modes", "prefill", "--batch", "8"], 24),
]


def prefix(cell: Cell) -> str:
    a = cell.args
    task = a[a.index("--task") + 1]
    opt = a[a.index("--task") + 3]
    gran = a[a.index("--granularity") + 1] if "--granularity" in a else "layer"
    mode = a[a.index("--prompt-modes") + 1] if "--prompt-modes" in a else "decode"
    return f"{task}{opt}-", f"-{mode}-{gran}"


def done(cell: Cell) -> int:
    folder = ROOT / "traces" / "studies" / cell.out / "runs"
    start, end = prefix(cell)
    depths = cell.args[cell.args.index("--depths") + 1:]
    depths = [d for d in depths[:next((i for i, x in enumerate(depths) if x.startswith("--")), len(depths))]]
    return sum(1 for p in folder.glob(f"{start}h*{end}.npz")
               if any(f"-d{d}-" in p.name for d in depths)) if folder.is_dir() else 0


def previous(path: Path) -> dict:
    """cell -> (seconds, load) as the last STATUS.md recorded them (kept for the cells not run now)."""
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            cols = [c.strip() for c in line.strip("|").split("|")]
            if len(cols) == 7 and cols[0] in {c.name for c in CELLS} and cols[5]:
                out[cols[0]] = (cols[5], cols[6])
    return out


def write_status(log: dict) -> None:
    path = ROOT / "traces" / "studies" / "STATUS.md"
    log = {**previous(path), **log}
    lines = ["# Study status", "",
             f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by `python -m lab.studies.run` (the cells of "
             "lab/studies/PREREGISTRATION.md, in its order). A cell short of its plan is partial: "
             "re-running the command resumes it.", "",
             "| cell | folder | prompts done | planned | status | seconds (the session that ran its prompts) | "
             "load (1 min) at its start |",
             "|---|---|---|---|---|---|---|"]
    for c in CELLS:
        n = done(c)
        sec, load = log.get(c.name, ("", ""))
        status = "complete" if n >= c.prompts else ("partial" if n else "not run")
        lines.append(f"| {c.name} | traces/studies/{c.out} | {n} | {c.prompts} | {status} | {sec} | {load} |")
    lines += ["", "Commands (each resumable):", ""]
    lines += [f"- {c.name}: `{shlex.join(['python', *c.command()[1:]])}`" for c in CELLS]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.studies.run", description=__doc__.splitlines()[0])
    p.add_argument("--cells", nargs="+", help="the cells to run (default: all, in order)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--status", action="store_true")
    p.add_argument("--deadline", help="HH:MM UTC: start no cell after it")
    args = p.parse_args(argv)
    cells = [c for c in CELLS if not args.cells or c.name in args.cells]
    if args.list:
        for c in cells:
            print(f"{c.name}: {done(c)}/{c.prompts}  {shlex.join(['python', *c.command()[1:]])}")
        return 0
    log: dict = {}
    if not args.status:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        for c in cells:
            if args.deadline and datetime.now(timezone.utc).strftime("%H:%M") >= args.deadline:
                print(f"{c.name}: past the deadline {args.deadline}, not started", file=sys.stderr)
                break
            load, t, before = os.getloadavg()[0], time.perf_counter(), done(c)
            print(f"{c.name}: {before}/{c.prompts} done; running", file=sys.stderr, flush=True)
            rc = subprocess.call(c.command(), cwd=ROOT, env=env)
            if done(c) > before:  # a resume that ran nothing keeps the seconds of the run that did
                log[c.name] = (f"{time.perf_counter() - t:.0f}", f"{load:.1f}")
            write_status(log)
            if rc != 0:
                print(f"{c.name}: exit status {rc}", file=sys.stderr)
                return rc
    write_status(log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
