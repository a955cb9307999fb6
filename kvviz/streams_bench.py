"""`python -m kvviz perf --streams`: per stream-step CPU time of three ways to replay.

(a) the lean pure-Python loop of kvviz issue 7 (a dict of scores, `sorted()` per eviction),
(b) the single-stream harness (kvviz.replay.Replay), (c) kvviz.streams at S streams. All on
rows generated beforehand (canonical traces at seeds 0..S-1), all computing the eviction log
only, timed in CPU seconds in the same run; ratios are against (a).
The lean loops are baselines, not product code: they renormalise in Python floats (no float32
rounding), so `check_lean` reports whether they pick the harness's victims on these rows.
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd

from .bench import CachedTrace
from .policies import make_policy
from .replay import NEVER, Replay
from .streams import replay_streams
from .trace import ArrayTrace, canonical, packed_offset

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


def _cpu(fn, repeat: int = 1) -> float:
    best = np.inf
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def check_lean(name: str, budget: int = 512, steps: int = 4096) -> bool:
    """Does the lean loop evict what the harness evicts on the canonical trace?"""
    trace = canonical(steps)
    rows = [trace.row(t).tolist() for t in range(steps)]
    replay = Replay(trace, make_policy(name, budget))
    replay.seek(steps - 1)
    return LEAN[name](rows, budget) == replay.evicted_at.tolist()


def bench(budget: int = 512, steps: int = 4096, policies=("tova", "h2o", "snapkv"),
          streams=STREAMS, progress=print) -> pd.DataFrame:
    """Per stream-step CPU microseconds and the ratio to the lean loop, per policy and way."""
    traces = packed_streams(max(streams), steps)
    first = CachedTrace(traces[0])
    lists = [first.row(t).tolist() for t in range(steps)]
    out = []
    for name in policies:
        lean_victims = []
        lean = _cpu(lambda: lean_victims.append(LEAN[name](lists, budget))) / steps
        harness = Replay(first, make_policy(name, budget))
        one = _cpu(lambda: Replay(first, make_policy(name, budget)).seek(steps - 1), repeat=3) / steps
        harness.seek(steps - 1)
        rows = [{"policy": name, "way": "lean loop", "streams": 1, "us_per_stream_step": lean * 1e6,
                 "same_victims": lean_victims[0] == harness.evicted_at.tolist()},
                {"policy": name, "way": "Replay", "streams": 1, "us_per_stream_step": one * 1e6,
                 "same_victims": True}]
        for count in streams:
            group = traces[:count]
            cpu = _cpu(lambda: replay_streams(group, name, budget), repeat=3) / (steps * count)
            rows.append({"policy": name, "way": "run_streams", "streams": count,
                         "us_per_stream_step": cpu * 1e6, "same_victims": True})
        for row in rows:
            row["speedup_vs_lean"] = lean * 1e6 / row["us_per_stream_step"]
            if progress:
                progress(f"{row['policy']:>7} {row['way']:>11} S={row['streams']:<3} "
                         f"{row['us_per_stream_step']:8.2f} us  {row['speedup_vs_lean']:6.1f}x")
        out += rows
    return pd.DataFrame(out)
