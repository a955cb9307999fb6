"""`python -m kvviz sweep SPEC.toml --out DIR [--workers N] [--ray local|auto|ADDRESS]`
and `python -m kvviz sweep --bench`."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvviz.core.plugins import add_argument as add_plugin_argument
from kvviz.core.plugins import cli_load

BENCH_BUDGETS = [64, 128, 256, 512, 768]
BENCH_LAYERS = [0, 14, 29]


def parser(sub=None) -> argparse.ArgumentParser:
    """`kvviz sweep`'s options: its own parser, or (given `sub`) its node in kvviz's tree."""
    kw = dict(prog="python -m kvviz sweep", description="Run a grid of replay cells; re-running resumes.")
    p = (sub.add_parser("sweep", help="run a grid of cells from a TOML spec, resumable (docs/sweeps.md)", **kw)
         if sub is not None else argparse.ArgumentParser(**kw))
    p.add_argument("spec", nargs="?", help="sweep spec (TOML); see docs/sweeps.md")
    p.add_argument("--out", help="results folder (cells/, results.parquet, results.csv)")
    p.add_argument("--workers", type=int, default=None,
                   help="local process pool of N workers (with --ray local: Ray's CPUs)")
    p.add_argument("--ray", default=None, metavar="local|auto|ADDRESS",
                   help="run cells as Ray tasks: start a local Ray, or join a cluster")
    p.add_argument("--retry-failed", action="store_true", help="run failed cells again")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--bench", action="store_true",
                   help="time the 270-cell replay sweep serially and with 2 workers")
    add_plugin_argument(p)
    p.set_defaults(func=run, parser=p)
    return p


def main(argv=None) -> int:
    return run(parser().parse_args(argv))


def run(args) -> int:
    # here, not at the top: `kvviz`'s tree imports this module for its parser, and the
    # driver loads pandas, which `kvviz check` and `kvviz bench` do without
    from kvviz.studies.sweep.cell import PluginLoadError
    from kvviz.studies.sweep.engines import WorkerLost
    from kvviz.studies.sweep.run import run_sweep

    p = args.parser
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if cli_load(args.plugin, "python -m kvviz sweep"):
        return 2
    if args.bench:
        try:
            return bench(args.ray)
        except ValueError as exc:
            print(f"python -m kvviz sweep: error: {exc}", file=sys.stderr)
            return 2
    if not args.spec or not args.out:
        p.error("give a spec and --out DIR (or --bench)")
    try:
        df = run_sweep(args.spec, args.out, workers=args.workers, ray=args.ray,
                       retry_failed=args.retry_failed, progress=not args.quiet)
    except ValueError as exc:  # SpecError, SweepDirError, --ray without Ray: one line
        print(f"python -m kvviz sweep: error: {exc}", file=sys.stderr)
        return 2
    except PluginLoadError as exc:
        print(f"python -m kvviz sweep: error: {exc}", file=sys.stderr)
        return 2
    except WorkerLost as exc:
        print(f"python -m kvviz sweep: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: finished cells are saved; re-run the same command to resume",
              file=sys.stderr)
        return 130
    failed = df["status"] != "ok"
    print(f"{len(df)} cells, {int(failed.sum())} failed -> {Path(args.out) / 'results.csv'}"
          + (" and results.parquet" if (Path(args.out) / "results.parquet").exists() else ""))
    if failed.any():
        first = df[failed].iloc[0]
        print(f"python -m kvviz sweep: {int(failed.sum())} of {len(df)} cells failed; first "
              f"({first['policy']} at budget {first['budget']} on {first.get('trace', first.get('text'))}): "
              f"{first['error']}", file=sys.stderr)
        return 1
    return 0


def bench_spec() -> dict:
    from kvviz.core.paths import traces_dir
    from kvviz.core.policies import POLICIES

    root = traces_dir()
    if root is None:
        raise ValueError("--bench needs the shipped traces (a checkout, or KVVIZ_TRACES_DIR)")

    return {"traces": [str(root / f"{n}.npz") for n in ("prose", "code", "table")],
            "layers": BENCH_LAYERS, "budgets": BENCH_BUDGETS,
            "policies": [{"name": n} for n, cls in POLICIES.items()  # the three texts carry
                         if not (cls.reads_key_norms or cls.reads_value_norms  # no norms,
                                 or cls.reads_keys or cls.reads_queries)]}  # no key or query vectors


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the pool's workers)."""
    import resource

    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench(ray: str | None = None) -> int:
    """Wall and CPU time of the 270-cell sweep serially and on 2 workers (and on Ray if
    asked), each into a fresh folder; the tables must be equal. Wall time is what the
    efficiency uses; CPU time shows what parallelism costs when the machine is busy."""
    import os

    from kvviz.studies.sweep.run import run_sweep

    spec = bench_spec()
    times, cpus, tables = {}, {}, {}
    runs = [("serial", {}), ("2 workers", {"workers": 2})]
    if ray:
        runs.append((f"ray {ray}, 2 CPUs", {"ray": ray, "workers": 2}))
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for label, kw in runs:
            cpu, start = _cpu(), time.perf_counter()
            tables[label] = run_sweep(spec, Path(tmp) / label.replace(" ", "_").replace(",", ""),
                                      progress=False, **kw)
            times[label], cpus[label] = time.perf_counter() - start, _cpu() - cpu
    cells = len(tables["serial"])
    print(f"replay sweep: {cells} cells ({len(spec['policies'])} policies x {len(BENCH_BUDGETS)} budgets x 3 shipped "
          f"traces x {len(BENCH_LAYERS)} layers); {os.cpu_count()} CPUs, load average "
          f"{load0:.1f} before, {os.getloadavg()[0]:.1f} after")
    serial = times["serial"]
    for label, t in times.items():
        n = 1 if label == "serial" else 2
        cpu = "n/a (Ray workers)" if label.startswith("ray") else f"{cpus[label]:.1f} s"
        same = tables[label].equals(tables["serial"])
        print(f"  {label:>18}: wall {t:7.1f} s ({cells / t:5.1f} cells/s), CPU {cpu}, "
              f"speedup {serial / t:4.2f}, efficiency {serial / t / n:4.2f}, "
              f"table identical to serial: {same}")
    try:
        from kvviz.studies import streams_bench
    except ImportError:
        streams_bench = None
    if streams_bench is not None and hasattr(streams_bench, "bench"):
        print("per stream-step cost, TOVA at budget 512 on 4,096 canonical steps "
              "(kvviz.studies.streams_bench; all of it: python -m kvviz perf --streams):")
        cost = streams_bench.bench(512, 4096, policies=("tova",), streams=(1, 3),
                                   progress=None)
        print(cost.to_string(float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
