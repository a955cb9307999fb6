"""Cells, computed where they run (this process, a pool worker or a Ray worker).

A task is a group of cells that differ only in layer and head: the streams of one trace
file under one policy configuration and budget. They are replayed together with
`kvviz.core.streams.run_streams` (one vectorised replay across streams, bit-identical to
`run_policy` per stream) and measured with `kvviz.core.metrics.summary`, what
`kvviz.core.metrics.evaluate` reports. A group that raises is run again cell by cell, so every
cell gets its own result or its own error, whatever it was grouped with.

The trace arrives as the file's bytes (shipped once per worker, not per task) and is loaded
with the library's own validation. Loaded streams are kept per process.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

from kvviz.core.layers import layer_summary, load_layers, replay_layers
from kvviz.core.metrics import evaluate, summary
from kvviz.core.policies import is_allocator, make_policy
from kvviz.core.trace import canonical, load_trace

try:
    from kvviz.core.streams import run_streams
except ImportError:  # an older kvviz: one replay per cell
    run_streams = None

METRICS = ("retained_mass", "hh_recall", "attention_loss", "memory_bytes")
_LOADED: OrderedDict = OrderedDict()  # (sha256, layer, head) -> Trace, a few per process
_KEEP = 16
BLOBS: dict[str, bytes] = {}  # sha256 -> trace file bytes, set once per pool worker


class PluginLoadError(RuntimeError):
    """A worker could not load a plugin the driver sent: the sweep stops."""


def ensure_plugins(specs) -> str | None:
    """Load the driver's plugins in this process (once; a no-op in the driver itself).
    The first refusal, or None."""
    if not specs:
        return None
    from kvviz.core.plugins import load_plugins

    refused = load_plugins(specs)
    return refused[0] if refused else None


def _need_plugins(specs) -> None:
    error = ensure_plugins(specs)
    if error:
        raise PluginLoadError(f"a worker could not load a plugin: {error}")


def init_worker(blobs: dict[str, bytes], parent: int, plugins=()) -> None:
    """Pool initializer: every trace's bytes, once per worker process; the driver's plugins;
    and a watch that ends the worker when the driver is gone (a SIGKILLed driver would
    otherwise leave its workers waiting on the task queue for ever)."""
    BLOBS.clear()
    BLOBS.update(blobs)
    ensure_plugins(plugins)  # a refusal is raised by the first task (or probe) instead

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def open_trace(data: bytes | None, sha: str, layer: int | None, head: str | None, name: str):
    """`layer` a model layer number, `head` a stored head label; no bytes = canonical."""
    if data is None:
        return canonical()
    key = (sha, layer, head)
    if key not in _LOADED:
        _LOADED[key] = load_trace(data, layer=layer, head=head, name=name)
        while len(_LOADED) > _KEEP:
            _LOADED.popitem(last=False)
    return _LOADED[key]


def _one(data, sha, trace, layer, head, policy, budget, params):
    try:
        result = evaluate(open_trace(data, sha, layer, head, trace), policy, budget, **dict(params))
    except Exception as exc:  # recorded in the cell's row; the sweep goes on
        return None, describe(exc)
    return {m: result[m] for m in METRICS}, None


def _allocated(data, trace, policy, budget, params):
    """An allocator's cell: every stored layer and KV head of the trace, replayed together."""
    try:
        grid = load_layers(data, name=trace)
        result = layer_summary(grid, replay_layers(grid, make_policy(policy, budget, **dict(params))))
    except Exception as exc:  # recorded in the cell's row; the sweep goes on
        return None, describe(exc)
    return {m: result[m] for m in METRICS}, None


def compute(data: bytes | None, sha: str, trace: str, streams: list, policy: str, budget: int,
            params: tuple, plugins=()) -> list[tuple[dict | None, str | None]]:
    """(metrics, None) or (None, error) per (layer, head) in `streams`, in order.
    `data` None with a known sha: the bytes are in BLOBS (a pool worker). `plugins`: the
    driver's plugin specs; PluginLoadError (the sweep stops) if one cannot be loaded."""
    _need_plugins(plugins)
    if data is None and sha in BLOBS:
        data = BLOBS[sha]
    if is_allocator(policy):
        return [_allocated(data, trace, policy, budget, params) for _ in streams]
    if len(streams) > 1 and run_streams is not None:
        try:
            traces = [open_trace(data, sha, layer, head, trace) for layer, head in streams]
            runs = run_streams(traces, policy, budget, **dict(params))
            return [({m: s[m] for m in METRICS}, None)
                    for s in (summary(t, r) for t, r in zip(traces, runs))]
        except Exception:
            pass  # each cell on its own below, with its own error
    return [_one(data, sha, trace, layer, head, policy, budget, params) for layer, head in streams]
