"""The driver: validate the whole spec, then run only the cells not finished yet."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

from kvviz.core.plugins import PluginError, load_plugins, worker_specs
from kvviz.studies.sweep import engines, store
from kvviz.studies.sweep.progress import Progress
from kvviz.studies.sweep.spec import load


def run_sweep(spec, out, *, workers: int | None = None, ray: str | None = None,
              base=".", retry_failed: bool = False, progress: bool = True, stream=None,
              plugins=()) -> pd.DataFrame:
    """Run a sweep into `out` and return its table (also written as results.csv/.parquet).

    `spec` is a TOML path or an already-parsed dict; trace paths are relative to `base`.
    Engines: serial (default), a process pool (`workers` > 1), Ray (`ray` = "local",
    "auto" or an address; `workers` sets a local Ray's CPUs). Re-running resumes.
    `plugins`: plugin specs to load first (kvviz.core.plugins); workers load every plugin the
    spec's policies come from, however it was registered here.
    """
    refused = load_plugins(plugins)
    if refused:
        raise PluginError(refused[0])
    spec, traces, cells = load(spec, Path(base))  # SpecError before anything runs or is written
    names = [e["name"] for e in spec["policies"]]
    names += [v for e in spec["policies"] for v in e.get("params", {}).get("scorer", [])]  # allocators'
    sent = worker_specs(names)  # PluginError: no file to send
    if ray and importlib.util.find_spec("ray") is None:
        raise ValueError("--ray needs Ray: pip install 'kvviz[scale]' (in a checkout: "
                         "pip install -r requirements-scale.txt)")
    out = Path(out)
    store.prepare(out, spec, traces)
    store.write_policies(out, names)
    finished = store.finished(out, cells, retry_failed)
    todo = [c for c in cells if c.index not in finished]
    failed = sum(1 for c in cells if c.index in finished and _status(out, c) != "ok")
    bar = Progress(len(cells), len(finished), failed, stream) if progress else None

    def done(cell, metrics, error):
        store.save_cell(out, cell, store.make_row(cell, traces[cell.trace], metrics, error))
        if bar:
            bar.update(error is None)

    if todo:
        if ray:
            engines.ray_engine(todo, traces, done, ray, workers, sent)
        elif workers and workers > 1:
            engines.pool(todo, traces, done, workers, sent)
        else:
            engines.serial(todo, traces, done)
    df = store.assemble(out, spec, cells)
    store.write_table(out, df)
    return df


def _status(out, cell) -> str:
    import json

    return json.loads(store.cell_path(out, cell).read_text())["row"]["status"]
