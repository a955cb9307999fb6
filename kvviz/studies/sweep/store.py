"""The sweep folder: the spec it belongs to, one file per finished cell, the table.

DIR/spec.json     the normalised spec, its hash and each trace's SHA-256
DIR/cells/N.json  one finished cell (its row), written to a temp file and renamed, so a
                  killed sweep leaves only whole cells behind
DIR/results.parquet, DIR/results.csv   assembled from the cell files, in cell order
DIR/policies.json one record per policy the spec names: {name: {origin, where, sha256}}
                  (kvviz.core.plugins.provenance: built-in, entry point, file or module), so the
                  table says where each policy came from without its code

Only the driver writes here (workers return values), so there is one writer and no locks.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from kvviz.core.atomic import replacing
from kvviz.core.paths import version
from kvviz.core.policies import param_specs
from kvviz.studies.sweep.cell import METRICS
from kvviz.studies.sweep.model_spec import ModelCell
from kvviz.studies.sweep.spec import Cell, TraceInfo, spec_hash

FORMAT = 1


class SweepDirError(ValueError):
    """DIR belongs to another sweep."""


def write_atomic(path: Path, data: bytes) -> None:
    with replacing(path) as fh:
        fh.write(data)


def prepare(out: Path, spec: dict, traces: dict[str, TraceInfo]) -> None:
    """Create DIR for this spec, or check that DIR already holds this spec's sweep."""
    record = {"kvviz_sweep": FORMAT, "hash": spec_hash(spec), "spec": spec,
              "trace_sha256": {k: t.sha256 for k, t in traces.items()}}
    path = out / "spec.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("hash") != record["hash"]:
            raise SweepDirError(
                f"--out {out} holds a sweep of another spec (hash {str(old.get('hash'))[:12]}, "
                f"this spec {record['hash'][:12]}); refusing to mix them: use another --out")
        for key, sha in record["trace_sha256"].items():
            if old.get("trace_sha256", {}).get(key) != sha:
                raise SweepDirError(f"traces = {key!r} changed since the sweep in {out} began "
                                    f"(SHA-256 {sha[:12]}); refusing to mix results: use another --out")
    elif (out / "cells").is_dir() and any((out / "cells").glob("*.json")):
        raise SweepDirError(f"--out {out} holds cell files but no spec.json; use another --out")
    (out / "cells").mkdir(parents=True, exist_ok=True)
    for stale in (out / "cells").glob("*.tmp"):  # a temp file of a killed run
        stale.unlink(missing_ok=True)
    if not path.exists():
        write_atomic(path, json.dumps(record, indent=1, sort_keys=True).encode())


def write_policies(out: Path, names) -> Path:
    """DIR/policies.json: where each policy in `names` came from (rewritten on every run, so
    an edited plugin's new hash is recorded with the cells it re-ran)."""
    from kvviz.core.plugins import provenance

    record = {name: provenance(name) for name in dict.fromkeys(names) if name != "full"}
    path = out / "policies.json"
    write_atomic(path, json.dumps(record, indent=1, sort_keys=True).encode())
    return path


def cell_path(out: Path, cell: Cell) -> Path:
    return out / "cells" / f"{cell.index:06d}.json"


def finished(out: Path, cells: list[Cell], retry_failed: bool = False) -> set[int]:
    """Indices whose cell file is there (and, with retry_failed, did not fail)."""
    done = set()
    for cell in cells:
        path = cell_path(out, cell)
        if path.exists():
            saved = json.loads(path.read_text())
            if saved["key"] == cell.key() and not (retry_failed and saved["row"]["status"] != "ok"):
                done.add(cell.index)
    return done


def make_row(cell: Cell, info: TraceInfo, metrics: dict | None, error: str | None) -> dict:
    if isinstance(cell, ModelCell):
        return model_row(cell, info, metrics, error)
    return {"trace": cell.trace, "layer": cell.layer, "head": cell.head, "policy": cell.policy,
            "budget": cell.budget, "params": dict(cell.params),
            **{m: (metrics or {}).get(m) for m in METRICS},
            "status": "ok" if error is None else "error", "error": error or "",
            "kvviz_version": version(), "trace_sha256": info.sha256, "model": info.model}


def model_row(cell: ModelCell, info: TraceInfo, metrics: dict | None, error: str | None) -> dict:
    """A model cell's row (kvviz.studies.sweep.model_cell.columns); budget -1 for full, as kvviz needle writes it."""
    from kvviz.studies.sweep import model_cell as M

    ident = dict(zip(M.IDENTITY[cell.mode][2:], cell.unit[:]) if cell.mode == "needle"
                 else zip(M.IDENTITY[cell.mode][1:], cell.unit))
    if cell.mode == "needle":
        ident = {"id": cell.item, **ident}
    metrics = metrics or {}
    return {"text": cell.text, **ident, "policy": cell.policy, "label": cell.config().label,
            "params": json.dumps(dict(cell.params), sort_keys=True),
            "budget": -1 if cell.budget is None else cell.budget,
            **{m: metrics.get(m) for m in M.METRICS[cell.mode]},
            "status": "ok" if error is None else "error", "error": error or "",
            "kvviz_version": version(), "text_sha256": info.sha256, "model": metrics.get("model")}


def save_cell(out: Path, cell: Cell, row: dict) -> None:
    write_atomic(cell_path(out, cell), json.dumps({"key": cell.key(), "row": row}).encode())


def param_columns(spec: dict) -> dict[str, str]:
    """Parameter column -> its pandas dtype, from the first policy that declares it."""
    dtypes = {"int": "Int64", "float": "float64", "choice": "str", "str": "str", "bool": "boolean"}
    cols: dict[str, str] = {}
    for entry in spec["policies"]:
        for s in param_specs(entry["name"]):
            cols.setdefault(s.name, dtypes.get(s.kind, "object"))
        for scorer in entry.get("params", {}).get("scorer", []):  # an allocator's scorer's
            for s in param_specs(scorer):
                if s.name in entry["params"]:
                    cols.setdefault(s.name, dtypes.get(s.kind, "object"))
    return cols


def assemble(out: Path, spec: dict, cells: list[Cell]) -> pd.DataFrame:
    """The table, from the cell files alone, one row per cell in cell order."""
    if spec["mode"] != "replay":
        from kvviz.studies.sweep.model_cell import columns

        rows = [json.loads(cell_path(out, c).read_text())["row"] for c in cells]
        return pd.DataFrame(rows, columns=columns(spec["mode"]))
    params = param_columns(spec)
    rows = []
    for cell in cells:
        row = json.loads(cell_path(out, cell).read_text())["row"]
        p = row.pop("params")
        rows.append({**row, **{k: p.get(k) for k in params}})
    cols = ["trace", "layer", "head", "policy", "budget", *params, *METRICS, "status", "error",
            "kvviz_version", "trace_sha256", "model"]
    df = pd.DataFrame(rows, columns=cols)
    ratios = any(isinstance(c.budget, str) for c in cells)  # "0.25x": budgets as given, as text
    types = {"layer": "Int64", "budget": "str" if ratios else "int64", "memory_bytes": "Int64",
             **params,
             **{m: "float64" for m in METRICS if m != "memory_bytes"}}
    return df.astype(types)


def write_table(out: Path, df: pd.DataFrame) -> list[Path]:
    """results.csv always; results.parquet when pyarrow is installed."""
    written = [out / "results.csv"]
    write_atomic(written[0], df.to_csv(index=False).encode())
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return written
    with replacing(out / "results.parquet") as fh:
        df.to_parquet(fh, index=False, engine="pyarrow")
    return written + [out / "results.parquet"]
