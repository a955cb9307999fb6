"""What a run achieved, computed from its eviction log and the full (uncompressed) trace.

retained_mass: mean, over the steps after the first eviction, of the share of row t's
    full mass that falls on positions held when query t was made.
hh_recall: at each step after the first eviction, the heavy hitters are the
    k = budget // 4 positions with the largest attention received so far in the full
    trace (rows 1..t-1, positions < t; ties to the lower position); recall is the share
    of them held when query t is made, averaged over those steps. This is the H2O
    paper's notion of a heavy hitter (accumulated attention) measured on the
    uncompressed trace, so no policy's own view of attention enters the ground truth.
attention_loss: 1 - retained_mass.
memory_bytes: bytes_per_slot x the most slots held after any step, as the harness recorded
    them (`Run.held`), in the cards' memory layout: what the run used, not the nominal
    budget (the two differ when the trace is shorter than the budget). A run with no
    record (built by hand) falls back to the budget.
"""
from __future__ import annotations

import numpy as np

from kvviz.core.budget import resolve
from kvviz.core.replay import NEVER, Run, held_until, run_policy
from kvviz.core.trace import Trace


def retained_mass(run: Run) -> float:
    """How much of the attention the evicted cache still serves: the mean, over the steps
    after the first eviction, of the share of each full row that falls on held positions
    (1.0 means nothing the model looked at was missing)."""
    start = run.first_eviction
    if start == NEVER:
        return 1.0
    vals = run.retained[start + 1:]
    vals = vals[~np.isnan(vals)]
    return float(vals.mean()) if len(vals) else 1.0


def hh_recall(trace: Trace, run: Run, k: int | None = None) -> float:
    """Did the policy keep the heavy hitters? The share of the `k` (default budget // 4; a
    ratio budget's as resolved at the trace's last step) positions with the most attention
    received so far in the full trace that are held, averaged over the steps after the first
    eviction. Measured on the uncompressed trace, so no policy's own view of attention enters
    the ground truth."""
    k = max(1, resolve(run.budget, trace.steps) // 4) if k is None else int(k)
    start = run.first_eviction
    if start == NEVER:
        return 1.0
    received = np.zeros(trace.steps)
    alive_until = held_until(run.evicted_at, trace.steps)
    scores = []
    for t in range(1, trace.steps):
        if t > start + 1 and t > k:
            top = _top_k(received[:t], k)
            held = alive_until[top] >= t  # held after step t-1
            scores.append(held.mean())
        received[:t] += trace.row(t)
    return float(np.mean(scores)) if scores else 1.0


def _top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, ties to the lower index (stable on -values)."""
    return np.argsort(-values, kind="stable")[:k]


def summary(trace: Trace, run: Run) -> dict:
    """Every metric of one run as a flat dict (retained_mass, attention_loss, hh_recall,
    memory_bytes): the columns that tables, sweeps and the app print."""
    mass = retained_mass(run)
    return {
        "retained_mass": mass,
        "attention_loss": 1.0 - mass,
        "hh_recall": hh_recall(trace, run),
        "memory_bytes": run.bytes_per_slot * run.peak_held,
    }


def evaluate(trace: Trace, name: str, budget: int, rng=None, **params) -> dict:
    """Replay `name` at `budget` over `trace` and return one table row: the policy, budget and
    parameters it ran with, and `summary`'s metrics. The one-call answer to "how much of the
    attention does this policy keep at this budget", shared by `kvviz bench`, sweeps and the
    app's metrics view so their rows always agree."""
    run = run_policy(trace, name, budget, rng=rng, **params)
    return {"policy": name, "budget": budget, "params": dict(run.params), **summary(trace, run)}


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for a proportion: `k` successes in `n` trials, at `z` (default
    the two-sided 95 % normal quantile). (nan, nan) for n = 0. Unlike the normal
    approximation it stays inside [0, 1] and is not empty at k = 0 or k = n."""
    k, n = int(k), int(n)
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"wilson needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))
