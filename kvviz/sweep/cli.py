"""`python -m kvviz sweep SPEC.toml --out DIR [--workers N] [--ray local|auto|ADDRESS]`
and `python -m kvviz sweep --bench`."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from .run import run_sweep
from .spec import SpecError
from .store import SweepDirError

BENCH_BUDGETS = [64, 128, 256, 512, 768]
BENCH_LAYERS = [0, 14, 29]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvviz sweep",
                                description="Run a grid of replay cells; re-running resumes.")
    p.add_argument("spec", nargs="?", help="sweep spec (TOML); see docs/sweeps.md")
    p.add_argument("--out", help="results folder (cells/, results.parquet, results.csv)")
    p.add_argument("--workers", type=int, default=None,
                   help="local process pool of N workers (with --ray local: Ray's CPUs)")
    p.add_argument("--ray", default=None, metavar="local|auto|ADDRESS",
                   help="run cells as Ray tasks: start a local Ray, or join a cluster")
    p.add_argument("--retry-failed", action="store_true", help="run failed cells again")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--bench", action="store_true",
                   help="time the 270-cell replay sweep serially and with 2 workers")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.bench:
        return bench(args.ray)
    if not args.spec or not args.out:
        p.error("give a spec and --out DIR (or --bench)")
    try:
        df = run_sweep(args.spec, args.out, workers=args.workers, ray=args.ray,
                       retry_failed=args.retry_failed, progress=not args.quiet)
    except (SpecError, SweepDirError) as exc:
        p.error(str(exc))
    failed = int((df["status"] != "ok").sum())
    print(f"{len(df)} cells, {failed} failed -> {Path(args.out) / 'results.csv'}"
          + (" and results.parquet" if (Path(args.out) / "results.parquet").exists() else ""))
    return 0


def bench_spec() -> dict:
    root = Path(__file__).resolve().parents[2] / "traces"
    from ..policies import POLICIES

    return {"traces": [str(root / f"{n}.npz") for n in ("prose", "code", "table")],
            "layers": BENCH_LAYERS, "budgets": BENCH_BUDGETS,
            "policies": [{"name": n} for n in POLICIES]}


def bench(ray: str | None = None) -> int:
    """Wall time of the 270-cell sweep serially and on 2 workers (and on Ray if asked),
    each into a fresh folder; the tables must be equal."""
    import os

    spec = bench_spec()
    times = {}
    tables = {}
    runs = [("serial", {}), ("2 workers", {"workers": 2})]
    if ray:
        runs.append((f"ray {ray}, 2 CPUs", {"ray": ray, "workers": 2}))
    with tempfile.TemporaryDirectory() as tmp:
        for label, kw in runs:
            start = time.perf_counter()
            tables[label] = run_sweep(spec, Path(tmp) / label.replace(" ", "_"), progress=False, **kw)
            times[label] = time.perf_counter() - start
    cells = len(tables["serial"])
    print(f"replay sweep: {cells} cells (6 policies x {len(BENCH_BUDGETS)} budgets x 3 shipped "
          f"traces x {len(BENCH_LAYERS)} layers), {os.cpu_count()} CPUs on this machine")
    serial = times["serial"]
    for label, t in times.items():
        n = 1 if label == "serial" else 2
        same = tables[label].equals(tables["serial"])
        print(f"  {label:>18}: {t:7.1f} s  {cells / t:6.1f} cells/s  speedup {serial / t:4.2f}  "
              f"efficiency {serial / t / n:4.2f}  table identical to serial: {same}")
    try:
        from .. import streams
    except ImportError:
        streams = None
    if streams is not None and hasattr(streams, "bench"):
        print("per-step cost (kvviz.streams.bench):")
        print(streams.bench())
    return 0


if __name__ == "__main__":
    sys.exit(main())
