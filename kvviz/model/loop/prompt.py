"""A prompt read in one pass: its attention rows reach the policies a block of queries at a
time (`PromptFeed`), then every configuration evicts once at the prompt's last row.
"""
from __future__ import annotations

import time

import numpy as np

from kvviz.core import harness
from kvviz.core.policies.base import BudgetError
from kvviz.model.loop.attention import use
from kvviz.model.loop.bookkeeping import reads_query_rows
from kvviz.model.loop.cache import State
from kvviz.model.loop.config import PREFILL_CHUNK, check_chunk


class PromptFeed:
    """A prompt's attention rows on their way to the policies, per (layer, stream): one
    kvviz.core.harness.PromptRows each, built with what its configs' policies need
    (harness.prefill_needs), so memory stays linear in the prompt's length. Policies that
    need every row are fed them here, in order, as the blocks are computed. After the
    forward it is each configuration's prompt (kvviz.core.groups: `length`, `rows(s)`,
    `key_norms(s)`, `value_norms(s)`, `calibration(s)` by stream s = layer x G + head)."""

    def __init__(self, T0: int, configs, policies, L: int, G: int, chunk: int = PREFILL_CHUNK):
        check_chunk(chunk)
        self.T0, self.chunk, self.seconds = T0, int(chunk), 0.0
        self.length, self.G = T0, G
        self.rows = []
        self.norms = self.vnorms = None
        self.everything = False
        self.query = reads_query_rows(policies)  # each row's query heads go to the policies too
        tails = [0]
        for layer in range(L):
            per = []
            for g in range(G):
                tail, sums, streamed = 1, False, []
                for group in policies:
                    p = group.stream_policy(layer * G + g)
                    if p is None:
                        continue
                    t, s, st = harness.prefill_needs(p, T0)
                    tail, sums = max(tail, t), sums or s
                    if st:
                        streamed.append(p)
                    if p.reads_key_norms and self.norms is None:
                        self.norms = np.zeros((L, G, T0), np.float32)
                    if p.reads_value_norms and self.vnorms is None:
                        self.vnorms = np.zeros((L, G, T0), np.float32)
                per.append(harness.PromptRows(T0, tail, sums, streamed))
                tails.append(tail)
                self.everything = self.everything or sums or bool(streamed)
            self.rows.append(per)
        self.first = 0 if self.everything else T0 - max(tails)
        # an allocator that decides from calibration rows (head roles) gets the prompt's first ones
        self.calib_n = max((min(group.calibration_rows, T0) for group in policies), default=0)
        self.calib = [[[] for _ in range(G)] for _ in range(L)] if self.calib_n else None

    def wants(self, a: int, b: int) -> bool:
        """Whether any policy reads prompt rows a..b-1 (or an allocator calibrates on them)."""
        return b > self.first or a < self.calib_n

    def set_norms(self, which: str, layer: int, norms) -> None:
        """A layer's prompt key or value norms (G, T0), kept when a policy reads them."""
        store = self.norms if which == "key" else self.vnorms
        if store is not None:
            store[layer] = norms

    def add(self, layer: int, start: int, rows, query_rows=None) -> None:
        t0 = time.perf_counter()
        if self.calib is not None:
            for g in range(len(self.calib[layer])):
                for i in range(min(len(rows[g]), self.calib_n - start)):
                    self.calib[layer][g].append(rows[g][i, : start + i].copy())
        for g, per in enumerate(self.rows[layer]):
            per.add(start, rows[g], None if self.norms is None else self.norms[layer, g],
                    None if self.vnorms is None else self.vnorms[layer, g],
                    None if query_rows is None else query_rows[g])
        self.seconds += time.perf_counter() - t0

    # -- the prompt, by stream (kvviz.core.groups) -------------------------------------
    def rows_of(self, s: int):
        return self.rows[s // self.G][s % self.G]

    def key_norms(self, s: int):
        return None if self.norms is None else self.norms[s // self.G, s % self.G]

    def value_norms(self, s: int):
        return None if self.vnorms is None else self.vnorms[s // self.G, s % self.G]

    def calibration(self, s: int) -> list:
        return self.calib[s // self.G][s % self.G]

    def evict(self, configs, policies, evicted_at) -> None:
        """After the prompt's forward: every configuration evicts once, down to its budget, at
        the prompt's last row (StreamGroup.prefill); victims logged at step T0 - 1."""
        t0 = time.perf_counter()
        for c, cfg in enumerate(configs):
            try:
                streams, victims = policies[c].prefill(_Prompt(self))
            except BudgetError as exc:
                raise type(exc)(f"{cfg.label}, {exc}") from None
            evicted_at[c].reshape(-1, evicted_at.shape[-1])[streams, victims] = self.T0 - 1
        self.seconds += time.perf_counter() - t0


class _Prompt:
    """A PromptFeed as a group's prompt (`rows(s)` is the feed's `rows_of`)."""

    def __init__(self, feed: PromptFeed):
        self.length, self.rows = feed.T0, feed.rows_of
        self.key_norms, self.value_norms, self.calibration = feed.key_norms, feed.value_norms, feed.calibration


def prompt_state(torch, T0: int, configs, policies, L: int, Hk: int, G: int, chunk: int, device) -> State:
    """The State a prompt is read through in one pass: nothing to mask, a PromptFeed armed."""
    st = State(torch, 1, L, Hk, G, 0, device)
    st.bias_t = None  # nothing is evicted while the prompt is read
    st.feed = PromptFeed(T0, configs, policies, L, G, chunk)
    return st


def read_prompt(mdl, torch, ids_t, configs, policies, evicted_at, G: int, chunk: int, device):
    """A prompt read in one pass with the full cache (batch 1), its rows fed to the policies a
    block at a time (PromptFeed), then each policy's one-shot eviction. Returns (the cache,
    the last position's logits (1, V), the feed)."""
    from transformers import DynamicCache

    from kvviz.model.models import attention_shape

    shape = attention_shape(mdl)
    L, Hk = shape.layers, shape.kv_heads
    T0 = int(ids_t.shape[0])
    st = prompt_state(torch, T0, configs, policies, L, Hk, G, chunk, device)
    cache = DynamicCache()
    use(mdl, st)
    try:
        with torch.no_grad():
            out = mdl(input_ids=ids_t.view(1, T0), position_ids=torch.arange(T0, device=device).view(1, T0),
                      cache=cache, use_cache=True, logits_to_keep=1)  # not (T0, vocabulary) logits
            logits = out.logits[:, -1]
            del out
    finally:
        use(mdl, None)
    st.feed.evict(configs, policies, evicted_at)
    return cache, logits, st.feed
