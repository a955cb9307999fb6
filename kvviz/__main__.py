"""`kvviz bench | perf | capture | loop | generate | needle | app | sweep | check | lesson | export ...`
(or `python -m kvviz ...` from a checkout)."""
from __future__ import annotations

import argparse
import sys

from kvviz.core.plugins import add_argument as plugin_arg


def _bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="metrics table: policies x budgets")
    bench.add_argument("--trace", help=".npz trace file (default: the canonical trace)")
    bench.add_argument("--layer", type=int, default=None,
                       help="model layer number stored in --trace, e.g. 29 (default: the first stored)")
    bench.add_argument("--head", default=None,
                       help="head label stored in --trace: mean, kv0.., q0.. (default: mean)")
    bench.add_argument("--budgets", default="256,512,1024",
                       help="comma-separated budgets: slot counts, or ratios of the tokens seen (0.25x)")
    bench.add_argument("--policies", default=None,
                       help="comma-separated policy names or name:k=v specs, e.g. "
                            "tova,adakv:scorer=snapkv,poolKernel=3 (default all)")
    bench.add_argument("--pool-kernels", default=None,
                       help="snapkv once per poolKernel, e.g. 1,3,5,7 (default: its default only)")
    bench.add_argument("--spans", action="store_true",
                       help="add span integrity columns (important attention spans at the last step)")
    bench.add_argument("--csv", help="also write the table as CSV here")
    bench.add_argument("--json", help="also write the table as JSON here")
    plugin_arg(bench)
    bench.set_defaults(func=_bench_perf, parser=bench)


def _perf_parser(sub) -> None:
    perf = sub.add_parser("perf", help="replay speed against the reference, and a long run's memory")
    perf.add_argument("--budget", type=int, default=512)
    perf.add_argument("--steps", type=int, default=4096)
    perf.add_argument("--long-steps", type=int, default=65536, help="0 skips the long run")
    perf.add_argument("--policies", default=None,
                      help="comma-separated policy names or name:k=v specs, plugins' included, e.g. "
                           "tova,snapkv:poolKernel=3 (default all)")
    perf.add_argument("--streams", nargs="?", const="1,3,9,27", default=None, metavar="S,...",
                      help="instead: per stream-step cost of the lean loop, Replay and run_streams "
                           "at these stream counts (kvviz.studies.streams_bench)")
    plugin_arg(perf)
    perf.set_defaults(func=_bench_perf, parser=perf)


def _study(module: str):
    """A study's `main`, imported only when its command runs (studies load pandas)."""
    def call(*args, **kwargs):
        import importlib

        return importlib.import_module(module).main(*args, **kwargs)
    return call


# the commands whose modules add their own node, in the order --help lists them
COMMANDS = (
    ("capture", "kvviz.model.capture"),
    ("loop", "kvviz.model.loop.cli"),
    ("generate", "kvviz.model.loop.generate_cli"),
    ("needle", "kvviz.model.needle.cli"),
    ("calibrate", "kvviz.model.calibrate"),
    ("app", "kvviz.app.launch"),
    ("sweep", "kvviz.studies.sweep.cli"),
    ("check", "kvviz.core.check"),
    ("lesson", "kvviz.app.teach.cli"),
    ("export", "kvviz.studies.export"),
)
PERF = {"loop": "kvviz.studies.loop_perf", "generate": "kvviz.studies.generate_perf"}


def _refused(sub, command: str, line: str) -> None:
    """A command whose part is not installed: listed, and any use of it prints `line`."""
    node = sub.add_parser(command, help=line, add_help=False)

    def refuse(args) -> int:
        print(line, file=sys.stderr)
        return 2
    node.set_defaults(func=refuse, parser=node, passes_unknown=True)


def parser() -> argparse.ArgumentParser:
    """The one tree: each command's module adds its node (importing none of torch, ray,
    streamlit or hypothesis: those load inside its `run`). A command whose part needs an extra
    that is not installed (`kvviz app` without Streamlit) stays listed and refuses in one line."""
    import importlib

    from kvviz.core.extras import refusal

    tree = argparse.ArgumentParser(prog="kvviz")
    sub = tree.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    _perf_parser(sub)
    for command, name in COMMANDS:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            line = refusal(exc, f"kvviz {command}")
            if line is None:
                raise
            _refused(sub, command, line)
            continue
        if command in PERF:
            module.parser(sub, perf=_study(PERF[command]))
        else:
            module.parser(sub)
    return tree


def main(argv=None) -> int:
    args, extra = parser().parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if extra:  # only `kvviz app` takes flags it does not know: they are Streamlit's
        if not getattr(args, "passes_unknown", False):
            args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.extra = extra
    try:
        return args.func(args)
    except ImportError as exc:  # a package of an extra that is not installed: one line, no traceback
        from kvviz.core.extras import refusal

        line = refusal(exc, f"kvviz {args.command}")
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


def _bench_perf(args) -> int:
    parser = args.parser
    from kvviz.core.plugins import cli_load

    if cli_load(args.plugin, f"kvviz {args.command}"):
        return 2

    from kvviz.core.cli import one_line_error
    from kvviz.core.policies.base import BudgetError
    from kvviz.studies import bench as b  # numpy only: its tables print and write themselves

    try:
        return _bench_perf_run(args, parser, b)
    except BudgetError as exc:  # a policy broke the harness's rules mid-run: one line, no usage
        one_line_error(str(exc))


def _bench_perf_run(args, parser, b) -> int:
    from kvviz.core.policies.base import BudgetError

    if args.command == "bench":
        try:
            trace = b.open_trace(args.trace, args.layer, args.head)
            budgets = b.parse_budgets(args.budgets)
            policies = b.policy_list(args.policies) if args.policies else None
            kernels = [int(x) for x in args.pool_kernels.split(",")] if args.pool_kernels else None
            results = b.table(trace, budgets, policies, kernels, args.spans)
        except BudgetError:
            raise
        except ValueError as exc:
            parser.error(str(exc))
        print(b.describe(trace, results))
        for budget in budgets:
            if b.resolve(budget, trace.steps) >= trace.steps:
                print(f"warning: budget {budget} is at least the trace length ({trace.steps} "
                      "steps): nothing is ever evicted, so its rows (evicts False) score "
                      "perfectly by construction")
        print(results.to_string(float_format=lambda v: f"{v:.4f}"))
        for line in getattr(results, "notes", ()):
            print(line)
        if args.csv:
            results.to_csv(args.csv)
        if args.json:
            results.to_json(args.json)
        return 0
    if args.command == "perf" and args.streams:
        from kvviz.studies.streams_bench import bench as streams_bench
        print(f"canonical traces (seeds 0..S-1), {args.steps} steps, budget {args.budget}; rows "
              "pre-generated; CPU time per stream-step, best of 3 interleaved rounds; ratio to the lean loop")
        streams_bench(args.budget, args.steps, streams=[int(x) for x in args.streams.split(",")])
        return 0
    if args.command == "perf":
        try:
            policies = b.policy_list(args.policies) if args.policies else None
            b.perf_specs(policies or ())  # refused before the long run
        except ValueError as exc:
            parser.error(str(exc))
        if args.long_steps:  # first, so the process's peak RSS is the long run's own
            print(f"long run: {b.long_run(args.long_steps, 1024)}")
        results = b.perf(args.budget, args.steps, policies)
        print(f"canonical trace, {args.steps} steps, budget {args.budget}; rows pre-generated; "
              "best of 3 for the fast replay, one reference replay")
        print(results.to_string(float_format=lambda v: f"{v:.3f}"))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
