"""The per-step rule every harness shares; Replay, run_streams and the loop all call `step`.

At step t a policy sees row t restricted to the positions it holds, renormalised to sum 1
over them in float64 and rounded to float32 once (what a model running with the
compressed cache would compute; a row with no mass is observed as is), then admits t,
then evicts down to its budget. `policy` is a Policy (one stream: rows are (n,)) or a
kvviz.core.streams.Streams (S streams at once: rows are (S, n)); both offer `held()`,
`advance(pos, attn)` and `evict(budget)`.
"""
from __future__ import annotations

import numpy as np

from kvviz.core.policies.base import check_key_norm


def renormalise(raw: np.ndarray, t: int) -> np.ndarray:
    """float32 weights from the raw weights on the held positions, (n,) or (S, n) per row.

    Refuses negative or non-finite weights (NaN fails both tests below), naming the row.
    """
    held = raw.astype(np.float64)
    if raw.ndim == 1:
        mass = held.sum()
        if len(held) and not (mass < np.inf and held.min() >= 0):
            raise ValueError(f"trace row {t} has negative or non-finite weights on held positions")
        if mass > 0:
            held /= mass
        return held.astype(np.float32)
    mass = held.sum(axis=1)  # per row numpy's pairwise sum, as the 1-D held.sum()
    n = raw.shape[1]
    if n and not (mass.max() < np.inf and raw.min() >= 0):
        bad = ~((mass < np.inf) & (raw.min(axis=1) >= 0))
        raise ValueError(f"trace row {t} of stream {int(np.flatnonzero(bad)[0])} has "
                         "negative or non-finite weights on held positions")
    attn = np.empty(raw.shape, np.float32)
    if n and mass.min() > 0:
        np.divide(held, mass[:, None], out=attn, casting="same_kind")  # float64, rounded once
    elif n:
        np.divide(held, mass[:, None], out=held, where=mass[:, None] > 0)
        attn[:] = held
    return attn


def feed(policy, pos: int, raw, key_norm=None) -> None:
    """The first half of `step`: observe the renormalised row, admit `pos`; no eviction.

    `raw` holds the weights at `policy.held()`; it is ignored (and may be None) for a
    policy that reads no attention.
    """
    attn = None if raw is None or not policy.uses_attention else renormalise(raw, pos)
    if policy.reads_key_norms:
        policy.advance(pos, attn, check_key_norm(key_norm, policy.name))
    else:
        policy.advance(pos, attn)


def step(policy, pos: int, raw, budget: int, key_norm=None) -> np.ndarray:
    """One harness step: feed, then `evict(budget)`; returns the victims' positions."""
    feed(policy, pos, raw, key_norm)
    return policy.evict(budget)

