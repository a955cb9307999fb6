"""What a predict-then-reveal question asks, from a policy's eviction log alone.

"Which position will A evict next?" asked of a page showing step t (the state after t's
eviction) means: the first step s > t at which A evicts anything (`asked_at`); the guess is
one of the positions A holds at s before it evicts (admitted up to s, not evicted before s),
the answer the positions it evicts at s.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvviz.core.replay import NEVER


@dataclass(frozen=True)
class Question:
    step: int               # the step asked at
    answer_step: int        # the step the eviction happens
    held: tuple             # positions a guess may name (ascending)
    answer: tuple           # the evicted positions (ascending)


def candidates(evicted_at, s: int) -> np.ndarray:
    """Positions held at step `s` after admission, before its eviction."""
    ev = np.asarray(evicted_at, np.int64)
    pos = np.arange(len(ev))
    return pos[(pos <= s) & ((ev == NEVER) | (ev >= s))]


def next_eviction(evicted_at, step: int) -> Question | None:
    """The question at `step`, or None when the policy evicts nothing from `step` on."""
    ev = np.asarray(evicted_at, np.int64)
    later = ev[(ev != NEVER) & (ev >= int(step))]
    if not len(later):
        return None
    s = int(later.min())
    return Question(step=int(step), answer_step=s,
                    held=tuple(int(p) for p in candidates(ev, s)),
                    answer=tuple(int(p) for p in np.flatnonzero(ev == s)))


def asked_at(evicted_at, shown: int) -> Question | None:
    """The question a page showing step `shown` asks: the first eviction after it (the page
    already shows `shown`'s own victims). The page's ask button and the lessons' {next.a}."""
    return next_eviction(evicted_at, int(shown) + 1)
