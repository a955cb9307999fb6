"""Slow references for the policies that read key and query vectors, from the papers' rules
as plain loops over Python floats: R-KV and Expected Attention.

Same interface as kvviz.core.reference's (kept, held, on_decode_step, advance, evict), so
`kvviz check --reference` and the differential tests drive both through the same calls.
Each keeps the key it was given for a position when it admitted it (the last row of the
step's `keys`), rather than the fast policies' per-step copy of the cache's keys, so the
two bookkeepings are checked against each other as well.
"""
from __future__ import annotations

import math

import numpy as np

from kvviz.core.policies import make_policy


def _floats(vector) -> list:
    return [float(x) for x in np.asarray(vector, np.float32)]


def _dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b))


def _softmax(xs) -> list:
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    total = sum(e)
    return [v / total for v in e]


class RefVectors:
    """The kept list, each kept position's key, the eviction by (score, position)."""

    name = ""

    def __init__(self, budget, rng=None, **params):
        self.fast = make_policy(self.name, budget=budget, rng=rng, **params)  # same refusals
        self.budget = budget
        self.params = self.fast.params
        self.bytes_per_slot = self.fast.bytes_per_slot
        for flag in ("uses_attention", "reads_key_norms", "reads_value_norms", "reads_query_rows",
                     "reads_keys", "reads_queries"):
            setattr(self, flag, getattr(self.fast, flag))
        self.keep, self.key, self.vnorm = [], [], []
        self.queries = []  # every query given, (position, [per head: list of floats])

    @property
    def kept(self):
        """The kept positions, ascending, as the fast policy's `kept`."""
        return np.array(self.keep, dtype=np.int64)

    def held(self):
        """The positions the next query attends over: all kept ones."""
        return self.kept

    def advance(self, pos, attn, key_norm=None, value_norm=None, query_rows=None, keys=None,
                query=None):
        """The harness's name for one decode step; the same as `on_decode_step`."""
        self.on_decode_step(pos, attn, key_norm, value_norm, query_rows, keys, query)

    def on_decode_step(self, pos, attn, key_norm=None, value_norm=None, query_rows=None,
                       keys=None, query=None):
        """Admit `pos`, keeping its key (the last row of `keys`), its value norm and the
        step's query; the input checks written out again, loop by loop."""
        if self.keep and pos <= self.keep[-1]:
            raise ValueError("pos must be above every kept position")
        if keys is None or query is None:
            raise ValueError(f"{self.name} reads key and query vectors")
        keys = np.asarray(keys, np.float32)
        if keys.ndim != 2 or len(keys) != len(self.keep) + 1:
            raise ValueError("keys must be one row per kept position and the admitted one")
        query = np.asarray(query, np.float32)
        if query.ndim == 1:
            query = query[None]
        for row in [*keys, *query]:
            for x in row:
                if not math.isfinite(float(x)):
                    raise ValueError("keys and query must be finite")
        if self.reads_value_norms:
            if value_norm is None or not math.isfinite(value_norm) or value_norm < 0:
                raise ValueError("value_norm must be a finite non-negative L2 norm")
            self.vnorm.append(float(np.float32(value_norm)))
        else:
            self.vnorm.append(None)
        self.queries.append((int(pos), [_floats(h) for h in query]))
        self.keep.append(int(pos))
        self.key.append(_floats(keys[-1]))  # the admitted position's key, kept from now on

    def evict(self, budget):
        """Drop down to `budget`: the candidates ranked by (score, position), the lowest go;
        the victims come back ascending. Fewer candidates than victims due is refused."""
        excess = len(self.keep) - budget
        if excess <= 0:
            return np.empty(0, np.int64)
        score = self.candidate_scores()  # slot index -> score, candidates only
        if len(score) < excess:
            raise ValueError(f"evict needs {excess} victims but only {len(score)} slots are candidates")
        ranked = sorted((s, self.keep[i], i) for i, s in score.items())
        chosen = sorted(i for _, _, i in ranked[:excess])
        victims = [self.keep[i] for i in chosen]
        for i in reversed(chosen):
            del self.keep[i], self.key[i], self.vnorm[i]
        return np.array(victims, dtype=np.int64)


class RefRKV(RefVectors):
    """R-KV's rule (Cai et al. 2025; the authors' code, rkv/utils.py and r1_kv.py), one
    candidate at a time: the `window` newest slots stay and their queries observe."""

    name = "rkv"

    def candidate_scores(self) -> dict:
        """Slot index -> R-KV's score, for every slot outside the `window` newest."""
        lam, window = self.params["mix_lambda"], self.params["window"]
        kernel, threshold = self.params["kernel_size"], self.params["threshold"]
        n = len(self.keep)
        m = n - window
        if m <= 0:
            return {}
        d = len(self.key[0])
        observers = [q for _, q in self.queries[-window:]]
        # importance: per observation query, the heads' highest logit on each candidate,
        # softmaxed over the candidates; the mean over the queries; then a centred max-pool
        mean = [0.0] * m
        for heads in observers:
            pooled = [max(_dot(h, self.key[j]) / math.sqrt(d) for h in heads) for j in range(m)]
            for j, share in enumerate(_softmax(pooled)):
                mean[j] += share
        mean = [v / len(observers) for v in mean]
        half = kernel // 2
        importance = [max(mean[max(0, j - half): j + half + 1]) for j in range(m)]
        # redundancy: cosine similarity of every pair of kept keys, the diagonal zeroed; in
        # row i the newest j above the threshold (or the first, if none) is zeroed too
        unit = [[x / (math.sqrt(_dot(k, k)) + 1e-8) for x in k] for k in self.key]
        sim = [[0.0 if i == j else _dot(unit[i], unit[j]) for j in range(n)] for i in range(n)]
        for i in range(n):
            above = [j for j in range(n) if sim[i][j] > threshold]
            sim[i][above[-1] if above else 0] = 0.0
        column_means = [sum(sim[i][j] for i in range(n)) / n for j in range(n)]
        redundancy = _softmax(column_means)
        return {j: lam * importance[j] - (1 - lam) * redundancy[j] for j in range(m)}


class RefExpectedAttention(RefVectors):
    """Expected Attention's rule (Devoto et al. 2025; kvpress's ExpectedAttentionPress), one
    key at a time: the queries' statistics before RoPE, rotated by RoPE's mean rotation over
    the next positions, give each key a Gaussian expected logit per head."""

    name = "expected-attention"

    def candidate_scores(self) -> dict:
        """Slot index -> the expected attention (x the value norm), for every slot past the sinks."""
        p = self.params
        sinks = p["n_sink"]
        n = len(self.keep)
        if n <= sinks:
            return {}
        d = len(self.key[0])
        half = d // 2
        if d % 2:
            raise ValueError("query's head_dim must be even")
        theta = p["rope_theta"] or getattr(self, "run_rope_theta", None)  # 0: the run's
        if theta is None:
            raise ValueError("rope_theta is the run's RoPE base, and none was given")
        freq = [theta ** (-2 * i / d) for i in range(half)]
        now = self.queries[-1][0]  # the current step's position

        def unrotate(pos, q):  # RoPE at `pos` undone: dimension i pairs with i + d/2
            out = [0.0] * d
            for i in range(half):
                c, s = math.cos(-pos * freq[i]), math.sin(-pos * freq[i])
                out[i] = q[i] * c - q[i + half] * s
                out[i + half] = q[i + half] * c + q[i] * s
            return out

        used = [(pos, q) for pos, q in self.queries if pos >= sinks][-p["query_window"]:]
        plain = [[unrotate(pos, h) for h in q] for pos, q in used]
        heads = len(self.queries[-1][1])
        N = len(plain)
        mu = [[sum(x[h][i] for x in plain) / N if N else 0.0 for i in range(d)] for h in range(heads)]
        cov = [[[sum((x[h][i] - mu[h][i]) * (x[h][j] - mu[h][j]) for x in plain) / N if N else 0.0
                 for j in range(d)] for i in range(d)] for h in range(heads)]
        # RoPE's rotation averaged over the positions now + 1 .. now + n_future_positions
        future = range(now + 1, now + 1 + p["n_future_positions"])
        cbar = [sum(math.cos(t * freq[i]) for t in future) / len(future) for i in range(half)]
        sbar = [sum(math.sin(t * freq[i]) for t in future) / len(future) for i in range(half)]
        R = [[0.0] * d for _ in range(d)]
        for i in range(half):
            R[i][i] = R[i + half][i + half] = cbar[i]
            R[i][i + half], R[i + half][i] = -sbar[i], sbar[i]
        mu = [[_dot(R[i], mu[h]) for i in range(d)] for h in range(heads)]
        if p["use_covariance"]:
            cov = [[[sum(R[i][a] * cov[h][a][b] * R[j][b] for a in range(d) for b in range(d))
                     for j in range(d)] for i in range(d)] for h in range(heads)]
        scored = range(sinks, n)
        expected = [0.0] * n
        for h in range(heads):
            logits = []
            for j in scored:
                k = self.key[j]
                z = _dot(mu[h], k) / math.sqrt(d)
                if p["use_covariance"]:
                    z += sum(k[a] * cov[h][a][b] * k[b] for a in range(d) for b in range(d)) / d / 2
                logits.append(z)
            for j, share in zip(scored, _softmax(logits)):
                expected[j] += share / heads
        if not p["use_vnorm"]:
            return {j: expected[j] for j in scored}
        return {j: (expected[j] + p["epsilon"]) * self.vnorm[j] for j in scored}
