"""Replay S attention streams (layers or heads of one trace) through one policy at once.

A policy that declares a vectorised form (its `vectorised` class attribute, a
kvviz.core.policies.vectorised.StreamState written in the policy's own file) is stepped
across streams by `Streams`, through the same kvviz.core.harness.step as Replay: every
stream holds the same number of positions at every step (each step admits one, evicts
down to the budget), so the state of S streams is one (S, n) array and a step is a
handful of numpy calls instead of S. tests/test_streams.py checks every stream's Run
against `run_policy` bit for bit. A policy without one falls back to one Replay per
stream. The loop uses `Streams` too.
"""
from __future__ import annotations

import copy

import numpy as np

from kvviz.core import harness
from kvviz.core.groups import StreamGroup, no_victims
from kvviz.core.policies import POLICIES, make_policy
from kvviz.core.policies.vectorised import close_gap
from kvviz.core.replay import NEVER, Run, run_policy
from kvviz.core.trace import ArrayTrace, Trace, packed_offset


def run_streams(traces, name: str, budget: int, rng=None, **params) -> list[Run]:
    """One Run per trace, each bit-identical to `run_policy(trace, name, budget, rng, **params)`.

    The traces must have equal lengths. A policy that draws from `rng` gets its own copy per
    stream, so stream s sees what a separate `run_policy` call would.
    """
    traces = _check_traces(traces)
    policy = make_policy(name, budget=budget, rng=copy.deepcopy(rng), **params)  # same refusals
    if type(policy).vectorised is None or getattr(policy, "ratio", None) is not None:
        # the vectorised form holds one fixed count; a ratio budget replays per stream
        return [run_policy(tr, name, budget, rng=copy.deepcopy(rng), **params) for tr in traces]
    evicted, retained, held = _replay(traces, policy, shares=True)
    return [Run(policy=name, params=dict(policy.params), budget=policy.budget, steps=tr.steps,
                evicted_at=evicted[s], retained=retained[s], bytes_per_slot=policy.bytes_per_slot,
                trace_name=getattr(tr, "name", ""), held=held.copy())
            for s, tr in enumerate(traces)]


def replay_streams(traces, name: str, budget: int, **params) -> np.ndarray:
    """The eviction logs alone, int64 (S, T), without `Run.retained`: what `bench` times."""
    policy = make_policy(name, budget=budget, **params)
    if getattr(policy, "ratio", None) is not None:
        raise ValueError(f"budget: replay_streams vectorises a fixed budget, got the ratio {policy.ratio}; "
                         "run_streams replays a ratio budget one stream at a time")
    if type(policy).vectorised is None:
        raise ValueError(f"replay_streams vectorises {list(vectorised_names())}, not {name!r} "
                         "(it declares no vectorised form); run_streams falls back to one "
                         "Replay per stream")
    return _replay(_check_traces(traces), policy)[0]


def vectorised_names() -> tuple:
    """The registered policies that declare a vectorised form."""
    return tuple(n for n, cls in POLICIES.items() if cls.vectorised is not None)


def _replay(traces, policy, shares: bool = False):
    """(evicted_at (S, T), retained (S, T) or None, held (T,)): Replay.run, S streams at
    once. Every stream holds the same count at every step, so one record serves them all."""
    rows = _Rows(traces)
    S, T = len(traces), traces[0].steps
    group = Streams(policy, S, offsets=rows.starts[:, 0],
                    names=[getattr(tr, "name", "") or f"stream {s}" for s, tr in enumerate(traces)])
    evicted = np.full((S, T), NEVER, np.int64)
    retained = np.full((S, T), np.nan) if shares else None
    held = np.zeros(T, np.int64)
    for t in range(T):
        keys = group.held()
        raw = rows.gather(t, keys)
        victims = harness.step(group, t, raw, policy.budget)  # refuses a bad row first
        if shares:  # `keys` still holds step t's positions: an eviction writes the spare buffer
            retained[:, t] = rows.shares(t, keys, raw.astype(np.float64).sum(axis=1))
        if victims.shape[1]:
            evicted[group.streams, victims[:, 0]] = t
        held[t] = group.n
    return evicted, retained, held


class Streams(StreamGroup):
    """S streams of one vectorised policy, stepped together by kvviz.core.harness.step: a
    StreamGroup (kvviz.core.groups) whose `step` gathers its inputs with one `take`.

    Held positions are kept as keys (position + the stream's `offsets` entry), so a caller
    holding every stream's rows in one flat array gathers `held()` with one `take`; `names`
    (one string per stream) name the streams in a refusal. Every
    stream holds the same count (one in per step, down to the budget out), so the state is
    (S, n) arrays and a step is a handful of numpy calls; an eviction is one victim each.
    The harness checks every stream's victim against its held keys in one comparison
    (kvviz.core.harness.check_stream_victims).
    """

    uses_attention = True  # a vectorised form reads attention, and nothing else
    reads_key_norms = reads_value_norms = reads_query_rows = False

    def __init__(self, policy, S: int, offsets=None, names=None):
        form = type(policy).vectorised
        if form is None:
            raise ValueError(f"Streams vectorises {list(vectorised_names())}, not {policy.name!r} "
                             "(it declares no vectorised form)")
        if not policy.uses_attention or policy.reads_key_norms or policy.reads_value_norms \
                or policy.reads_query_rows:
            raise ValueError(f"{policy.name} declares a vectorised form but reads inputs beside "
                             "attention: Streams feeds attention alone")
        B = self.budget = policy.budget
        self.policy, self.streams = policy, np.arange(S)
        self.offsets = np.zeros(S, np.int64) if offsets is None else np.asarray(offsets, np.int64)
        # how a refusal names stream s (kvviz.core.harness.check_victims): 'stream s' when None
        self.stream_names = None if names is None else list(names)
        self.n, self.steps, self.attn = 0, 0, None
        self.stay = np.ones((S, B + 1), bool)  # at an eviction: False at each stream's victim
        # Held keys, ascending per stream. Two buffers: closing a victim's gap copies one
        # into the other.
        self.keys, self.spare = np.empty((S, B + 1), np.int64), np.empty((S, B + 1), np.int64)
        self.state = form(policy, S, B + 1)
        self.size, self.capacity, self.bytes_per_slot = S, B, policy.bytes_per_slot

    # -- the StreamGroup protocol ---------------------------------------------------------
    def step(self, t: int, inputs) -> tuple[np.ndarray, np.ndarray]:
        """One harness step of every stream on `inputs.gather(held keys)`; (streams, positions)."""
        victims = harness.step(self, t, inputs.gather(self.held()), self.budget)
        if not victims.shape[1]:
            return no_victims()
        return self.streams, victims[:, 0]

    def kept(self, s: int) -> np.ndarray:
        return self.keys[s, : self.n] - self.offsets[s]

    def stream_policy(self, s: int):
        raise ValueError(f"{self.name}'s vectorised streams step token by token: a prompt read in one "
                         "pass feeds one policy object per stream (build them without the vectorised form)")

    def prefill(self, prompt):
        self.stream_policy(0)

    @property
    def name(self) -> str:
        """The vectorised policy's registry name (how a refusal names it)."""
        return self.policy.name

    def held(self) -> np.ndarray:
        """(S, n) keys of the held positions, ascending per stream."""
        return self.keys[:, : self.n]

    def advance(self, pos: int, attn: np.ndarray | None) -> None:
        """Observe (S, n) weights (index-aligned with `held()`), admit `pos` in every stream."""
        n = self.n
        if attn is None:
            raise ValueError("Streams needs attention weights at every step")
        # The harness observes every step (row 0's empty vector too), so the count of
        # observed steps is the step number (a state that keeps a ring of the last W steps
        # writes slot t mod W).
        self.state.observe(self.steps, attn, n)
        self.keys[:, n] = self.offsets + pos  # admit (Policy.advance): a fresh slot at the end
        self.state.admit(n)
        self.n, self.steps, self.attn = n + 1, self.steps + 1, attn

    def evict(self, budget: int) -> np.ndarray:
        """(S, k) victims' positions, k = 0 or 1 (one over the budget: one victim each)."""
        if budget != self.budget:
            raise ValueError(f"Streams evicts to the budget it was built with ({self.budget}), got {budget}")
        n = self.n
        if n <= budget:
            return np.empty((len(self.streams), 0), np.int64)
        streams, stay = self.streams, self.stay
        i = self.state.victim(self.attn, n)
        victims = self.keys[streams, i] - self.offsets
        stay[streams, i] = False
        close_gap(self.spare, self.keys, stay)
        self.keys, self.spare = self.spare, self.keys
        self.state.remove(i, stay)
        stay[streams, i] = True
        self.n = n - 1
        return victims[:, None]


class _Rows:
    """Row t of every stream at held positions, addressed by keys (position + `starts`).

    Traces stored as packed arrays are read straight from them (rows of one 2-D array, e.g.
    the layers of one loaded file, without a copy); any other trace through `row(t)`.
    """

    def __init__(self, traces: list[Trace]):
        self.traces, self.flat, self.block = traces, None, None
        self.starts = np.zeros((len(traces), 1), np.int64)
        if all(isinstance(tr, ArrayTrace) for tr in traces):
            base, which = _common_base([tr.packed for tr in traces])
            if base is None:
                base, which = np.stack([tr.packed for tr in traces]), np.arange(len(traces))
            self.base, self.which = base, which
            self.flat, self.starts = base.reshape(-1), (which * base.shape[1])[:, None]

    def gather(self, t: int, keys: np.ndarray) -> np.ndarray:
        """(S, n) weights of row t at `keys`, in the stored dtype (the values `row(t)` has)."""
        if self.flat is not None:
            return self.flat[packed_offset(t):].take(keys)
        self.block = np.stack([tr.row(t) for tr in self.traces])
        return np.take_along_axis(self.block, keys, axis=1)

    def shares(self, t: int, keys: np.ndarray, held_mass: np.ndarray) -> np.ndarray:
        """Per stream, held_shares(trace, log)[t]: row t's mass on the held positions over
        its whole mass, both float64. `x.sum(dtype=float64)` of a float32 row casts through
        numpy's buffer (np.getbufsize() values) and sums each chunk pairwise; a row that fits
        one buffer gives what astype + sum gives, so longer rows take held_shares' own path."""
        if t == 0:
            return np.nan
        if t > np.getbufsize():
            pos = keys - self.starts
            return [_share(tr.row(t), pos[s]) for s, tr in enumerate(self.traces)]
        block = self.block
        if self.flat is not None:
            block = self.base[self.which, packed_offset(t):packed_offset(t + 1)]
        total = block.astype(np.float64).sum(axis=1)
        out = np.full(len(total), np.nan)
        np.divide(held_mass, total, out=out, where=total > 0)
        return out


def _share(row: np.ndarray, pos: np.ndarray) -> float:
    total = row.sum(dtype=np.float64)  # as replay.held_shares
    return row[pos].sum(dtype=np.float64) / total if total > 0 else np.nan


def _common_base(arrays):
    """If every array is a whole row of one C-contiguous array seen as (rows, len): that
    2-D view and each array's row number; else (None, None)."""
    base, width = arrays[0].base, arrays[0].shape[0]
    if not (isinstance(base, np.ndarray) and base.flags.c_contiguous and width
            and base.size % width == 0):
        return None, None
    rows = base.reshape(-1, width)
    start0, stride = base.__array_interface__["data"][0], width * base.itemsize
    which = []
    for a in arrays:
        offset = a.__array_interface__["data"][0] - start0
        if (a.base is not base or a.dtype != base.dtype or a.shape != (width,)
                or a.strides != (base.itemsize,) or offset % stride):
            return None, None
        which.append(offset // stride)
    return rows, np.asarray(which, np.int64)


def _check_traces(traces) -> list:
    traces = list(traces)
    if not traces:
        raise ValueError("traces must hold at least one trace")
    lengths = {tr.steps for tr in traces}
    if len(lengths) != 1:
        raise ValueError(f"traces must have equal lengths (steps), got {sorted(lengths)}")
    return traces
