"""Steps worth jumping to, from a trace and two eviction logs (pure; the navigator's jumps).

Each function returns the ascending steps at which its event happens, so the page finds
"the next one after step s" with `kvviz.app.figures.states.next_after`:

- notable divergences: one policy evicts a position the other keeps, and while only the
  other holds it the position carries more than `share` of a step's attention (the full
  trace's row): one cache misses real attention the other still has;
- epoch boundaries: the canonical trace redraws its heavy hitters every `epoch` steps;
- heavy-hitter evictions: A or B evicts a position that was a heavy hitter (the metrics'
  definition: among the budget // 4 positions with the most attention received so far in
  the full trace, ties to the lower position) at some step up to that eviction;
- evictions of one position by A or B.
"""
from __future__ import annotations

import numpy as np

from kvviz.core.replay import NEVER, held_until

NOTABLE_SHARE = 0.005  # the notable-divergence jump's default: 0.5 % of a step's attention


def notable_divergences(trace, ev_a, ev_b, share: float = NOTABLE_SHARE):
    """(steps, positions), ascending by step: the steps at which A or B evicts a position
    that the other still holds and that, while only the other holds it, carries more than
    `share` of some step's attention (row s of the full trace, for the queries s made
    during the disagreement); per step the position with the largest such share."""
    ea, eb = held_until(ev_a, trace.steps), held_until(ev_b, trace.steps)
    lo, hi = np.minimum(ea, eb), np.maximum(ea, eb)  # held by exactly one after lo..hi-1
    peak = np.zeros(trace.steps)
    live = np.flatnonzero(lo < hi)
    for s in range(1, trace.steps):
        p = live[(lo[live] < s) & (hi[live] >= s)]  # queried while only one holds it
        if not len(p):
            continue
        row = trace.row(s).astype(np.float64)
        total = row.sum()
        if total > 0:
            np.maximum.at(peak, p, row[p] / total)
    hit = live[peak[live] > share]
    best = {}
    for p in hit[np.lexsort((hit, -peak[hit]))]:  # largest share first, then lower position
        best.setdefault(int(lo[p]), int(p))
    steps = np.asarray(sorted(best), np.int64)
    return steps, np.asarray([best[s] for s in steps.tolist()], np.int64)


def divergence_share(trace, ev_a, ev_b, position: int) -> tuple[float, int]:
    """(share, step): the largest share of a step's attention (row s of the full trace) that
    `position` received while exactly one of A and B held it, and the first step s with it;
    (0.0, -1) if they never disagree about it. What `notable_divergences` compares with
    its threshold."""
    ea, eb = held_until(ev_a, trace.steps), held_until(ev_b, trace.steps)
    p = int(position)
    lo, hi = min(ea[p], eb[p]), max(ea[p], eb[p])
    best, at = 0.0, -1
    for s in range(max(1, int(lo) + 1), min(int(hi), trace.steps - 1) + 1):
        row = trace.row(s).astype(np.float64)
        total = row.sum()
        if total > 0 and row[p] / total > best:
            best, at = float(row[p] / total), s
    return best, at


def epoch_boundaries(trace) -> np.ndarray:
    """The first step of every epoch after the first (traces with an `epoch`, the canonical
    one); empty for traces without epochs."""
    epoch = getattr(trace, "epoch", None)
    if not epoch:
        return np.empty(0, np.int64)
    return np.arange(int(epoch), trace.steps, int(epoch), dtype=np.int64)


def first_heavy(trace, k: int) -> np.ndarray:
    """Per position, the first step t at which it is among the k positions with the most
    attention received in rows 1..t-1 (ties to the lower position; t > k, as in
    kvviz.core.metrics.hh_recall), or NEVER."""
    k = max(1, int(k))
    first = np.full(trace.steps, NEVER, np.int64)
    received = np.zeros(trace.steps)
    for t in range(1, trace.steps):
        if t > k:
            top = np.argsort(-received[:t], kind="stable")[:k]
            new = top[first[top] == NEVER]
            first[new] = t
        received[:t] += trace.row(t)
    return first


def heavy_hitter_evictions(first_hh, ev_a, ev_b) -> np.ndarray:
    """Steps at which A or B evicts a position that was a heavy hitter at or before that
    step (`first_hh` from `first_heavy`)."""
    first_hh = np.asarray(first_hh)
    out = []
    for ev in (np.asarray(ev_a), np.asarray(ev_b)):
        hit = (ev != NEVER) & (first_hh != NEVER) & (first_hh <= ev)
        out.append(ev[hit])
    return np.unique(np.concatenate(out)).astype(np.int64)


def position_evictions(ev_a, ev_b, position: int) -> np.ndarray:
    """The steps at which A or B evicts `position` (none, one or two)."""
    steps = {int(ev_a[position]), int(ev_b[position])} - {NEVER}
    return np.asarray(sorted(steps), np.int64)
