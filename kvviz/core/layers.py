"""Replay an allocator over the KV heads (and layers) of one trace file: the multi-stream harness.

A trace captured per KV head (heads "kv0", "kv1", ..., e.g. traces/code-kv.npz) holds, for
each stored layer, one attention stream per KV head. `replay_layers` steps all heads of a
layer together through an allocator (kvviz.core.policies.alloc): at step t each head is fed
row t of its own stream at the positions it holds (kvviz.core.harness.step_layer), then the
allocator evicts across the heads, then every head's cap and the layer's total are
enforced. The stored layers share the budget in depth order (code-kv's 0, 14 and 29 are
depths 0, 1 and 2 of 3), and each head's policy is told Place(layer, None, g, heads): its
model layer number, its KV-head index and count; the model's layer count is not stored.

An allocator that decides something before eviction starts (headroles: which heads
retrieve; `plan_layers`: every layer's budget) gets its calibration rows here: the first
`calibration_rows()` rows of every head's stream of every layer, read with the full cache
(row t over positions 0..t-1), all layers at once, then the replay starts at step 0 as for
any allocator.

Every stream's held count is recorded after every step (`LayerRun.held`), and each stream
gets an ordinary `Run`, so the metrics read it as they read a single replay's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvviz.core.groups import AllocatedLayers
from kvviz.core.metrics import summary
from kvviz.core.replay import NEVER, Run, held_shares, refuse_query_rows, refuse_value_norms
from kvviz.core.trace import Trace, load_trace


def kv_heads(heads) -> list[str]:
    """The KV-head labels among stored head labels, in head order ("kv0", "kv1", ...)."""
    return sorted((h for h in heads if h.startswith("kv") and h[2:].isdigit()), key=lambda h: int(h[2:]))


def refuse_single(name: str, trace_name: str) -> ValueError:
    """The one-line refusal of an allocator on a trace without KV heads."""
    return ValueError(f"{name} is an allocator: it shares a budget across KV heads, and trace "
                      f"{trace_name!r} stores no KV heads (only single streams): pick a trace "
                      "captured per KV head (e.g. code-kv) or run it in the model loop")


def load_layers(source, layers=None, *, name: str | None = None) -> list[list[Trace]]:
    """[layer][head] traces of every KV head at each stored model layer number in `layers`
    (default: every stored layer, in stored order). ValueError for a file with no KV heads."""
    first = load_trace(source, name=name)
    heads = kv_heads(first.heads)
    if not heads:
        raise refuse_single("an allocator", first.name)
    chosen = first.layers if layers is None else [int(x) for x in layers]
    return [[load_trace(source, layer=lay, head=h, name=first.name) for h in heads] for lay in chosen]


@dataclass
class LayerRun:
    """What an allocator did over [layer][head] streams: one `Run` per stream and the held
    counts every stream had after every step, as the harness recorded them."""

    runs: list          # [layer][head] Run
    held: np.ndarray    # int64 (layers, heads, T)
    layer_numbers: list  # the model layer number of each layer
    budgets: list       # the per-head budget of each layer
    bytes_per_slot: int
    states: list | None = None  # each layer's calibrated state (headroles: its Roles), or None

    def held_at_end(self) -> np.ndarray:
        """int64 (layers, heads): each stream's held count after the last step."""
        return self.held[:, :, -1].copy()

    @property
    def memory_bytes(self) -> int:
        """Bytes per slot x slots held, summed over the streams, at the step where that sum
        is largest: the memory the run used, from the recorded counts."""
        return int(self.bytes_per_slot * self.held.sum(axis=(0, 1)).max())


def replay_layers(grid, allocator) -> LayerRun:
    """Step `allocator` through `grid` ([layer][head] traces of equal length; every layer
    with the same number of heads) and return the LayerRun. Refuses a grid of one stream
    that is not a KV head, and a scorer that reads key norms when a stream has none."""
    grid = [list(row) for row in grid]
    if not grid or not grid[0]:
        raise ValueError("replay_layers needs at least one layer of KV-head traces")
    heads = len(grid[0])
    if any(len(row) != heads for row in grid):
        raise ValueError("every layer must hold the same number of KV heads")
    steps = {tr.steps for row in grid for tr in row}
    if len(steps) != 1:
        raise ValueError(f"traces must have equal lengths (steps), got {sorted(steps)}")
    T = steps.pop()
    groups = []
    for d, row in enumerate(grid):
        labels = [getattr(tr, "head", "mean") for tr in row]
        if kv_heads(labels) != labels:
            raise refuse_single(allocator.name, getattr(row[0], "name", "trace"))
        groups.append(allocator.group(getattr(row[0], "layer", None), None, heads,
                                      depth=d, depths=len(grid)))
    scorer = groups[0].policies[0]
    allocated = AllocatedLayers(groups)  # the StreamGroup every caller steps: stream d x heads + g
    calibration = min(int(allocator.calibration_rows()), T)
    if calibration:  # read with the full cache, before eviction starts; every layer's at once
        allocated.calibrate([[[tr.row(t) for t in range(calibration)] for tr in row] for row in grid])
        groups = allocated.groups  # rebuilt at the planned budgets when the allocator plans them
    if scorer.reads_key_norms and any(tr.key_norms is None for row in grid for tr in row):
        raise ValueError(f"{allocator.scorer} reads key norms, and these traces have none")
    if scorer.reads_query_rows:
        raise refuse_query_rows(allocator.scorer, getattr(grid[0][0], "name", "trace"))
    reads_values = scorer.reads_value_norms
    if reads_values and any(getattr(tr, "value_norms", None) is None for row in grid for tr in row):
        raise refuse_value_norms(allocator.scorer, getattr(grid[0][0], "name", "trace"))
    L = len(grid)
    evicted = np.full((L, heads, T), NEVER, np.int64)
    held = np.zeros((L, heads, T), np.int64)
    flat = evicted.reshape(L * heads, T)
    streams = [tr for row in grid for tr in row]
    for t in range(T):
        which, victims = allocated.step(t, _GridStep(streams, t))
        flat[which, victims] = t
        for d, group in enumerate(groups):
            held[d, :, t] = group.held_counts()
    runs = [[Run(policy=allocator.name, params=dict(allocator.params), budget=group.b, steps=T,
                 evicted_at=evicted[d, g], retained=held_shares(tr, evicted[d, g]),
                 bytes_per_slot=scorer.bytes_per_slot, trace_name=getattr(tr, "name", ""),
                 held=held[d, g].copy())
             for g, tr in enumerate(row)] for d, (row, group) in enumerate(zip(grid, groups))]
    return LayerRun(runs, held, [getattr(row[0], "layer", None) for row in grid],
                    [g.b for g in groups], scorer.bytes_per_slot, [g.state for g in groups])


class _GridStep:
    """Step t of a grid's streams (flattened, layer by layer) as a StreamGroup's inputs."""

    def __init__(self, streams: list, t: int):
        self.streams, self.t = streams, t

    def weights(self, s: int, held) -> np.ndarray:
        return self.streams[s].row(self.t)[held]

    def key_norm(self, s: int):
        return self.streams[s].key_norm(self.t)

    def value_norm(self, s: int):
        return self.streams[s].value_norm(self.t)


def held_counts(evicted_at: np.ndarray) -> np.ndarray:
    """int64 (T,): slots held after each step of a one-stream log (position t admitted at
    step t, each position evicted at its step)."""
    T = len(evicted_at)
    gone = evicted_at[evicted_at != NEVER]
    return np.arange(1, T + 1, dtype=np.int64) - np.cumsum(np.bincount(gone, minlength=T)[:T])


def replay_streams(grid, name: str, budget: int, rng=None, **params) -> LayerRun:
    """A per-stream policy over every stream of `grid` ([layer][head] KV-head traces, as
    `replay_layers` takes them): one policy object per stream at `budget`, told
    Place(layer, None, g, heads), replayed alone, its held counts recorded from its log.
    The LayerRun an allocator's replay gives, for a table row over the same streams."""
    from kvviz.core.budget import parse_budget, resolve
    from kvviz.core.policies import make_policy
    from kvviz.core.policies.base import Place
    from kvviz.core.replay import Replay

    grid = [list(row) for row in grid]
    heads = len(grid[0])
    runs, held, bps = [], np.zeros((len(grid), heads, grid[0][0].steps), np.int64), 0
    for d, row in enumerate(grid):
        per = []
        for g, tr in enumerate(row):
            place = Place(getattr(tr, "layer", None), None, g, heads)
            run = Replay(tr, make_policy(name, budget=budget, rng=rng, place=place, **params)).run()
            held[d, g] = run.held if run.held is not None else held_counts(run.evicted_at)
            bps = run.bytes_per_slot
            per.append(run)
        runs.append(per)
    final = resolve(parse_budget(budget), grid[0][0].steps)  # a ratio: resolved at the last step
    return LayerRun(runs, held, [getattr(row[0], "layer", None) for row in grid], [final] * len(grid), bps)


def layer_summary(grid, layer_run: LayerRun) -> dict:
    """One table row's metrics for a LayerRun: retained_mass, attention_loss and hh_recall
    averaged over the streams (each as `summary` computes it), and the recorded memory."""
    found = [summary(tr, run) for row, runs in zip(grid, layer_run.runs) for tr, run in zip(row, runs)]
    mass = float(np.mean([f["retained_mass"] for f in found]))
    return {"retained_mass": mass, "attention_loss": 1.0 - mass,
            "hh_recall": float(np.mean([f["hh_recall"] for f in found])),
            "memory_bytes": layer_run.memory_bytes}
