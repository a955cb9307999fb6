"""CAKE (Qin et al., ICLR 2025, arXiv:2503.12491, "Cascading and Adaptive KV cache Eviction
with Layer Preferences"): layer budgets from each layer's attention spread and shift on the
prompt, and within a layer an eviction indicator that adds the attention's variance over
time to its mean.

Layer budgets (the paper's Section 4.1, Eqs. 3-6, and its code's preference score): from the
calibration rows (`calibration`: the first N rows of every head's stream, read with the full
cache) the observation window is the last `window` rows, and the prefix the positions before
the window's first row (0..N-window-1). For layer l, over its KV heads, the window's rows and
the prefix positions:

- spread H_l = -sum a x log(a + 1e-10) (the entropy of the window's attention, summed as the
  code sums it: over heads, rows and positions);
- shift V_l = sum over heads and positions of the variance over the window's rows (unbiased,
  as torch.var);
- preference P_l = H_l^(1/tau1) x V_l^(1/tau2).

With w the window (the newest positions every head keeps: CAKE keeps the observation window
in every layer; kvviz gives it to the SnapKV scorer as its `recentWindow`) and B the budget,
the layers share L x (B - w) slots: every layer first gets one (a head needs a slot beyond
its window to evict from; the paper's budgets are far above its window), then the other
L x (B - w - 1) go in proportion to P_l: layer l gets floor(P_l / sum P x that), and the
slots left over one each to the layers in order, shallowest first, as the code's
adjust_budgets does (equal shares first when more are left than layers). Its budget is
w + 1 + its share. Rows too few for a window and a prefix, or every preference 0, keep the
budget in every layer.

Within a layer (Section 4.2, Eq. 7) each head keeps its layer's budget; its victims are its
own candidates with the lowest indicator mean + gamma x variance of their attention over the
scorer's ring of the last `window` observed steps (SnapKV's ring, its `obsWindow` set to the
window: the scorer must be snapkv; mean over the ring, variance unbiased), average-pooled over the kept neighbours with
kernel 5 (the code's avg_pool1d, kernel 5; kvviz divides by the neighbours present, the
code's zero padding by 5), ties to the lower position. The paper computes it once on the
prompt's window; kvviz keeps it over the ring at every step (decode-time), as kvviz's SnapKV
adapts SnapKV.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.alloc import Allocator
from kvviz.core.policies.base import param
from kvviz.core.policies.headkv import probe_tail, with_window
from kvviz.core.policies.snapkv import pool

INDICATOR_KERNEL = 5  # the code's avg_pool1d kernel_size for the indicator


def preference(rows: list, window: int, tau1: float, tau2: float) -> float | None:
    """P_l from one layer's calibration rows (rows[g][t], row t over positions 0..t-1);
    None when the rows are too few for a window and a prefix."""
    n = min(len(r) for r in rows)
    prefix = n - window
    if prefix < 1 or window < 1:
        return None
    spread = 0.0
    shift = 0.0
    for head in rows:
        win = np.stack([np.asarray(head[t], np.float64)[:prefix] for t in range(prefix, n)])  # (window, prefix)
        spread += float(-(win * np.log(win + 1e-10)).sum())
        shift += float(win.var(axis=0, ddof=1).sum()) if window > 1 else 0.0
    if spread <= 0 or shift <= 0:
        return 0.0
    return spread ** (1.0 / tau1) * shift ** (1.0 / tau2)


def share_out(prefs: list, pool_size: int) -> list[int]:
    """floor(P_l / sum P x pool), then what is left one each, shallowest first (equal shares
    first when more is left than layers), as CAKE's adjust_budgets."""
    total = sum(prefs)
    out = [int(p / total * pool_size) for p in prefs]
    left = pool_size - sum(out)
    L = len(out)
    for d in range(L):
        out[d] += left // L + (1 if d < left % L else 0)
    return out


@dataclass
class CAKE(Allocator):
    scorer: str = param("snapkv", label="scorer", choices=("snapkv",),
                        help="the per-head policy whose candidates may go and whose ring of observed "
                             "steps the indicator reads (snapkv)",
                        source="CAKE's indicator reads the observation window's attention, as SnapKV's "
                               "ring holds it (Qin et al. 2025, Section 4.2)")
    tau1: float = param(1.0, label="tau1", min=0.01, ui_max=5.0, step=0.1,
                        help="the spread's temperature: P = H^(1/tau1) x V^(1/tau2)",
                        source="Qin et al. 2025, Eq. 5; the code tunes it per model and budget "
                               "(0.4-1.9 in its model2tau.json); 1 is neutral")
    tau2: float = param(1.0, label="tau2", min=0.01, ui_max=5.0, step=0.1,
                        help="the shift's temperature: P = H^(1/tau1) x V^(1/tau2)",
                        source="Qin et al. 2025, Eq. 5; the code tunes it per model and budget "
                               "(0.4-2.3 in its model2tau.json); 1 is neutral")
    gamma: float = param(200.0, label="gamma", min=0.0, ui_max=1000.0, step=10.0,
                         help="the indicator's weight on the variance: mean + gamma x variance",
                         source="Qin et al. 2025, Eq. 7; gamma=200 in the paper's experiments")
    window: int = param(32, label="window", min=1, ui_max=256,
                        help="the observation window: the last calibration rows that set the "
                             "layers' preferences, the newest positions every head keeps and the "
                             "steps its indicator reads (the scorer's recentWindow and obsWindow)",
                        source="CAKE's code, CompressConfig window_size=32 (Qin et al. 2025)")
    calibration: int = param(64, label="calibration", min=2, ui_max=4096,
                             help="rows of each head's stream, read with the full cache before "
                                  "eviction starts, that set the layers' budgets",
                             source="kvviz choice: the paper reads the whole prompt once; kvviz "
                                    "plans on the first rows, at most 64")

    name = "cake"
    label = "CAKE"
    victim_order = None  # by CAKE's indicator, not the scorer's own priority
    reference = "kvviz.core.reference_alloc:RefCAKE"

    def check_params(self):
        if self.scorer != "snapkv":
            raise ValueError(f"scorer must be snapkv (CAKE's indicator reads its ring of observed "
                             f"steps), got scorer={self.scorer!r}")
        if self.window >= self.calibration:
            raise ValueError(f"window must be below calibration (the window's rows need positions "
                             f"before them): window={self.window}, calibration={self.calibration}")
        self._tail = probe_tail(self, recent_window=self.window, obs_window=self.window)

    @classmethod
    def scorer_settings(cls, own, scorer, params):
        window = own.get("window", 32)
        return with_window(scorer, params, recent_window=window, obs_window=window)

    def make_scorer(self, budget, place):
        """SnapKV with CAKE's window as its recent window and its ring (obsWindow)."""
        return self.build_policy(self.scorer, budget, place, **with_window(
            self.scorer, self.scorer_params, recent_window=self.window, obs_window=self.window))

    def calibration_rows(self):
        return self.calibration

    def plan_layers(self, rows_by_layer):
        prefs = [preference(rows, self.window, self.tau1, self.tau2) for rows in rows_by_layer]
        if any(p is None for p in prefs) or not sum(prefs) > 0 or not all(math.isfinite(p) for p in prefs):
            return None
        tail = min(self._tail, self.budget - 1)
        L = len(prefs)
        shares = share_out(prefs, L * (self.budget - tail) - L)  # after one slot each
        return [tail + 1 + s for s in shares]

    def indicator(self, policy) -> np.ndarray:
        """Per held slot, mean + gamma x variance of its ring, pooled by average (float64)."""
        ring = policy.col("history")  # (obs_window, n) float32, one row per ring slot
        W = ring.shape[0]
        total = np.zeros(ring.shape[1], np.float64)
        for k in range(W):  # ring slot 0 upward
            total += ring[k]
        mean = total / W
        sq = np.zeros(ring.shape[1], np.float64)
        for k in range(W):
            d = ring[k].astype(np.float64) - mean
            sq += d * d
        var = sq / (W - 1) if W > 1 else sq
        return pool(mean + self.gamma * var, (INDICATOR_KERNEL - 1) // 2, "avg")

    def choose_group(self, group):
        out = []
        for p in group.policies:
            excess = len(p.held()) - group.b
            if excess <= 0:
                out.append(np.empty(0, np.int64))
                continue
            idx = np.flatnonzero(p.candidates())
            score = self.indicator(p)[idx]
            order = np.lexsort((idx, score))  # lowest indicator, then the lower position
            if len(order) < excess:
                raise ValueError(f"evict needs {excess} victims but only {len(order)} slots are candidates")
            out.append(np.sort(idx[order[:excess]]))
        return out
