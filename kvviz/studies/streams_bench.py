"""`python -m kvviz perf --streams`: per stream-step CPU time of three ways to replay.

(a) a lean pure-Python loop (a dict of scores, `sorted()` per eviction),
(b) the single-stream harness (kvviz.core.replay.Replay), (c) kvviz.core.streams at S streams. All on
rows generated beforehand (canonical traces at seeds 0..S-1), all computing the eviction log
only, timed in CPU seconds in the same run; ratios are against (a).
The lean loops are baselines, not product code: they renormalise in Python floats (no float32
rounding), so `check_lean` reports whether they pick the harness's victims on these rows.
"""
from __future__ import annotations

import time

import numpy as np

from kvviz.core.policies import make_policy
from kvviz.core.replay import NEVER, Replay
from kvviz.core.streams import replay_streams
from kvviz.core.trace import ArrayTrace, canonical, packed_offset
from kvviz.studies.bench import CachedTrace
from kvviz.studies.table import Table

STREAMS = (1, 3, 9, 27)


# -- (a) the lean loops ---------------------------------------------------------------------
def lean_tova(rows, budget: int) -> list[int]:
    """TOVA as a dict of last weights; rows are Python lists (row t = weights on 0..t-1)."""
    last = {}  # held position -> weight at the latest step; insertion order = position order
    evicted = [NEVER] * len(rows)
    for t, row in enumerate(rows):
        mass = sum(row[p] for p in last)
        if not mass > 0:
            mass = 1.0  # an all-zero row: nothing to renormalise
        for p in last:
            last[p] = row[p] / mass
        if len(last) >= budget:  # admitting t would go over: drop the lowest observed
            victim = sorted(last, key=last.get)[0]  # stable: ties keep position order
            del last[victim]
            evicted[victim] = t
        last[t] = None  # replaced at the next step, before anything reads it
    return evicted


def lean_h2o(rows, budget: int, recent_window: int = 32) -> list[int]:
    cumulative = {}
    evicted = [NEVER] * len(rows)
    for t, row in enumerate(rows):
        mass = sum(row[p] for p in cumulative)
        if not mass > 0:
            mass = 1.0  # an all-zero row: nothing to renormalise
        for p in cumulative:
            cumulative[p] += row[p] / mass
        cumulative[t] = 0.0
        if len(cumulative) > budget:
            held = list(cumulative)
            victim = sorted(held[: len(held) - recent_window], key=cumulative.get)[0]
            del cumulative[victim]
            evicted[victim] = t
    return evicted


def lean_snapkv(rows, budget: int, obs_window: int = 16, pool_kernel: int = 5,
                recent_window: int = 32) -> list[int]:
    ring = {}  # held position -> its last obs_window weights, ring slot order
    radius = (pool_kernel - 1) // 2
    evicted = [NEVER] * len(rows)
    for t, row in enumerate(rows):
        mass = sum(row[p] for p in ring)
        if not mass > 0:
            mass = 1.0  # an all-zero row: nothing to renormalise
        slot = t % obs_window
        for p, r in ring.items():
            r[slot] = row[p] / mass
        ring[t] = [0.0] * obs_window
        if len(ring) > budget:
            held = list(ring)
            sums = [sum(ring[p]) for p in held]
            pooled = {p: max(sums[max(0, i - radius): i + radius + 1]) for i, p in enumerate(held)}
            victim = sorted(held[: len(held) - recent_window], key=pooled.get)[0]
            del ring[victim]
            evicted[victim] = t
    return evicted


LEAN = {"tova": lean_tova, "h2o": lean_h2o, "snapkv": lean_snapkv}


# -- the benchmark ----------------------------------------------------------------------------
def packed_streams(count: int, steps: int) -> list[ArrayTrace]:
    """Canonical traces at seeds 0..count-1, every row generated once, as rows of one
    float32 (count, packed) array (exactly the values `canonical(steps, seed).row(t)` gives)."""
    packed = np.empty((count, packed_offset(steps)), np.float32)
    for s in range(count):
        trace = canonical(steps, seed=s)
        for t in range(1, steps):
            packed[s, packed_offset(t):packed_offset(t + 1)] = trace.row(t)
    return [ArrayTrace(packed[s], steps, name=f"canonical seed {s}") for s in range(count)]


def _cpu(fn):
    """(CPU seconds, result) of one call."""
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def check_lean(name: str, budget: int = 512, steps: int = 4096) -> bool:
    """Does the lean loop evict what the harness evicts on the canonical trace?"""
    trace = canonical(steps)
    rows = [trace.row(t).tolist() for t in range(steps)]
    replay = Replay(trace, make_policy(name, budget))
    replay.seek(steps - 1)
    return LEAN[name](rows, budget) == replay.evicted_at.tolist()


def bench(budget: int = 512, steps: int = 4096, policies=("tova", "h2o", "snapkv"),
          streams=STREAMS, repeat: int = 3, progress=print) -> Table:
    """Per stream-step CPU microseconds, and the ratio to the lean loop measured in the same
    run, per policy and way. Each round times every way once; the best round counts, so a
    neighbour's load that comes and goes hits all ways alike. `victims` says whether a way's
    log for seed 0 equals Replay's (the lean loop's too: a baseline doing other work would
    not count)."""
    traces = packed_streams(max(streams), steps)
    first = CachedTrace(traces[0])
    lists = [first.row(t).tolist() for t in range(steps)]
    out = []
    for name in policies:
        def replay(name=name):
            r = Replay(first, make_policy(name, budget))
            r.seek(steps - 1)
            return r.evicted_at.tolist()

        ways = {("lean loop", 1): lambda name=name: LEAN[name](lists, budget), ("Replay", 1): replay}
        for count in streams:
            ways["run_streams", count] = \
                lambda group=traces[:count], name=name: replay_streams(group, name, budget)[0].tolist()
        best, logs = {}, {}
        for _ in range(repeat):
            for way, fn in ways.items():
                cpu, logs[way] = _cpu(fn)
                best[way] = min(best.get(way, np.inf), cpu / (steps * way[1]))
        lean, reference = best["lean loop", 1], logs["Replay", 1]
        for (way, count), cpu in best.items():
            row = {"policy": name, "way": way, "streams": count, "us_per_stream_step": cpu * 1e6,
                   "speedup_vs_lean": lean / cpu,
                   "victims": "same" if logs[way, count] == reference else "DIFFERENT"}
            out.append(row)
            if progress:
                progress(f"{name:>7} {way:>11} S={count:<3} {row['us_per_stream_step']:8.2f} us/stream-step "
                         f"{row['speedup_vs_lean']:6.1f}x  victims {row['victims']}")
    return Table(out, ["policy", "way", "streams", "us_per_stream_step", "speedup_vs_lean", "victims"])
