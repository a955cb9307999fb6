"""Three ways to run the same cells: in this process, on a local process pool, on Ray.

Each engine calls `cell.compute` and hands every outcome (metrics or the exception) to
`done(cell, metrics, error)` in the driver, which writes the cell file. The outcome of a
cell does not depend on where it ran, so the tables are the same bit for bit.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import cell as C
from .spec import Cell, TraceInfo


class WorkerLost(RuntimeError):
    """A worker process died; finished cells are kept, re-running resumes."""


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _args(cell: Cell, info: TraceInfo):
    return (info.sha256, cell.trace, cell.layer, cell.head, cell.policy, cell.budget, cell.params)


def serial(cells: list[Cell], traces: dict[str, TraceInfo], done) -> None:
    for cell in cells:
        info = traces[cell.trace]
        try:
            metrics = C.compute(info.data, *_args(cell, info))
        except Exception as exc:  # recorded in the cell's row; the sweep goes on
            done(cell, None, describe(exc))
        else:
            done(cell, metrics, None)


def pool(cells: list[Cell], traces: dict[str, TraceInfo], done, workers: int) -> None:
    """concurrent.futures with spawned workers; every trace's bytes reach each worker once
    (the initializer), tasks carry only the cell."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    blobs = {t.sha256: t.data for t in traces.values() if t.data is not None}
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=C.set_blobs, initargs=(blobs,)) as ex:
        futures = {ex.submit(C.compute, None, *_args(c, traces[c.trace])): c for c in cells}
        try:
            for fut in as_completed(futures):
                try:
                    metrics = fut.result()
                except BrokenProcessPool as exc:
                    raise WorkerLost(f"a worker process died ({exc}); finished cells are saved, "
                                     "re-run the same command to resume") from None
                except Exception as exc:
                    done(futures[fut], None, describe(exc))
                else:
                    done(futures[fut], metrics, None)
        except BaseException:
            ex.shutdown(wait=False, cancel_futures=True)
            raise


def ray_engine(cells: list[Cell], traces: dict[str, TraceInfo], done, address: str,
               workers: int | None) -> None:
    """Cells are Ray tasks. Each trace file goes into the object store once (ray.put) and
    tasks take it by reference. Ray retries a task whose worker died (max_retries); an
    exception from the cell itself is deterministic, so it is recorded, not retried."""
    import ray
    from ray.exceptions import RayError, RayTaskError

    started = not ray.is_initialized()
    if started:
        if address == "local":
            ray.init(num_cpus=workers or os.cpu_count(), include_dashboard=False,
                     log_to_driver=False)
        else:  # a running cluster: ship this kvviz so every node runs the same code
            kvviz_dir = str(Path(C.__file__).resolve().parents[1])
            ray.init(address=address, log_to_driver=False,
                     runtime_env={"py_modules": [kvviz_dir], "excludes": ["__pycache__"]})
    try:
        task = ray.remote(max_retries=3, retry_exceptions=False)(C.compute)
        refs = {t.sha256: ray.put(t.data) for t in traces.values() if t.data is not None}
        pending = {task.remote(refs.get(traces[c.trace].sha256), *_args(c, traces[c.trace])): c
                   for c in cells}
        while pending:
            ready, rest = ray.wait(list(pending), num_returns=1)
            if rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                ready += more
            for ref in ready:
                cell = pending.pop(ref)
                try:
                    metrics = ray.get(ref)
                except RayTaskError as exc:  # the cell raised: record the original exception
                    done(cell, None, describe(exc.cause if exc.cause is not None else exc))
                except RayError as exc:  # retries exhausted (worker or node lost)
                    done(cell, None, describe(exc))
                else:
                    done(cell, metrics, None)
    finally:
        if started:
            ray.shutdown()
