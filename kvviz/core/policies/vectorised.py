"""A policy's vectorised form: its rule over S streams at once, for kvviz.core.streams.Streams.

A policy that reads attention alone may declare, in its own file, a `StreamState` subclass
as its `vectorised` class attribute. `Streams` then keeps S streams of it in (S, n) arrays
and steps them together with one harness step: every stream holds the same number of
slots at every step (one admitted per step, down to the budget), so each call below sees
every stream at once. Slots are in ascending position order in every stream, so `argmin`
(the first minimum) breaks ties toward the lower position, as `Policy.choose` does.

tests/test_streams.py checks every declared form against `run_policy` bit for bit.
"""
from __future__ import annotations

import numpy as np

__all__ = ["StreamState", "close_gap"]


class StreamState:
    """Per-slot state of S streams of one policy, `cap` slots each (budget + 1).

    `Streams` calls, at every step: `observe(t, attn, n)` with the step's (S, n) weights on
    the n held slots (t counts observed steps, row 0's empty vector included), then
    `admit(n)` for the newcomer in slot n; when a stream is over its budget,
    `victim(attn, n)` gives each stream's victim slot (S,), and `remove(i, stay)` drops
    them (`stay` (S, n) is False at each victim). The default keeps no state."""

    def __init__(self, policy, S: int, cap: int):
        self.policy = policy

    def observe(self, t: int, attn: np.ndarray, n: int) -> None:
        """Step t's (S, n) weights on the held slots, index-aligned with them."""

    def admit(self, n: int) -> None:
        """A newcomer takes slot n in every stream (its state starts empty)."""

    def victim(self, attn: np.ndarray, n: int) -> np.ndarray:
        """(S,) the slot each stream evicts among its n held; ties to the lower position."""
        raise NotImplementedError

    def remove(self, i: np.ndarray, stay: np.ndarray) -> None:
        """Drop slot i[s] of each stream s (`stay` is False there), closing the gap."""


def close_gap(dst: np.ndarray, src: np.ndarray, stay: np.ndarray) -> None:
    """dst[:, :cap-1] = src (S, cap) without each row's victim, order kept (Policy._remove).
    Evictions happen only with every slot full, so src is whole rows."""
    dst[:, :-1] = src[stay].reshape(len(src), -1)
