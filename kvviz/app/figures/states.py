"""Cache-state arithmetic shared by the views: pure numpy over eviction logs.

Everything here works on `evicted_at` arrays (int64, one entry per position: the step
during which the position was evicted, -1 if never), using the harness's held rule:
position p is held after step s  iff  p <= s and (evicted_at[p] == -1 or evicted_at[p] > s).
So p is held exactly during the half-open step interval [p, end(p)), where end(p) is
evicted_at[p], or the number of steps if it is never evicted.
"""
from __future__ import annotations

import numpy as np

from kvviz.core.replay import NEVER, held_mask  # the harness's held rule, one definition
from kvviz.core.replay import held_until as ends

# Cell states of the A/B comparison, ordered so that "more held" is a higher code.
NOT_YET, NEITHER, ONLY_B, ONLY_A, BOTH = 0, 1, 2, 3, 4


def state_colours(label_a: str = "tova", label_b: str = "snapkv") -> dict:
    """Each state's colour for the pair A = `label_a`, B = `label_b` (labels or policy names):
    only A and only B in their policies' colours (kvviz.app.figures.common.pair_colours),
    held by both dark grey, evicted by both light grey, not yet generated white."""
    from kvviz.app.figures.common import pair_colours

    ca, cb = pair_colours(label_a, label_b)
    return {NOT_YET: "#ffffff", NEITHER: "#e4e4e4", ONLY_B: cb, ONLY_A: ca, BOTH: "#3a3a3a"}


# The default pair's (TOVA, SnapKV): Okabe-Ito, readable on a projector and for the common
# colour-vision deficiencies.
STATE_COLOURS = state_colours()


def states_at(ev_a, ev_b, step: int) -> np.ndarray:
    """int8 state code per position after `step`."""
    a, b = held_mask(ev_a, step), held_mask(ev_b, step)
    out = np.full(len(a), NEITHER, np.int8)
    out[a & b] = BOTH
    out[a & ~b] = ONLY_A
    out[~a & b] = ONLY_B
    out[np.arange(len(a)) > step] = NOT_YET
    return out


def bin_edges(n: int, max_bins: int, start: int = 0) -> np.ndarray:
    """Edges start = e0 < e1 < ... < ek = n of equal-width bins (the last may be shorter),
    k <= max_bins."""
    n, max_bins, start = int(n), max(1, int(max_bins)), int(start)
    width = max(1, -(-(n - start) // max_bins))
    return np.append(np.arange(start, n, width), n).astype(np.int64)


def state_counts(ev_a, ev_b, step_edges, pos_edges) -> np.ndarray:
    """Cells per state in each (step bin, position bin) block: shape (5, n_step_bins, n_pos_bins).

    Exact counts, computed from the held intervals without materialising the T x T grid.
    """
    pos_edges = np.asarray(pos_edges, dtype=np.int64)
    step_edges = np.asarray(step_edges, dtype=np.int64)
    # narrow integers for the big per-position arrays (memory bandwidth is the cost here);
    # values are steps and positions (< len + 1); sums happen in int64
    largest = max(len(ev_a), int(step_edges[-1]), int(pos_edges[-1])) + 1
    dt = np.int16 if largest < 2**15 else np.int32 if largest < 2**31 else np.int64
    p0, p1 = int(pos_edges[0]), int(pos_edges[-1])  # positions outside the edges are ignored
    ea = ends(ev_a)[p0:p1].astype(dt)
    eb = ends(ev_b)[p0:p1].astype(dt)
    pos = np.arange(p0, p1).astype(dt)
    s0 = step_edges[:-1, None].astype(dt)
    s1 = step_edges[1:, None].astype(dt)
    starts = pos_edges[:-1] - p0

    def block(lo, hi):
        per_pos = np.minimum(hi, s1)
        per_pos -= np.maximum(lo, s0)
        np.maximum(per_pos, 0, out=per_pos)
        return np.add.reduceat(per_pos, starts, axis=1, dtype=np.int64)

    held_a = block(pos, ea)
    held_b = block(pos, eb)
    both = block(pos, np.minimum(ea, eb))
    not_yet = block(dt(0), pos)
    total = (s1 - s0).astype(np.int64) * np.diff(pos_edges)[None, :]
    return np.stack([not_yet, total - not_yet - held_a - held_b + both,
                     held_b - both, held_a - both, both])


def dominant_state(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(state code of the most frequent state per block, its share of the block)."""
    total = counts.sum(axis=0)
    code = counts.argmax(axis=0).astype(np.int8)
    share = np.take_along_axis(counts, code[None].astype(np.int64), 0)[0] / np.maximum(total, 1)
    return code, share


def display_state(counts: np.ndarray, step_edges, pos_edges) -> np.ndarray:
    """The colour of each block: its most frequent state, except that a block where the
    policies disagree on at least one full line of cells (a whole row or column of the block)
    shows the disagreement (only A or only B, whichever has more cells). With mode alone a
    one-position-wide difference vanishes as soon as blocks are wider than one cell; single
    cells are shown exactly either way."""
    code, _ = dominant_state(counts)
    hs = np.diff(np.asarray(step_edges))[:, None]
    ws = np.diff(np.asarray(pos_edges))[None, :]
    line = np.minimum(hs, ws)
    only_a, only_b = counts[ONLY_A], counts[ONLY_B]
    show = (only_a + only_b) >= line
    return np.where(show, np.where(only_a >= only_b, ONLY_A, ONLY_B), code).astype(np.int8)


def symmetric_difference(ev_a, ev_b) -> np.ndarray:
    """|A delta B| after each step: positions held by exactly one of the two."""
    ea, eb = ends(ev_a), ends(ev_b)
    steps = len(ea)
    lo, hi = np.minimum(ea, eb), np.maximum(ea, eb)
    diff = np.zeros(steps + 1, np.int64)
    np.add.at(diff, lo[lo < hi], 1)
    np.add.at(diff, hi[lo < hi], -1)
    return np.cumsum(diff)[:steps]


def divergence_steps(ev_a, ev_b) -> np.ndarray:
    """Steps at which the two policies' evictions differ (one evicted a position the other did not
    evict at that step), ascending."""
    ev_a, ev_b = np.asarray(ev_a), np.asarray(ev_b)
    differ = ev_a != ev_b
    events = np.concatenate([ev_a[differ], ev_b[differ]])
    return np.unique(events[events != NEVER])


def next_after(steps: np.ndarray, after: int) -> int:
    """The first of ascending `steps` strictly after `after`, or -1 (NEVER)."""
    i = np.searchsorted(steps, int(after), side="right")
    return int(steps[i]) if i < len(steps) else NEVER


def first_divergence(ev_a, ev_b) -> int:
    return next_after(divergence_steps(ev_a, ev_b), NEVER)


def next_divergence(ev_a, ev_b, after: int) -> int:
    """First divergence step strictly after `after`, or -1."""
    return next_after(divergence_steps(ev_a, ev_b), after)


def sinks_held(evicted_at, sinks: int = 4) -> np.ndarray:
    """Per step, how many of positions 0..sinks-1 are held."""
    e = ends(evicted_at)
    steps = len(e)
    s = np.arange(steps)[:, None]
    p = np.arange(min(sinks, steps))[None, :]
    return ((p <= s) & (e[p] > s)).sum(axis=1)


def recent_held_fraction(evicted_at, recent: int = 64) -> np.ndarray:
    """Per step s, the share of the min(recent, s+1) newest positions s-recent+1..s that are held."""
    e = ends(evicted_at)
    steps = len(e)
    s = np.arange(steps)[:, None]
    p = s - np.arange(recent)[None, :]
    valid = p >= 0
    held = valid & (e[np.clip(p, 0, None)] > s)
    return held.sum(axis=1) / valid.sum(axis=1)
