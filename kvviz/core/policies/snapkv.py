"""SnapKV (Li et al., NeurIPS 2024, arXiv:2404.14469), adapted to decode-time eviction.

Each slot keeps a float32 ring of its weights over the last `obs_window` observed steps.
At eviction the ring is summed afresh (float64, ring slot 0 upward, never a running
total), pooled over adjacent kept slots with radius (pool_kernel-1)/2 (max, the card's
rule, or avg), and the lowest pooled score outside the `recent_window` newest positions goes.
"""
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Policy, Rank, check_recent, param
from kvviz.core.policies.vectorised import StreamState, close_gap


def pool(sums: np.ndarray, radius: int, kind: str = "max") -> np.ndarray:
    """Pool the last axis over each slot's neighbourhood i-radius..i+radius, clamped to the
    kept slots (no padding). max: the largest; avg: the float64 sum of the neighbourhood
    in ascending slot order (absent neighbours add an exact 0.0), divided by its size.
    One function for SnapKV and the vectorised streams, so the two cannot drift."""
    if kind == "max":
        pooled = sums.copy()
        for d in range(1, radius + 1):
            np.maximum(pooled[..., d:], sums[..., :-d], out=pooled[..., d:])
            np.maximum(pooled[..., :-d], sums[..., d:], out=pooled[..., :-d])
        return pooled
    n = sums.shape[-1]
    total = np.zeros(sums.shape, np.float64)
    for d in range(-radius, radius + 1):  # neighbour i+d, lowest first
        if abs(d) >= n:
            continue  # no slot has a neighbour that far
        if d < 0:
            total[..., -d:] += sums[..., :n + d]
        elif d == 0:
            total += sums
        else:
            total[..., :n - d] += sums[..., d:]
    i = np.arange(n)
    size = np.minimum(i + radius, n - 1) - np.maximum(i - radius, 0) + 1
    return total / size


class SnapKVStreams(StreamState):
    """SnapKV over S streams. Rings are stored by slot id, which a position keeps while held
    (a newcomer takes the last victim's), so an eviction moves ids, not obs_window floats
    per slot."""

    def __init__(self, policy, S: int, cap: int):
        super().__init__(policy, S, cap)
        self.recent, self.streams = policy.recent_window, np.arange(S)
        self.window, self.radius = policy.obs_window, (policy.pool_kernel - 1) // 2
        self.pooling = policy.pooling
        self.history = np.zeros((S, self.window, cap), np.float32)  # [stream, ring slot, id]
        self.ids, self.ids_spare = np.empty((S, cap), np.int64), np.empty((S, cap), np.int64)
        self.free = None  # the id a newcomer takes: its slot index until the first eviction

    def observe(self, t, attn, n):
        # history[i][slot] = weight, then slot advances. The harness observes every step
        # (row 0's empty vector too), so slot = t mod obs_window.
        self.history[:, t % self.window][self.streams[:, None], self.ids[:, :n]] = attn

    def admit(self, n):
        new = n if self.free is None else self.free
        self.ids[:, n] = new
        self.history[self.streams, :, new] = 0.0  # admit(pos, history = zeroes)

    def victim(self, attn, n):
        # sums[i] = sum(history[i]) afresh in float64, ring slot 0 upward (a reduction over
        # the ring axis adds slot 0, then 1, ... per id, as SnapKV.sums does), in position
        # order; pooled by `pool` (as SnapKV.pool); the lowest pooled outside the recent
        # window goes.
        by_id = self.history.sum(axis=1, dtype=np.float64)
        sums = np.take_along_axis(by_id, self.ids[:, :n], axis=1)
        pooled = pool(sums, self.radius, self.pooling)
        return pooled[:, : n - self.recent].argmin(axis=1)

    def remove(self, i, stay):
        self.free = self.ids[self.streams, i]
        close_gap(self.ids_spare, self.ids, stay)
        self.ids, self.ids_spare = self.ids_spare, self.ids


@dataclass
class SnapKV(Policy):
    obs_window: int = param(
        16, label="obsWindow", min=1, ui_max=128, help="observed steps summed per slot",
        source="the SnapKV card: 'the last sixteen steps' (Li et al. 2024, adapted to decoding)")
    pool_kernel: int = param(
        5, label="poolKernel", min=1, ui_max=15, step=2, odd_only=True,
        help="pool width over adjacent kept slots (odd: it has a centre); 1 disables pooling",
        source="the default kernel_size=5 of kvpress's SnapKVPress (NVIDIA kvpress)")
    recent_window: int = param(
        32, label="recentWindow", min=0, ui_max=1024, help="newest positions never evicted",
        source="the same 32 as H2O's fixed recent window (the TOVA card)")
    pooling: str = param(
        "max", label="pooling", choices=("max", "avg"),
        help="how a slot's neighbourhood of window sums is pooled",
        source="the SnapKV card pins max; the official SnapKV code defaults to avg_pool1d "
               "and kvpress's SnapKVPress pools by average")

    name = "snapkv"
    label = "SnapKV"
    rank = Rank("pooled", "pooled window sum", "lowest pooled window sum goes first")
    score_labels = {"sums": "window sum"}
    colour = "#0072B2"
    reference = "kvviz.core.reference:RefSnapKV"
    vectorised = SnapKVStreams

    def check_params(self):
        check_recent(self)

    def columns(self):
        return {"history": (np.float32, (self.obs_window,), 0.0)}  # row k = ring slot k

    def reset_state(self):
        super().reset_state()
        self.slot = 0

    def observe(self, attn):
        self.col("history")[self.slot] = attn
        self.slot = (self.slot + 1) % self.obs_window

    def prefill_rows(self, prompt_len):
        return min(self.obs_window, prompt_len)  # the ring holds the last obs_window rows

    def skip_rows(self, count):
        self.slot = (self.slot + count) % self.obs_window

    def protected_tail(self):
        return self.recent_window

    def sums(self):
        """Per slot, the attention summed over the observation window (float64)."""
        # Reducing over the ring axis (not the contiguous one) adds row 0, then row 1, ...
        # in float64: the card's pinned order, not numpy's pairwise order.
        # tests/test_policies.py::test_snapkv_sums_in_ring_order catches a change.
        return self.col("history").sum(axis=0, dtype=np.float64)

    def pool(self, sums):
        """`sums` pooled over each slot's kept neighbours with this policy's kernel and kind."""
        return pool(sums, (self.pool_kernel - 1) // 2, self.pooling)

    @property
    def pool_radius(self) -> int:
        """How many kept slots on each side of a slot its pooled score reaches (read-only;
        what the app draws as a slot's neighbourhood)."""
        return self.radius_of(self.pool_kernel)

    @staticmethod
    def radius_of(pool_kernel: int) -> int:
        """The pooling radius a `pool_kernel` gives: (pool_kernel - 1) // 2."""
        return (int(pool_kernel) - 1) // 2

    def priority(self):
        return self.pool(self.sums())

    def scores(self):
        sums = self.sums()
        return {"sums": sums, "pooled": self.pool(sums), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        # position, the float32 ring, sums and pooled (doubles), eviction scratch
        return 4 + 4 * self.obs_window + 8 + 8 + 1
