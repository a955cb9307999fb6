"""The per-step rule every harness shares; Replay, run_streams and the loop all call `step`.

At step t a policy sees row t restricted to the positions it holds, renormalised to sum 1
over them in float64 and rounded to float32 once (what a model running with the
compressed cache would compute; a row with no mass is observed as is), then admits t,
then evicts down to its budget. `policy` is a Policy (one stream: rows are (n,)) or a
kvviz.core.streams.Streams (S streams at once: rows are (S, n)); both offer `held()`,
`advance(pos, attn)` and `evict(budget)`.

The budget is enforced here, not trusted: after the eviction `step` counts what the policy
holds and `enforce` stops the run (BudgetError, one line naming the policy, the stream, the
step and the count) when it is over. A harness records the counts it reads (`held_count`)
at every step, and memory figures are computed from those records.
`step_layer` is the same rule for the KV heads of one layer under an allocator
(kvviz.core.policies.alloc): each head is fed, then the allocator evicts across them, then
every head and the layer's total are enforced.
"""
from __future__ import annotations

import numpy as np

from kvviz.core.policies.base import BudgetError, check_key_norm, enforce

__all__ = ["BudgetError", "enforce", "feed", "held_count", "renormalise", "step", "step_layer"]


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


def held_count(policy) -> int:
    """How many slots the policy (or each stream of a Streams group) holds now."""
    return int(policy.held().shape[-1])


def step(policy, pos: int, raw, budget: int, key_norm=None, stream: str = "") -> np.ndarray:
    """One harness step: feed, then `evict(budget)`, then `enforce` the budget; returns the
    victims' positions. `stream` names the stream in a refusal."""
    feed(policy, pos, raw, key_norm)
    victims = policy.evict(budget)
    enforce(getattr(policy, "name", type(policy).__name__), held_count(policy), budget, pos, stream)
    return victims


def step_layer(group, pos: int, raws, key_norms=None) -> list:
    """One step of the KV heads of one layer under an allocator: feed head g its row
    `raws[g]` (and `key_norms[g]`), let the allocator evict across the heads
    (`group.evict()`), then enforce each head's cap and the layer's total
    (`group.enforce(pos)`). `group` is an allocator's per-layer group
    (`Allocator.group(...)`); returns one array of victims' positions per head."""
    for g, policy in enumerate(group.policies):
        feed(policy, pos, None if raws is None else raws[g],
             None if key_norms is None else key_norms[g])
    victims = group.evict()
    group.enforce(pos)
    return victims

