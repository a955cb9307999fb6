"""Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution", arXiv:2510.00636; kvpress's
ExpectedAttentionPress): a key's expected attention from the queries still to come.

The queries are modelled as a Gaussian: the mean and covariance of the recent queries
before RoPE, per query head, each rotated by RoPE's rotation averaged over the next
`n_future_positions` positions. A key k (after RoPE, as the cache holds it) then draws,
per head, the logit mu.k / sqrt(d) + k' Sigma k / (2d) (the second term only with
`use_covariance`); the logits are softmaxed over the scored keys, averaged over the
stream's query heads, and with `use_vnorm` the score is (that + epsilon) x the key's value
norm. The lowest score goes; the first `n_sink` slots are never victims.

This is kvpress's rule (kvpress/presses/expected_attention_press.py, 0.5.x), run at every
step. Where it differs from kvpress's DecodingPress(ExpectedAttentionPress), stated:

- kvpress scores every `compression_interval` decode steps (default 512) down to
  `target_size`; kvviz scores whenever the budget is exceeded (every step): a
  compression_interval of 1 with target_size = budget. (kvpress clears its buffer at each
  compression and drops its first n_sink hidden states, so at an interval of 1 it would
  have no queries left: kvviz keeps a rolling window instead.)
- kvpress's statistics come from the buffered hidden states times W_q (its
  hidden_states_buffer_size, 256); kvviz reads the model's queries after RoPE and undoes
  RoPE at each query's own position (rotate-half layout, `rope_theta`: by default the
  run's, the model's config in the model loop, the trace's recorded base in a replay), keeping the last
  `query_window` of them: the same pre-RoPE queries for a model with plain RoPE (no
  rope scaling, no QK norm; kvpress refuses QK-norm models too).
- kvpress drops the prompt's first n_sink hidden states from the statistics; kvviz drops
  the queries at positions below n_sink.
- kvpress averages the rotation over positions q_len .. q_len + n_future_positions - 1
  with q_len the number of buffered hidden states; kvviz over the positions after the
  current one, pos + 1 .. pos + n_future_positions (what kvpress does at a prefill).
- with no query yet past the sinks the statistics are zero (every candidate's softmax share
  is equal, so the value norm decides); kvpress would divide by zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies.base import Rank, param
from kvviz.core.policies.vectors import (
    RUN_ROPE_THETA,
    ReadsKeys,
    inverse_frequencies,
    mean_rotation,
    rope_theta_of,
    rotate,
)

_PRESS = "kvpress ExpectedAttentionPress"


def run_or_base(value: float) -> float:
    """0 (the run's RoPE base) or a base >= 1"""
    if value != RUN_ROPE_THETA and value < 1:
        raise ValueError("a RoPE base below 1 turns the rotation backwards")
    return value


def query_statistics(queries: np.ndarray, head_dim: int, theta: float, pos: int, n_future: int,
                     covariance: bool):
    """(mu (g, d), cov (g, d, d) or None), float64: the mean and (biased, over N) covariance
    of `queries` (N, g, d, before RoPE), each rotated by the mean rotation over positions
    pos + 1 .. pos + n_future. With N = 0, zeros."""
    g = queries.shape[1]
    if len(queries):
        mu = queries.mean(axis=0)
        centred = queries - mu
        cov = np.einsum("ngi,ngj->gij", centred, centred) / len(queries) if covariance else None
    else:
        mu = np.zeros((g, head_dim))
        cov = np.zeros((g, head_dim, head_dim)) if covariance else None
    R = mean_rotation(head_dim, theta, pos + 1, n_future)
    mu = mu @ R.T
    if covariance:
        cov = R @ cov @ R.T
    return mu, cov


@dataclass
class ExpectedAttention(ReadsKeys):
    n_future_positions: int = param(
        512, label="n_future_positions", min=1, ui_max=4096,
        help="RoPE's rotation is averaged over this many positions after the current one",
        source=_PRESS + "(n_future_positions=512); Devoto et al. 2025, section 3")
    n_sink: int = param(
        4, label="n_sink", min=0, ui_max=64,
        help="first slots never evicted; queries at positions below it are left out of the statistics",
        source=_PRESS + "(n_sink=4)")
    use_covariance: bool = param(
        True, label="use_covariance",
        help="add the queries' covariance term k' Sigma k / (2d) to each logit",
        source=_PRESS + "(use_covariance=True)")
    use_vnorm: bool = param(
        True, label="use_vnorm", help="multiply (score + epsilon) by the value's L2 norm",
        source=_PRESS + "(use_vnorm=True)")
    epsilon: float = param(
        0.0, label="epsilon", min=0.0, ui_max=1.0, step=0.01,
        help="added to each expected attention before the value norm multiplies it",
        source=_PRESS + "(epsilon=0.0)")
    query_window: int = param(
        256, label="query_window", min=1, ui_max=4096,
        help="how many recent queries the mean and covariance are taken over",
        source="kvpress DecodingPress(hidden_states_buffer_size=256)")
    rope_theta: float = param(
        RUN_ROPE_THETA, label="rope_theta", min=0.0, ui_max=1e7, validate=run_or_base,
        help="the model's RoPE base, to undo RoPE on the queries and average it over future "
             "positions; 0: the run's",
        source="0 (the default) takes the run's: the model's config (rope_theta, or "
               "rope_parameters' rope_theta) in the model loop, the trace's meta rope_theta "
               "(recorded by kvviz capture) in a replay; a value given is checked against it")

    name = "expected-attention"
    label = "Expected Attention"
    colour = "#AA7744"
    rank = Rank("score", "expected attention x value norm", "lowest score goes first")
    score_labels = {"expected": "expected attention (softmax share, mean over query heads)",
                    "value_norm": "value L2 norm"}
    reference = "kvviz.core.reference_vectors:RefExpectedAttention"
    uses_attention = False
    reads_queries = True
    reads_value_norms = True

    def check_params(self):
        if self.n_sink >= self.budget:
            raise ValueError(f"n_sink must be smaller than budget: n_sink={self.n_sink} >= "
                             f"budget={self.budget} leaves no room to evict")

    def columns(self):
        return {"value_norm": (np.float32, (), 0.0)}

    def reset_state(self):
        super().reset_state()
        self.queries = []  # the last `query_window` queries past the sinks, before RoPE, float64
        self.pos = -1

    def advance(self, pos, attn, key_norm=None, value_norm=None, query_rows=None, keys=None,
                query=None):
        self.pos = int(pos)
        if query is not None:
            d = query.shape[1]
            if d % 2:
                raise ValueError(f"query's head_dim must be even (RoPE pairs dimensions), got {d}")
            if pos >= self.n_sink:
                plain = rotate(query.astype(np.float64), -pos * inverse_frequencies(d, self._theta()))
                self.queries = (self.queries + [plain])[-self.query_window:]
        super().advance(pos, attn, keys=keys)
        if value_norm is not None:
            self.col("value_norm")[-1] = value_norm

    def _theta(self) -> float:
        """The RoPE base undone: the declared one, else the run's (set by the harness feeding
        the queries, kvviz.core.policies.vectors.use_rope_theta)."""
        theta = rope_theta_of(self)
        if theta is None:
            raise ValueError(f"{self.name}'s rope_theta is by default the run's RoPE base, and "
                             "this run gave none: pass rope_theta=<the model's RoPE base>, or "
                             "replay a trace that records it or run the model loop")
        return theta

    def candidates(self):
        cand = np.ones(self._n, bool)
        cand[: self.n_sink] = False
        return cand

    def _parts(self):
        """(expected attention, score) of the slots after the sinks, float64 each."""
        s = min(self.n_sink, self._n)
        if self._n == s or self.keys is None:
            return np.zeros(0), np.zeros(0)
        keys = self.keys[s:].astype(np.float64)
        d = keys.shape[1]
        g = self.queries[0].shape[0] if self.queries else 1
        qs = np.stack(self.queries) if self.queries else np.zeros((0, g, d))
        mu, cov = query_statistics(qs, d, self._theta(), self.pos, self.n_future_positions,
                                   self.use_covariance)
        logits = mu @ keys.T / math.sqrt(d)  # (g, m)
        if self.use_covariance:
            logits = logits + np.einsum("mi,gij,mj->gm", keys, cov, keys) / d / 2
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        expected = (e / e.sum(axis=1, keepdims=True)).mean(axis=0)
        if not self.use_vnorm:
            return expected, expected
        return expected, (expected + self.epsilon) * self.col("value_norm")[s:].astype(np.float64)

    def priority(self):
        out = np.full(self._n, np.inf)
        score = self._parts()[1]
        out[self._n - len(score):] = score
        return out

    def scores(self):
        expected, score = self._parts()
        pad = np.full(self._n - len(score), np.nan)
        return {"score": np.concatenate([pad, score]), "expected": np.concatenate([pad, expected]),
                "value_norm": self.col("value_norm").astype(np.float64), "candidate": self.candidates()}

    @property
    def bytes_per_slot(self):
        return 4 + 4 + 1  # position, value norm (float32), eviction scratch; keys are the cache's
