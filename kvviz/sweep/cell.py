"""One cell, computed where it runs (this process, a pool worker or a Ray worker).

A cell gets the trace as the file's bytes (shipped once per worker, not per task), loads it
with the library's own validation, and returns the metrics of `kvviz.bench.evaluate`.
Loaded traces are kept per process, so a worker running many cells of one stream loads it
once. Errors propagate: the driver records them, identically for every engine.
"""
from __future__ import annotations

from collections import OrderedDict

from ..bench import evaluate
from ..trace import canonical, load_trace

METRICS = ("retained_mass", "hh_recall", "attention_loss", "memory_bytes")
_LOADED: OrderedDict = OrderedDict()  # (sha256, layer, head) -> Trace, a few per process
_KEEP = 8
BLOBS: dict[str, bytes] = {}  # sha256 -> trace file bytes, set once per pool worker


def set_blobs(blobs: dict[str, bytes]) -> None:
    """Pool initializer: every trace's bytes, once per worker process."""
    BLOBS.clear()
    BLOBS.update(blobs)


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


def compute(data: bytes | None, sha: str, trace: str, layer, head, policy: str, budget: int,
            params: tuple) -> dict:
    """The metrics of one cell. `data` None with a known sha: take the bytes from BLOBS."""
    if data is None and sha in BLOBS:
        data = BLOBS[sha]
    t = open_trace(data, sha, layer, head, trace)
    result = evaluate(t, policy, budget, **dict(params))
    return {m: result[m] for m in METRICS}
