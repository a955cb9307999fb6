"""SnapKV (Li et al., NeurIPS 2024, arXiv:2404.14469), adapted to decode-time eviction.

Each slot keeps a float32 ring of its weights over the last `obs_window` observed steps.
At eviction the ring is summed afresh (float64, ring slot 0 upward, never a running
total), max-pooled over adjacent kept slots with radius (pool_kernel-1)/2, and the
lowest pooled score outside the `recent_window` newest positions goes.
"""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import ParamSpec, Policy, check_recent


@dataclass
class SnapKV(Policy):
    obs_window: int = 16
    pool_kernel: int = 5
    recent_window: int = 32

    name = "snapkv"
    specs: ClassVar = (
        ParamSpec("obs_window", "obsWindow", 16, 1, 128, help="observed steps summed per slot",
                  source="the SnapKV card: 'the last sixteen steps' (Li et al. 2024, adapted "
                         "to decoding)"),
        ParamSpec("pool_kernel", "poolKernel", 5, 1, 15, step=2, odd_only=True,
                  help="max-pool width over adjacent kept slots; 1 disables pooling",
                  source="the default kernel_size=5 of kvpress's SnapKVPress (NVIDIA kvpress)"),
        ParamSpec("recent_window", "recentWindow", 32, 0, 1024, help="newest positions never evicted",
                  source="the same 32 as H2O's fixed recent window (the TOVA card)"),
    )

    def check_params(self):
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be odd and >= 1 (an even kernel has no centre), "
                             f"got {self.pool_kernel}")
        if self.obs_window < 1:
            raise ValueError(f"obs_window must be >= 1, got {self.obs_window}")
        check_recent(self)

    def columns(self):
        return {"history": (np.float32, (self.obs_window,), 0.0)}  # row k = ring slot k

    def reset_state(self):
        super().reset_state()
        self.slot = 0

    def observe(self, attn):
        self.col("history")[self.slot] = attn
        self.slot = (self.slot + 1) % self.obs_window

    def protected_tail(self):
        return self.recent_window

    def sums(self):
        # Reducing over the ring axis (not the contiguous one) adds row 0, then row 1, ...
        # in float64: the card's pinned order, not numpy's pairwise order.
        # tests/test_policies.py::test_snapkv_sums_in_ring_order catches a change.
        return self.col("history").sum(axis=0, dtype=np.float64)

    def pool(self, sums):
        pooled = sums.copy()
        for d in range(1, (self.pool_kernel - 1) // 2 + 1):
            np.maximum(pooled[d:], sums[:-d], out=pooled[d:])
            np.maximum(pooled[:-d], sums[d:], out=pooled[:-d])
        return pooled

    def priority(self):
        return self.pool(self.sums())

    def scores(self):
        sums = self.sums()
        return {"sums": sums, "pooled": self.pool(sums), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        # position, the float32 ring, sums and pooled (doubles), eviction scratch
        return 4 + 4 * self.obs_window + 8 + 8 + 1
