"""Cached compute for the app: traces, checkpointed runs, peeks, metrics, sweeps.

Everything heavy is keyed on one `RunKey` (trace id, layer, version, head, policy,
params, budget). Engines (a run plus
checkpoints) are kept with `st.cache_resource` (large, shared read-only objects); derived
arrays and dicts with `st.cache_data`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import streamlit as st

from kvviz.app.engine import Engine
from kvviz.app.figures.cache import cache_heatmap, codes_to_png, heatmap_grid
from kvviz.app.figures.states import NEVER, NOT_YET, divergence_steps, state_colours, symmetric_difference
from kvviz.core.budget import as_given
from kvviz.core.metrics import summary
from kvviz.core.replay import run_policy
from kvviz.core.trace import canonical, load_trace


def traces_dir() -> Path:
    from kvviz.core.paths import traces_or_default

    return traces_or_default()


def listing(folder, pattern: str) -> list[str]:
    """The names in `folder` matching `pattern`, sorted: listed once per change of the
    folder (its modification time moves when a file is added, removed or renamed) and
    shared server-wide. Every page run lists the traces and the lessons, and after a
    lecturer's move a class's 30 pages run within a second: one stat each, not a listing."""
    try:
        stamp = os.stat(folder).st_mtime_ns
    except OSError:
        return []
    return _listing(str(folder), pattern, stamp)


@st.cache_data(max_entries=64, show_spinner=False)
def _listing(folder: str, pattern: str, stamp: int) -> list[str]:
    d = Path(folder)
    return sorted(p.name for p in d.glob(pattern)) if d.is_dir() else []


def list_trace_files() -> list[str]:
    return listing(traces_dir(), "*.npz")


@st.cache_resource(show_spinner=False)
def upload_store() -> dict:
    """Server-wide store of validated uploads: sha -> (bytes, file name)."""
    return {}


MAX_UPLOADS = 16


def add_upload(data: bytes, filename: str) -> str:
    """Keep a validated upload server-wide (so its link works for the class); the oldest of
    more than MAX_UPLOADS is forgotten."""
    sha = hashlib.sha256(data).hexdigest()[:16]
    store = upload_store()
    store.pop(sha, None)
    store[sha] = (bytes(data), filename)
    while len(store) > MAX_UPLOADS:
        store.pop(next(iter(store)))
    return f"upload:{sha}"


def trace_version(key: str) -> str:
    """Changes when the underlying file changes (part of every cache key)."""
    if key.startswith("file:"):
        p = traces_dir() / key[5:]
        try:
            s = p.stat()
            return f"{s.st_mtime_ns}:{s.st_size}"
        except OSError:
            return "missing"
    return ""


def trace_label(key: str) -> str:
    if key == "canonical":
        return "canonical (synthetic)"  # its steps: the caption below (a narrow box)
    if key.startswith("file:"):
        return f"traces/{key[5:]}"
    if key.startswith("upload:"):
        item = upload_store().get(key[7:])
        return f"uploaded: {item[1]}" if item else f"uploaded ({key[7:]})"
    return key


@st.cache_resource(max_entries=8, show_spinner=False)
def get_trace(key: str, layer: int | None, version: str = "", head: str = "mean"):
    """The trace for a key at a model layer number (None: the first stored) and head label
    ("mean" unless the file stores heads); ValueError (with the loader's message) if it
    cannot be loaded."""
    if key == "canonical":
        if head != "mean":
            raise ValueError(f"head must be one of ['mean'] for the canonical trace, got {head!r}")
        return canonical().keep_rows()  # every policy's replay reads the same rows
    if key.startswith("file:"):
        name = key[5:]
        if "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"trace name {name!r} is not a file in traces/")
        return load_trace(traces_dir() / name, layer=layer, name=Path(name).stem,
                          head=head)
    if key.startswith("upload:"):
        item = upload_store().get(key[7:])
        if item is None:
            raise ValueError("that uploaded trace is not on this server any more; upload it again")
        data, fname = item
        return load_trace(data, layer=layer, name=Path(fname).stem, head=head)
    raise ValueError(f"unknown trace {key!r}: use canonical, file:NAME.npz or upload:ID")


def trace_layers(key: str, version: str = "") -> list[int]:
    t = get_trace(key, None, version)
    return list(getattr(t, "layers", []) or [])


def trace_heads(key: str, layer: int, version: str = "") -> list[str]:
    """Head labels the trace stores ("mean" first); ["mean"] for traces without heads."""
    return list(getattr(get_trace(key, layer, version), "heads", None) or ["mean"])


@dataclass(frozen=True)
class RunKey:
    """One replay's identity, the key of every cached result below: the trace (its key,
    model layer, file version and head), the policy, its parameters (`params_key`) and the
    budget. A new ingredient of a run = one field here, not an argument on every function."""
    trace: str
    layer: int
    version: str
    policy: str
    params: tuple
    budget: int
    head: str = "mean"

    def engine(self) -> Engine:
        return engine(self)

    def summary(self) -> dict:
        return summary_of(self)

    def peek(self, step: int):
        return peek_at(self, int(step))

    def evaluate(self) -> dict:
        return evaluate(self)

    def with_policy(self, policy: str, params: tuple) -> "RunKey":
        return replace(self, policy=policy, params=params)


# The spinner shows only while a replay runs (a cache miss); `with st.spinner` around the
# call would cost every page run a timer thread and a message, replayed or not.
@st.cache_resource(max_entries=16, show_spinner="Replaying the policy over the trace (once per "
                   "setting, for the whole server)…")
def engine(rk: RunKey, _policy=None) -> Engine:
    """`_policy`: the configuration's policy when the caller has built it already (the
    sidebar, checking the settings), used on a miss; not part of the key."""
    return Engine(get_trace(rk.trace, rk.layer, rk.version, rk.head), rk.policy, rk.budget,
                  dict(rk.params), policy=_policy)


@st.cache_resource(max_entries=32, show_spinner=False)
def pair_of(a: RunKey, b: RunKey) -> dict:
    """What the step navigator and status line need about two runs at every step, once per
    server (every session and rerun used to recompute them): the divergence steps and
    |A delta B| per step. Read-only arrays."""
    ea, eb = engine(a).evicted_at, engine(b).evicted_at
    out = {"divergences": divergence_steps(ea, eb), "symdiff": symmetric_difference(ea, eb)}
    for v in out.values():
        v.flags.writeable = False
    return out


@st.cache_data(max_entries=256, show_spinner=False)
def peek_at(rk: RunKey, step: int):
    kept, scores = engine(rk).peek(step)
    return kept, scores


@st.cache_data(max_entries=32, show_spinner=False)
def summary_of(rk: RunKey) -> dict:
    eng = engine(rk)
    return summary(eng.trace, eng.run)


@st.cache_data(max_entries=2048, show_spinner=False)
def evaluate(rk: RunKey) -> dict:
    """One sweep point: run + summary (not kept as an engine: sweeps touch many configs)."""
    trace = get_trace(rk.trace, rk.layer, rk.version, rk.head)
    run = run_policy(trace, rk.policy, rk.budget, **dict(rk.params))
    return {"policy": rk.policy, "budget": as_given(rk.budget), **dict(rk.params), **summary(trace, run)}


# The positional forms, for callers not yet moved to RunKey (same caches underneath).
def get_engine(key: str, layer: int, version: str, policy: str, params: tuple, budget: int,
               head: str = "mean", built=None) -> Engine:
    """`built`: the policy object already made for this configuration (see `engine`)."""
    return engine(RunKey(key, layer, version, policy, params, budget, head), built)


def pair(key: str, layer: int, version: str, a: tuple, b: tuple, budget: int,
         head: str = "mean") -> dict:
    return pair_of(RunKey(key, layer, version, a[0], a[1], budget, head),
                   RunKey(key, layer, version, b[0], b[1], budget, head))


def peek(key: str, layer: int, version: str, policy: str, params: tuple, budget: int, step: int,
         head: str = "mean"):
    return peek_at(RunKey(key, layer, version, policy, params, budget, head), int(step))


def run_summary(key: str, layer: int, version: str, policy: str, params: tuple, budget: int,
                head: str = "mean") -> dict:
    return summary_of(RunKey(key, layer, version, policy, params, budget, head))


def heatmap_bins(steps: int) -> int:
    """Pixels per axis: one per cell up to 1,024 steps; beyond that 512 (4,096 steps -> 8x8
    blocks; aggregation cost grows with pixels x positions, and the chart is ~1,000 px wide)."""
    return steps if steps <= 1024 else 512


@st.cache_data(max_entries=64, show_spinner=False)
def grid(key: str, layer: int, version: str, a: tuple, b: tuple, budget: int, labels: tuple,
         max_bins: int | None = None, window: tuple | None = None, head: str = "mean",
         hide_from: int | None = None) -> dict:
    """Heatmap aggregation for a pair of runs; a, b = (policy, params); window =
    (steps_range, pos_range) for a zoomed view, None for the whole run. `hide_from`: the
    grid of a page that hides that step and later ones (`blank_from`)."""
    ea = seen(get_engine(key, layer, version, a[0], a[1], budget, head).evicted_at, hide_from)
    eb = seen(get_engine(key, layer, version, b[0], b[1], budget, head).evicted_at, hide_from)
    sr, pr = window or (None, None)
    trace = get_trace(key, layer, version, head)
    tokens = trace.tokens
    max_bins = max_bins or heatmap_bins(trace.steps)
    g = heatmap_grid(ea, eb, max_bins, label_a=labels[0], label_b=labels[1],
                     steps_range=sr, pos_range=pr, tokens=tokens)
    return g if hide_from is None else blank_from(g, hide_from)


def seen(evicted_at, hide_from: int | None) -> np.ndarray:
    """An eviction log as a page that hides steps `hide_from`.. may know it (a class's open
    question asks about step `hide_from`): a position evicted at one of those steps is said
    never evicted (NEVER), so nothing built from the log tells which positions go there;
    every eviction before `hide_from` is unchanged."""
    ev = np.asarray(evicted_at)
    return ev if hide_from is None else np.where(ev >= int(hide_from), NEVER, ev)


HIDDEN_CELL = "hidden while the class's question is open"


def blank_from(g: dict, hide_from: int) -> dict:
    """A heatmap grid (from logs already cut at `hide_from`: `seen`) with every pixel row
    and hover row that starts at step `hide_from` or later blank: "not yet generated" pixels,
    no counts, a hover that says it is hidden. A row that straddles the step keeps its
    blocks, drawn from the cut logs (nothing evicted from `hide_from` on). Not modified."""
    g = dict(g)
    rows = np.asarray(g["step_edges"][:-1]) >= hide_from
    codes = np.array(g["codes"], copy=True)
    codes[rows] = NOT_YET
    shares = np.array(g["shares"], copy=True)
    shares[rows] = 0
    g["codes"], g["shares"] = codes, shares
    g["png"] = codes_to_png(codes, state_colours(*g["labels"]))
    h_rows = np.asarray(g["hover_step_edges"][:-1]) >= hide_from
    counts = np.array(g["hover_counts"], copy=True)
    counts[:, h_rows] = 0
    g["hover_counts"] = counts
    g["hover_text"] = [[HIDDEN_CELL] * len(row) if hidden else row
                       for row, hidden in zip(g["hover_text"], h_rows)]
    return g


@st.cache_resource(max_entries=32, show_spinner=False)
def cache_figure(key: str, layer: int, version: str, a: tuple, b: tuple, budget: int,
                 labels: tuple, window: tuple | None = None, head: str = "mean",
                 hide_from: int | None = None) -> dict:
    """The cache heatmap as a plain dict, built once server-wide per configuration (every
    session at every step shares it; `views.cache.at_step` moves the step marker on a copy).
    `hide_from`: as a page that hides that step and later ones may have it (`grid`): the
    data sent to the browser holds nothing of those steps. Read-only: never modify the
    returned dict."""
    ea = seen(get_engine(key, layer, version, a[0], a[1], budget, head).evicted_at, hide_from)
    eb = seen(get_engine(key, layer, version, b[0], b[1], budget, head).evicted_at, hide_from)
    g = grid(key, layer, version, a, b, budget, labels, window=window, head=head,
             hide_from=hide_from)
    return cache_heatmap(ea, eb, 0, label_a=labels[0], label_b=labels[1], grid=g).to_dict()


def params_key(params: dict) -> tuple:
    """Hashable and plain (numpy scalars become Python ones); the policy types its values."""
    return tuple(sorted((k, v.item() if hasattr(v, "item") else v) for k, v in params.items()))


def evicted(eng: Engine) -> np.ndarray:
    return eng.evicted_at


@st.cache_data(max_entries=8, show_spinner=False)
def pooling_example(key: str, layer: int, version: str, params: tuple, budget: int):
    """(step, explanation) where SnapKV's pooling defends a neighbour (experiments.py)."""
    from kvviz.app.ui.experiments import pooling_example as find
    return find(get_trace(key, layer, version), budget, dict(params))
