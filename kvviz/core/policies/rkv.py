"""R-KV (Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models",
arXiv:2505.24133): decode-time eviction that keeps important keys and drops redundant ones.

Each candidate's score is `mix_lambda x importance - (1 - mix_lambda) x redundancy`; the
lowest goes. The `window` newest slots are never victims, and their queries (the last
`window` steps') are the observation window:

- importance: each observation query's logits q.k / sqrt(head_dim) on the candidates,
  max-pooled over the stream's query heads, softmaxed over the candidates, averaged over the
  observation queries, then max-pooled along the slots with a `kernel_size` window;
- redundancy: the cosine similarity of every pair of kept keys (the diagonal zeroed); in
  each key's row the similarity to the newest key more similar than `threshold` (or to
  the first key, when none is) is zeroed, so the latest copy of a repeated thought survives;
  each key's mean similarity down its column, softmaxed over the kept keys.

The rule is the authors' code's (github.com/Zefan-Cai/R-KV, rkv/compression/r1_kv.py and
rkv/utils.py, retain_direction="last", pooling="max"). Where kvviz differs, stated: the
authors compress every `buffer` (128) steps down to the budget; kvviz evicts as soon as
the budget is exceeded (every step), which is R-KV with a buffer of one. Keys and queries
are the cache's and the model's (after RoPE), read at every step: R-KV keeps the last
`window` queries (window x group x head_dim floats per stream, not per slot), and nothing
per slot but its position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Rank, check_recent, param
from kvviz.core.policies.vectors import ReadsKeys

_CODE = "R-KV authors' code (github.com/Zefan-Cai/R-KV), "


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def importance(queries: np.ndarray, keys: np.ndarray, kernel_size: int) -> np.ndarray:
    """R-KV's importance of each of `keys` (m, d) from the observation `queries` (w, g, d),
    float64 (m,): logits max-pooled over the g query heads, softmaxed over the m keys,
    averaged over the w queries, max-pooled along the keys (`kernel_size`, centred)."""
    d = keys.shape[1]
    logits = np.einsum("wgd,md->wgm", queries, keys) / math.sqrt(d)
    mean = _softmax(logits.max(axis=1), axis=-1).mean(axis=0)
    half = kernel_size // 2
    padded = np.pad(mean, half, constant_values=-np.inf)
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel_size)
    return windows.max(axis=1)


def redundancy(keys: np.ndarray, threshold: float) -> np.ndarray:
    """R-KV's redundancy of each of `keys` (n, d), float64 (n,): see the module docstring."""
    n = len(keys)
    unit = keys / (np.linalg.norm(keys, axis=1, keepdims=True) + 1e-8)
    sim = unit @ unit.T
    np.fill_diagonal(sim, 0.0)
    above = sim > threshold
    newest = np.where(above.any(axis=1), n - 1 - np.argmax(above[:, ::-1], axis=1), 0)
    sim[np.arange(n), newest] = 0.0
    return _softmax(sim.mean(axis=0))


@dataclass
class RKV(ReadsKeys):
    mix_lambda: float = param(
        0.07, label="mix_lambda", min=0.0, max=1.0, step=0.01,
        help="weight of importance against redundancy: score = mix_lambda x importance - "
             "(1 - mix_lambda) x redundancy",
        source=_CODE + "R1KV(mix_lambda=0.07); the paper's lambda (Cai et al. 2025, section 3)")
    window: int = param(
        8, label="window", min=1, ui_max=128,
        help="the newest slots never evicted; their queries are the observation window",
        source=_CODE + "R1KV(window_size=8); the paper's alpha observation tokens (section 3)")
    kernel_size: int = param(
        7, label="kernel_size", min=1, ui_max=31, odd_only=True,
        help="width of the max-pool that spreads importance to neighbouring slots",
        source=_CODE + "R1KV(kernel_size=7), as SnapKV pools")
    threshold: float = param(
        0.5, label="threshold", min=-1.0, max=1.0, step=0.05,
        help="a key's similarity to its newest copy above this is not counted as redundancy",
        source=_CODE + "cal_similarity(threshold=0.5), retain_direction='last'")

    name = "rkv"
    label = "R-KV"
    colour = "#6699CC"
    rank = Rank("score", "mix_lambda x importance - (1 - mix_lambda) x redundancy",
                "lowest score goes first")
    score_labels = {"importance": "importance (pooled attention of the observation queries)",
                    "redundancy": "redundancy (softmaxed mean key similarity)"}
    reference = "kvviz.core.reference_vectors:RefRKV"
    uses_attention = False
    reads_queries = True

    def check_params(self):
        check_recent(self, "window")

    def reset_state(self):
        super().reset_state()
        self.queries = []  # the last `window` steps' query vectors, oldest first

    def advance(self, pos, attn, key_norm=None, value_norm=None, query_rows=None, keys=None,
                query=None):
        if query is not None:
            self.queries = (self.queries + [query])[-self.window:]
        super().advance(pos, attn, keys=keys)

    def protected_tail(self):
        return self.window

    def _parts(self):
        """(importance, redundancy, score) of the candidates, float64 each."""
        m = max(self._n - self.window, 0)
        if not m or self.keys is None:
            empty = np.zeros(m)
            return empty, empty, empty
        keys = self.keys.astype(np.float64)
        imp = importance(np.stack(self.queries).astype(np.float64), keys[:m], self.kernel_size)
        red = redundancy(keys, self.threshold)[:m]
        return imp, red, self.mix_lambda * imp - (1 - self.mix_lambda) * red

    def priority(self):
        out = np.full(self._n, np.inf)
        score = self._parts()[2]
        out[: len(score)] = score
        return out

    def scores(self):
        imp, red, score = self._parts()
        pad = np.full(self._n - len(score), np.nan)
        return {"score": np.concatenate([score, pad]), "importance": np.concatenate([imp, pad]),
                "redundancy": np.concatenate([red, pad]), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + 1  # position, eviction scratch; keys and queries are the cache's and the model's
