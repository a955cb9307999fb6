"""The replay: feed a trace to a policy one step at a time and log what it evicts.

The trace is one stream: each step goes through the eviction protocol
(kvviz.core.groups.OnePolicy, a StreamGroup of one stream), whose step is
kvviz.core.harness.step (row t over the held positions, renormalised, then admit t, then
evict to the budget, then enforce it). A run is its eviction log and the number of slots
held after every step: O(T) memory.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from kvviz.core.budget import as_given, resolve
from kvviz.core.groups import OnePolicy
from kvviz.core.policies import Place, make_policy
from kvviz.core.policies.vectors import use_rope_theta
from kvviz.core.trace import Trace

NEVER = -1


def held_until(evicted_at, steps: int | None = None) -> np.ndarray:
    """Exclusive end of each position's stay: its eviction step, or `steps` if never."""
    ev = np.asarray(evicted_at, dtype=np.int64)
    return np.where(ev == NEVER, len(ev) if steps is None else int(steps), ev)


def held_mask(evicted_at, step: int) -> np.ndarray:
    """The held rule, over positions 0..T-1: p is held after step s iff p <= s and
    (evicted_at[p] == NEVER or evicted_at[p] > s)."""
    ev = np.asarray(evicted_at, dtype=np.int64)
    return (np.arange(len(ev)) <= step) & ((ev == NEVER) | (ev > step))


@dataclass
class Run:
    """What one policy did over one trace, kept as its eviction log.

    A run stores one integer per position (the step that evicted it) rather than the held
    set at every step, so a 65,536-step run costs kilobytes, and any step's held set is
    recomputed from the log on demand (`held_at`). Metrics, tables and every figure read
    runs, never the policy object, so they cannot disagree with what was replayed.
    """

    policy: str
    params: dict
    budget: int  # as given: a slot count, or a kvviz.core.budget.Ratio resolved at each step
    steps: int
    evicted_at: np.ndarray  # int64 (T,): step during which p was evicted, NEVER if held at the end
    retained: np.ndarray  # float64 (T,): share of row t's mass on positions held when t queried
    bytes_per_slot: int = 0
    trace_name: str = ""
    meta: dict = field(default_factory=dict)
    held: np.ndarray | None = None  # int64 (T,): slots held after each step, as the harness counted

    @property
    def peak_held(self) -> int:
        """The most slots held after any step (recorded; the budget, resolved at the last
        step, when nothing was recorded)."""
        if self.held is None or not len(self.held):
            return resolve(self.budget, self.steps)
        return int(self.held.max())

    @property
    def first_eviction(self) -> int:
        """The first step at which anything was evicted (`NEVER` if the budget was never hit):
        before it, every policy holds everything, so metrics start there."""
        hit = self.evicted_at[self.evicted_at != NEVER]
        return int(hit.min()) if len(hit) else NEVER

    def held_mask(self, step: int) -> np.ndarray:
        """Boolean over positions 0..T-1: held after `step` finished."""
        return held_mask(self.evicted_at, step)

    def held_at(self, step: int) -> np.ndarray:
        """The positions held after `step` finished, ascending: the cache as the next query sees it."""
        return np.flatnonzero(self.held_mask(step)).astype(np.int64)

    def to_frame(self, trace: Trace | None = None, per: str = "position"):
        """A long pandas DataFrame of this run (kvviz.core.frame): per="position", one row per
        position (admitted, evicted, full_mass, lost_mass); per="step", one row per step x
        position before it (held, full_mass). `trace`, the one replayed, gives the tokens'
        text, the layer and head, and the full-cache masses (NaN without it)."""
        from kvviz.core import frame
        from kvviz.core.policies import config_label

        frame.check_per(per)
        if trace is not None and trace.steps != self.steps:
            raise ValueError(f"trace has {trace.steps} steps; this run has {self.steps}")
        frame.check_size(1, self.steps, per)
        layer = getattr(trace, "layer", None) if trace is not None else self.meta.get("layer")
        head = getattr(trace, "head", None) if trace is not None else self.meta.get("head")
        keys = {"config": config_label(self.policy, self.params, budget=self.budget), "policy": self.policy,
                "budget": as_given(self.budget), "layer": layer, "head": head or "mean"}
        cols = frame.stream(self.evicted_at, row=None if trace is None else trace.row,
                            n_rows=0 if trace is None else trace.steps, per=per)
        return frame.frame([(keys, cols)], tokens=getattr(trace, "tokens", None), per=per)


def stream_vectors(trace: Trace) -> tuple:
    """The loaded stream's key vectors (T, head_dim) and query vectors (group, T, head_dim),
    each None where the trace has none. A file's (format version 5) are every stored layer's,
    (layers, kv_heads, T, head_dim) and (layers, q_heads, T, head_dim): the loaded layer's are
    taken, and of its heads the loaded head's: "kvN" reads KV head N and its group's query
    heads, "qN" query head N and the KV head it reads, "mean" the layer's one KV head and every
    query head (a layer with several KV heads has no one key per position: ValueError). A
    synthetic trace's may be one stream's already, (T, head_dim) and (group, T, head_dim)."""
    keys, queries = getattr(trace, "keys", None), getattr(trace, "queries", None)
    if keys is None and queries is None:
        return None, None
    four = [v for v in (keys, queries) if v is not None and np.ndim(v) == 4]
    if not four:
        return keys, queries
    layers = list(getattr(trace, "layers", []) or [])
    li = layers.index(trace.layer) if trace.layer in layers else 0
    kv_heads = keys.shape[1] if keys is not None else None
    q_heads = queries.shape[1] if queries is not None else None
    group = q_heads // kv_heads if kv_heads and q_heads else 1
    head = str(getattr(trace, "head", "mean"))
    if head.startswith("kv") and head[2:].isdigit():
        kv, qs = int(head[2:]), slice(int(head[2:]) * group, (int(head[2:]) + 1) * group)
    elif head.startswith("q") and head[1:].isdigit():
        kv, qs = int(head[1:]) // group, slice(int(head[1:]), int(head[1:]) + 1)
    else:
        if kv_heads not in (None, 1):
            raise ValueError(f"trace {trace.name!r}'s head {head!r} averages {kv_heads} KV heads, and a "
                             "key vector belongs to one: load a KV head (head='kv0', --head kv0) of a "
                             "trace captured per KV head")
        kv, qs = 0, slice(None)
    return (None if keys is None else keys[li, kv],
            None if queries is None else queries[li, qs])


class _TraceRow:
    """Step t of a single trace as a StreamGroup's inputs (kvviz.core.groups): stream 0 is
    the trace; it carries no per-query-head rows. `vectors`: the stream's key and query
    vectors (`stream_vectors`), when a policy reads them."""

    __slots__ = ("trace", "t", "vectors")

    def __init__(self, trace: Trace, t: int, vectors=(None, None)):
        self.trace, self.t, self.vectors = trace, t, vectors

    def weights(self, s: int, held: np.ndarray) -> np.ndarray:
        """Row t's raw weights on the positions `held`."""
        return self.trace.row(self.t)[held]

    def key_norm(self, s: int):
        """Position t's key norm (None on a trace without them)."""
        return self.trace.key_norm(self.t)

    def value_norm(self, s: int):
        """Position t's value norm (None on a trace without them)."""
        return self.trace.value_norm(self.t)

    def query_rows(self, s: int, held: np.ndarray):
        """None: a trace stores one row per stream (Replay refuses a policy that reads them)."""
        return None

    def keys(self, s: int, positions: np.ndarray):
        """The stream's stored keys at `positions`, float32 (n, head_dim); None without them."""
        keys = self.vectors[0]
        return None if keys is None else np.asarray(keys[positions], np.float32)

    def query(self, s: int):
        """Step t's stored query vectors, float32 (group, head_dim); None without them."""
        queries = self.vectors[1]
        if queries is None:
            return None
        q = queries[:, self.t] if queries.ndim == 3 else queries[self.t][None]
        return np.asarray(q, np.float32)


class Replay:
    """Step a policy through a trace, forward or back.

    With `checkpoint_every=N` it keeps a copy of the policy every N steps, so going back
    or peeking replays at most N steps instead of from the start (what the app's slider
    needs); without, memory stays O(policy state + T).
    """

    def __init__(self, trace: Trace, policy, checkpoint_every: int | None = None):
        if checkpoint_every is not None and int(checkpoint_every) < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if getattr(policy, "allocator", False):
            raise ValueError(f"{policy.name} is an allocator: it shares a budget across KV heads, "
                             f"and a replay of trace {trace.name!r} is one stream: replay a trace "
                             "captured per KV head with kvviz.core.layers (kvviz bench --trace "
                             "code-kv.npz) or run it in the model loop")
        if policy.reads_key_norms and trace.key_norms is None:
            raise ValueError(f"{policy.name} reads key norms, and trace {trace.name!r} has none: "
                             "pick a trace captured with key norms (format version 3, e.g. "
                             "code-kv) or run it in the model loop")
        if policy.reads_value_norms and trace.value_norms is None:
            raise refuse_value_norms(policy.name, trace.name)
        if policy.reads_query_rows:
            raise refuse_query_rows(policy.name, trace.name)
        lacks = missing_vectors(trace, policy)
        if lacks:
            raise refuse_vectors(policy.name, trace.name, lacks)
        # a policy that undoes RoPE on the queries: the trace's recorded base (kvviz capture's)
        use_rope_theta(policy, (getattr(trace, "meta", None) or {}).get("rope_theta"),
                       f"trace {getattr(trace, 'name', '') or 'trace'!r}")
        self.trace = trace
        self.budget = getattr(policy, "ratio", None) or policy.budget  # as given
        self.t = 0
        self.every = int(checkpoint_every) if checkpoint_every else None
        if getattr(policy, "place", None) in (None, Place()):  # not set by the caller
            policy.place = place_of(trace)
        self.stream = stream_name(trace, policy.place)
        self.group = OnePolicy(policy, self.stream)
        reads = getattr(policy, "reads_keys", False) or getattr(policy, "reads_queries", False)
        self.vectors = stream_vectors(trace) if reads else (None, None)
        self._checkpoints = {0: copy.deepcopy(policy)}  # steps done -> policy state
        self.evicted_at = np.full(trace.steps, NEVER, np.int64)
        self.held = np.zeros(trace.steps, np.int64)  # slots held after each step

    @property
    def policy(self):
        """The policy object being stepped (its state is the replay's current state)."""
        return self.group.policy

    def step(self) -> np.ndarray:
        """Take the next step through the one-stream group (`kvviz.core.harness.step` under
        it) and return its victims (ascending positions). Checkpoints are taken here, so
        stepping forward is all a caller does to make going back cheap later."""
        if self.t >= self.trace.steps:
            raise ValueError(f"step: the trace has only {self.trace.steps} steps")
        t = self.t
        if self.every and t % self.every == 0 and t not in self._checkpoints:
            self._checkpoints[t] = copy.deepcopy(self.policy)
        _, victims = self.group.step(t, _TraceRow(self.trace, t, self.vectors))
        self.evicted_at[victims] = t
        self.held[t] = len(self.policy.held())
        self.t += 1
        return victims

    def _restore(self, done: int) -> None:
        """Go back to the nearest checkpoint with at most `done` steps taken."""
        start = max(k for k in self._checkpoints if k <= done)
        self.group = OnePolicy(copy.deepcopy(self._checkpoints[start]), self.stream)
        self.t = start
        self.evicted_at[self.evicted_at >= start] = NEVER
        self.held[start:] = 0

    def seek(self, i: int) -> None:
        """Bring the state to just after step i (i = -1: before any step)."""
        i = int(i)
        if not -1 <= i < self.trace.steps:
            raise ValueError(f"seek: step must be in -1..{self.trace.steps - 1}, got {i}")
        if i + 1 < self.t:
            self._restore(i + 1)
        while self.t <= i:
            self.step()

    def peek(self, step: int):
        """(kept, scores) at `step` after admission, before eviction. Leaves self unchanged."""
        step = int(step)
        if not 0 <= step < self.trace.steps:
            raise ValueError(f"peek: step must be in 0..{self.trace.steps - 1}, got {step}")
        if self.t == step:
            group = OnePolicy(copy.deepcopy(self.policy), self.stream)
        else:
            start = max(k for k in self._checkpoints if k <= step)
            probe = Replay(self.trace, copy.deepcopy(self._checkpoints[start]))
            probe.t = start
            probe.seek(step - 1)
            group = probe.group
        group.feed(step, _TraceRow(self.trace, step, self.vectors))
        return group.policy.kept.copy(), group.policy.scores()

    def run(self) -> Run:
        """Replay to the trace's last step and return the `Run`: its eviction log and, per
        step, the share of the full row that fell on held positions."""
        self.seek(self.trace.steps - 1)
        return Run(policy=self.policy.name, params=dict(self.policy.params), budget=self.budget,
                   steps=self.trace.steps, evicted_at=self.evicted_at.copy(),
                   retained=held_shares(self.trace, self.evicted_at), bytes_per_slot=self.policy.bytes_per_slot,
                   trace_name=getattr(self.trace, "name", ""), held=self.held.copy())


def place_of(trace: Trace) -> Place:
    """Where a single trace stream sits: its model layer number (None on a synthetic trace) and
    its KV-head index when the loaded head is one ("kv2" -> 2; None for "mean" or a query
    head). The counts (`layers`, `heads`) are None: one stream does not share a budget."""
    head = getattr(trace, "head", "mean")
    kv = int(head[2:]) if isinstance(head, str) and head.startswith("kv") and head[2:].isdigit() else None
    return Place(layer=getattr(trace, "layer", None), head=kv)


def stream_name(trace: Trace, place: Place) -> str:
    """How a refusal names the stream: the trace, then the place when known."""
    where = place.describe()
    name = getattr(trace, "name", "") or "trace"
    return f"{name} ({where})" if where else name


def held_shares(trace: Trace, evicted_at: np.ndarray) -> np.ndarray:
    """Per step t, the share of row t's full mass on positions held when t was queried."""
    shares = np.full(trace.steps, np.nan)
    end = held_until(evicted_at, trace.steps)
    for t in range(1, trace.steps):
        row = trace.row(t)
        total = row.sum(dtype=np.float64)
        if total > 0:
            shares[t] = row[end[:t] >= t].sum(dtype=np.float64) / total  # held after t-1
    return shares


def refuse_value_norms(name: str, trace_name: str) -> ValueError:
    """The one-line refusal of a policy that reads value norms on a trace without them."""
    return ValueError(f"{name} reads value norms, and trace {trace_name!r} has none: pick a "
                      "trace captured with value norms (format version 4, kvviz capture)")


def refuse_query_rows(name: str, trace_name: str) -> ValueError:
    """The one-line refusal of a policy that reads per-query-head rows, on any trace."""
    return ValueError(f"{name} reads per-query-head rows, and trace {trace_name!r} stores one "
                      "row per stream: run it in the model loop (kvviz loop, generate, needle "
                      "or kvviz.hf), which supplies them")


def missing_vectors(trace: Trace, cls) -> list[str]:
    """The vectors policy class `cls` reads that `trace` does not carry: "keys" (the stream's,
    (T, head_dim), `stream_vectors`) and "queries" ((group, T, head_dim) or (T, head_dim)),
    each checked for its shape."""
    lacks = []
    wanted = [(what, ndims) for what, reads, ndims in
              (("keys", getattr(cls, "reads_keys", False), (2,)),
               ("queries", getattr(cls, "reads_queries", False), (2, 3))) if reads]
    if not wanted:
        return lacks
    stream = dict(zip(("keys", "queries"), stream_vectors(trace)))
    for what, ndims in wanted:
        have = stream[what]
        if have is None:
            lacks.append(what)
            continue
        shape = np.shape(have)
        steps = shape[-2] if len(shape) >= 2 else None
        if len(shape) not in ndims or steps != trace.steps:
            raise ValueError(f"trace {trace.name!r}'s {what} must be "
                             f"{'(T, head_dim)' if what == 'keys' else '(group, T, head_dim) or (T, head_dim)'} "
                             f"with T = {trace.steps}, got shape {shape}")
    return lacks


def refuse_vectors(name: str, trace_name: str, lacks: list[str]) -> ValueError:
    """The one-line refusal of a policy that reads key or query vectors on a trace without them."""
    words = " and ".join({"keys": "key", "queries": "query"}[w] for w in lacks)
    return ValueError(f"{name} reads {words} vectors, and trace {trace_name!r} has none: pick a "
                      f"trace captured with {' and '.join(lacks)} or run it in the model loop "
                      "(kvviz loop, generate, needle or kvviz.hf)")


def can_drive(trace: Trace, cls) -> bool:
    """Whether `trace` carries every input policy class `cls` reads (key and value norms, key
    and query vectors; no trace carries per-query-head rows)."""
    try:
        lacks = missing_vectors(trace, cls)
    except ValueError:  # vectors it cannot use (a head mean of several KV heads, a bad shape)
        return False
    return (not cls.reads_query_rows and not lacks
            and (trace.key_norms is not None or not cls.reads_key_norms)
            and (getattr(trace, "value_norms", None) is not None or not cls.reads_value_norms))


def runnable(trace: Trace) -> list[str]:
    """The registered policies this trace can drive: all, less those that read key or value
    norms, or key or query vectors, the trace does not have (a default list; asking for one
    of those by name is refused)."""
    from kvviz.core.policies import POLICIES

    return [n for n, cls in POLICIES.items() if can_drive(trace, cls)]


def run_policy(trace: Trace, name: str, budget: int, rng=None, **params) -> Run:
    """Replay the registered policy `name` at `budget` (a slot count, or a ratio of the tokens
    seen such as '0.25x': kvviz.core.budget) over the whole trace: the one-line way
    to get a `Run`. Parameters are checked by the policy's own declaration (a `ValueError`
    names the parameter and its rule); `rng` matters only to `random`, and `None` means a
    fixed seed, so the same call gives the same log every time."""
    return Replay(trace, make_policy(name, budget=budget, rng=rng, **params)).run()
