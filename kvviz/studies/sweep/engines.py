"""Three ways to run the same tasks: in this process, on a local process pool, on Ray.

A task is a group of cells sharing a trace file, a policy configuration and a budget
(`group`). Each engine calls `cell.compute` and hands every cell's outcome (metrics or an
error) to `done(cell, metrics, error)` in the driver, which writes the cell file. The
outcome does not depend on where it ran, so the tables are the same bit for bit.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from kvviz.studies.sweep import cell as C
from kvviz.studies.sweep import model_cell as M
from kvviz.studies.sweep.model_spec import ModelCell
from kvviz.studies.sweep.spec import Cell, TraceInfo


class WorkerLost(RuntimeError):
    """A worker process died; finished cells are kept, re-running resumes."""


def _model(cells) -> bool:
    return isinstance(cells[0], ModelCell)


def group(cells: list[Cell]) -> list[list[Cell]]:
    """Cells that differ only in layer and head (replay), or in configuration (a model
    task: one prompt or text), in the order of their first cell."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        k = (c.trace, c.item, c.unit) if isinstance(c, ModelCell) else (c.trace, c.policy, c.params, c.budget)
        groups.setdefault(k, []).append(c)
    return list(groups.values())


def _compute(cells):
    return M.compute if _model(cells) else C.compute


def _args(cells: list[Cell], info: TraceInfo):
    c = cells[0]
    if _model(cells):
        return (info.sha256, c.mode, c.trace, c.unit, c.batch)
    return (info.sha256, c.trace, [(x.layer, x.head) for x in cells], c.policy, c.budget, c.params)


def _report(cells, outcomes, done) -> None:
    """A model task returns every configuration of its batch: each cell takes its slot's."""
    if _model(cells):
        outcomes = [outcomes[c.slot] for c in cells]
    for c, (metrics, error) in zip(cells, outcomes):
        done(c, metrics, error)


def _stop_if_refused(errors) -> None:
    errors = [e for e in errors if e]
    if errors:
        raise C.PluginLoadError(f"a worker could not load a plugin, no cell ran: {errors[0]}")


def serial(cells: list[Cell], traces: dict[str, TraceInfo], done, plugins=()) -> None:
    for task in group(cells):
        info = traces[task[0].trace]
        _report(task, _compute(task)(info.data, *_args(task, info)), done)


def pool(cells: list[Cell], traces: dict[str, TraceInfo], done, workers: int, plugins=()) -> None:
    """concurrent.futures with spawned workers; every trace's bytes and the driver's plugins
    reach each worker once (the initializer), tasks carry only their cells. With plugins,
    the workers are asked first whether they loaded them: a refusal stops the sweep before
    any cell runs (and a task on a worker that failed raises, stopping it too)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    blobs = {t.sha256: t.data for t in traces.values() if t.data is not None}
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=C.init_worker,
                             initargs=(blobs, os.getpid(), tuple(plugins))) as ex:
        if plugins:
            _stop_if_refused(ex.map(C.ensure_plugins, [tuple(plugins)] * workers))
        futures = {ex.submit(_compute(t), None, *_args(t, traces[t[0].trace]), tuple(plugins)): t
                   for t in group(cells)}
        try:
            for fut in as_completed(futures):
                try:
                    outcomes = fut.result()
                except C.PluginLoadError:
                    raise
                except BrokenProcessPool as exc:
                    raise WorkerLost(f"a worker process died ({exc}); finished cells are saved, "
                                     "re-run the same command to resume") from None
                _report(futures[fut], outcomes, done)
        except BaseException:
            ex.shutdown(wait=False, cancel_futures=True)
            raise


def ray_engine(cells: list[Cell], traces: dict[str, TraceInfo], done, address: str,
               workers: int | None, plugins=()) -> None:
    """Tasks are Ray tasks. Each trace file goes into the object store once (ray.put) and
    tasks take it by reference. Ray retries a task whose worker or node died (max_retries);
    a cell's own exception is caught and recorded in the worker (it is deterministic, so
    retrying it would only repeat it)."""
    import ray
    from ray.exceptions import RayError

    started = not ray.is_initialized()
    restore = _start_ray(ray, address, workers) if started else None
    try:
        if _model(cells):
            refs = {t.sha256: ray.put(t.data) for t in traces.values() if t.data is not None}
            return _ray_actors(ray, RayError, cells, traces, refs, done, workers, plugins)
        task = ray.remote(max_retries=3, retry_exceptions=False)(C.compute)
        if plugins:  # every task loads them too; this asks before any cell runs
            probe = ray.remote(C.ensure_plugins)
            n = workers or int(ray.cluster_resources().get("CPU", 1))
            _stop_if_refused(ray.get([probe.remote(tuple(plugins)) for _ in range(n)]))
        refs = {t.sha256: ray.put(t.data) for t in traces.values() if t.data is not None}
        pending = {}
        for t in group(cells):
            info = traces[t[0].trace]
            pending[task.remote(refs.get(info.sha256), *_args(t, info), tuple(plugins))] = t
        while pending:
            ready, rest = ray.wait(list(pending), num_returns=1)
            if rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                ready += more
            for ref in ready:
                cells_of = pending.pop(ref)
                try:
                    outcomes = ray.get(ref)
                except C.PluginLoadError as exc:
                    raise C.PluginLoadError(str(getattr(exc, "cause", None) or exc)) from None
                except RayError as exc:  # retries exhausted (worker or node lost)
                    outcomes = [(None, C.describe(exc))] * len(cells_of)
                _report(cells_of, outcomes, done)
    finally:
        if started:
            ray.shutdown()
            restore()


def _ray_actors(ray, RayError, cells, traces, refs, done, workers, plugins) -> None:
    """Model tasks: one actor per worker (the model loads once in each and stays), each
    given the next task when it returns one. Ray restarts a dead actor and retries its task."""
    import json

    tasks = group(cells)
    n = min(len(tasks), workers or max(1, int(ray.cluster_resources().get("CPU", 1))))
    actor = ray.remote(num_cpus=1, max_restarts=2, max_task_retries=2)(M.Worker)
    actors = [actor.remote(tuple(plugins)) for _ in range(n)]
    try:
        if plugins:
            _stop_if_refused(ray.get([a.probe.remote() for a in actors]))
        queue, pending = list(tasks), {}

        def give(a):
            if queue:
                t = queue.pop(0)
                info = traces[t[0].trace]
                pending[a.compute.remote(refs.get(info.sha256), *_args(t, info), tuple(plugins))] = (t, a)

        for a in actors:
            give(a)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            t, a = pending.pop(ready[0])
            try:
                outcomes = ray.get(ready[0])
            except C.PluginLoadError as exc:
                raise C.PluginLoadError(str(getattr(exc, "cause", None) or exc)) from None
            except RayError as exc:  # restarts and retries exhausted
                outcomes = [(None, C.describe(exc))] * len(json.loads(t[0].batch)["configs"])
            _report(t, outcomes, done)
            give(a)
    finally:
        for a in actors:
            ray.kill(a)


_TOKEN: list[str] = []  # one per process: Ray's token loader caches the first it reads


def _local_ray_env() -> tuple[str, dict]:
    """A temporary folder for a local Ray's session files, and a token held in memory for
    the token authentication Ray turns on for a new local cluster: Ray would otherwise
    write one to ~/.ray/auth_token (docs/sweeps.md). A user's own RAY_AUTH_* settings win."""
    import secrets
    import tempfile

    if not _TOKEN:
        _TOKEN.append(secrets.token_hex(32))
    env = {}
    if not any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        env["RAY_AUTH_TOKEN"] = _TOKEN[0]
    base = tempfile.gettempdir()
    if len(base) > 40 and os.path.isdir("/tmp"):  # Ray's socket paths must stay under 108 bytes
        base = "/tmp"
    return tempfile.mkdtemp(prefix="kvviz-ray-", dir=base), env


def _start_ray(ray, address: str, workers: int | None):
    """ray.init, with Ray's connection errors turned into one line naming kvviz's own flags
    (Ray's own message points to an --address flag kvviz does not have). Returns what to
    call after ray.shutdown(): it puts the environment back and removes the temporary folder."""
    import shutil

    tmp, env = (_local_ray_env() if address == "local" else (None, {}))
    saved = {k: os.environ.get(k) for k in (*env, "RAY_AUTH_MODE")}  # ray.init sets the mode
    os.environ.update(env)
    quiet = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = quiet.level
    if env:  # "Token authentication is enabled for this Ray cluster": kvviz chose that
        quiet.setLevel(logging.ERROR)

    def restore():
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    try:
        if address == "local":
            ray.init(num_cpus=workers or os.cpu_count(), include_dashboard=False,
                     log_to_driver=False, _temp_dir=tmp)
        else:  # a running cluster: ship this kvviz so every node runs the same code
            kvviz_dir = str(Path(C.__file__).resolve().parents[2])
            ray.init(address=address, log_to_driver=False,
                     runtime_env={"py_modules": [kvviz_dir], "excludes": ["__pycache__"]})
    except (RuntimeError, OSError, ValueError) as exc:  # ConnectionError is an OSError
        restore()
        raise _ray_error(exc, address) from None
    except BaseException:
        restore()
        raise
    finally:
        quiet.setLevel(level)
    return restore


def _ray_error(exc: Exception, address: str) -> ValueError:
    """One line for a failed ray.init, naming kvviz's flags."""
    if isinstance(exc, ConnectionError) and address == "auto":
        return ValueError("--ray auto: no Ray cluster found: start one with `ray start --head` "
                          "or use --ray local")
    msg = " ".join(str(exc).split())  # Ray's messages span lines
    if isinstance(exc, ConnectionError):
        return ValueError(f"--ray {address}: cannot reach a Ray cluster there ({msg}); check the "
                          "head's address and port, or use --ray local")
    where = "cannot start a local Ray" if address == "local" else "cannot join the Ray cluster"
    return ValueError(f"--ray {address}: {where}: {msg}")
