"""`kvviz export RESULT --format csv|parquet --out FILE`: a saved result as one long, tidy table.

RESULT is a loop result (.npz of `kvviz loop`), a generation (.json of `kvviz generate`), a
needle run (DIR/runs/<id>.npz), a needle folder (its per-layer long table,
kvviz.model.needle.results.layer_table), or a trace with `--policy` and `--budget` (the
replay's Run). The tables are the results' `to_frame()` (kvviz.core.frame); none needs the
policies' code except the replay, which runs the policy. A loop result's position table
carries each token's nll, kl and top1_agreement; a needle folder's table each prompt's
answer, correct, outcome and full_cache_correct. An absent value is one kind of null in
every table (an empty CSV field, a Parquet null; never -1, never JSON in a cell), and `read`
gives a CSV back its column types. Parquet is written through pyarrow (the scale extra);
the file is written atomically.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from kvviz.core.cli import budget_arg

FORMATS = ("csv", "parquet")
# The types of the long tables' columns that a CSV's text does not carry (strings, nullable
# integers and booleans); a needle folder's table adds kvviz.model.needle.results.LAYER_TYPES.
TYPES = {"id": "string", "config": "string", "policy": "string", "head": "string", "token": "string",
         "label": "string", "budget": "Int64", "layer": "Int64", "evicted": "Int64", "top1_agreement": "boolean"}


def parser(sub=None) -> argparse.ArgumentParser:
    """`kvviz export`'s options: its own parser, or (given `sub`) its node in kvviz's tree."""
    kw = dict(prog="kvviz export", description="Write a saved result as one long, tidy table (CSV or Parquet).")
    p = (sub.add_parser("export", help="a saved result as a long table: csv or parquet", **kw)
         if sub is not None else argparse.ArgumentParser(**kw))
    p.add_argument("result", help="a loop .npz, a generation .json, a needle run .npz or folder, or a trace "
                                  "with --policy and --budget")
    p.add_argument("--format", choices=FORMATS, required=True, help="csv, or parquet (needs pyarrow)")
    p.add_argument("--out", required=True, help="the file to write")
    p.add_argument("--per", choices=("position", "step"), default="position",
                   help="one row per position (default), or per step x position before it")
    p.add_argument("--layers", default=None, help="comma-separated layers to keep (loop: model layer numbers; "
                                                  "generation and needle: indices)")
    p.add_argument("--policy", default=None, help="for a trace: the policy to replay, name or name:k=v")
    p.add_argument("--budget", type=budget_arg, default=None,
                   help="for a trace: the budget (slots, or a ratio of the tokens seen: 0.25x)")
    p.add_argument("--layer", type=int, default=None, help="for a trace: the stored model layer (as bench)")
    p.add_argument("--head", default=None, help="for a trace: the stored head label (as bench)")
    p.set_defaults(func=run, parser=p)
    return p


def _need_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ValueError("--format parquet needs pyarrow, which is not installed: pip install 'kvviz[scale]' "
                         "(in a checkout: pip install -r requirements-scale.txt), or use --format csv") from None


def _kind(path: Path) -> str:
    if path.is_dir():
        return "needle-folder"
    if not path.is_file():
        raise ValueError(f"result {path}: no such file or folder")
    if path.suffix == ".json":
        return "generation"
    if path.suffix != ".npz":
        raise ValueError(f"result {path}: expected a .npz, a .json or a needle folder")
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
    except (ValueError, OSError) as exc:
        raise ValueError(f"result {path}: not a readable .npz ({exc})") from None
    if meta.get("format") == "kvviz-loop":
        return "loop"
    if "key_positions" in meta:
        return "needle-run"
    return "trace"


def table(result, per: str = "position", layers=None, policy=None, budget=None, layer=None, head=None):
    """The long pandas DataFrame `kvviz export` writes for `result` (see the module)."""
    path = Path(result)
    kind = _kind(path)
    if kind != "trace" and (policy is not None or budget is not None):
        raise ValueError("--policy and --budget are for a trace; this result recorded its own")
    if kind == "loop":
        from kvviz.model.loop import load_loop_result

        return load_loop_result(path).to_frame(per=per, layers=layers)
    if kind == "generation":
        from kvviz.model.loop import load_generation

        return load_generation(path).to_frame(per=per, layers=layers)
    if kind == "needle-run":
        from kvviz.model.needle.results import read_run

        return read_run(path).to_frame(per=per, layers=layers)
    if kind == "needle-folder":
        from kvviz.model.needle.results import layer_table

        if per != "position" or layers is not None:
            raise ValueError("a needle folder exports its per-layer table; --per and --layers are for one "
                             "run (DIR/runs/<id>.npz)")
        return layer_table(path)
    from kvviz.core.replay import run_policy
    from kvviz.studies.bench import open_trace, parse_spec

    if policy is None or budget is None:
        raise ValueError(f"result {path} is a trace: give --policy and --budget to replay one")
    if layers is not None:
        raise ValueError("--layers is for a saved result; a trace replays one --layer")
    trace = open_trace(str(path), layer, head)
    name, params = parse_spec(policy)
    return run_policy(trace, name, budget, **params).to_frame(trace, per=per)


def write(df, out, fmt: str) -> Path:
    """`df` to `out` as csv or parquet, atomically."""
    from kvviz.core.atomic import replacing

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {fmt!r}")
    out = Path(out)
    if fmt == "parquet":
        _need_pyarrow()
        buf = io.BytesIO()
        df.to_parquet(buf, index=False, engine="pyarrow")
        data = buf.getvalue()
    else:
        data = df.to_csv(index=False).encode()
    with replacing(out) as fh:
        fh.write(data)
    return out


def read(path):
    """A table `kvviz export` wrote, back as a DataFrame with its column types (csv or parquet)."""
    import pandas as pd

    path = Path(path)
    if path.suffix == ".parquet":
        _need_pyarrow()
        return pd.read_parquet(path, engine="pyarrow")
    from kvviz.model.needle.results import LAYER_TYPES

    types = {**TYPES, **LAYER_TYPES}
    head = pd.read_csv(path, nrows=0).columns
    try:
        return pd.read_csv(path, keep_default_na=False, na_values=[""],
                           dtype={k: v for k, v in types.items() if k in head})
    except ValueError:  # a ratio budget ("0.25x") is text
        return pd.read_csv(path, keep_default_na=False, na_values=[""],
                           dtype={k: v for k, v in {**types, "budget": "string"}.items() if k in head})


def run(args) -> int:
    from kvviz.core.cli import one_line_error

    args.parser.error = one_line_error
    try:
        if args.format == "parquet":
            _need_pyarrow()  # before any work
        layers = None
        if args.layers:
            try:
                layers = [int(x) for x in args.layers.split(",")]
            except ValueError:
                raise ValueError(f"--layers must be comma-separated integers, got {args.layers!r}") from None
        df = table(args.result, args.per, layers, args.policy, args.budget, args.layer, args.head)
        out = write(df, args.out, args.format)
    except ValueError as exc:
        args.parser.error(str(exc))
    print(f"{len(df):,} rows x {len(df.columns)} columns -> {out}")
    return 0


def main(argv=None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
