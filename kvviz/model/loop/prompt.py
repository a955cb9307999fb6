"""A prompt read in one pass: its attention rows reach the policies a block of queries at a
time (`PromptFeed`), then every configuration evicts once at the prompt's last row.
"""
from __future__ import annotations

import time

import numpy as np

from kvviz.core import harness
from kvviz.core.groups import PolicyLayers
from kvviz.core.policies.base import BudgetError
from kvviz.core.replay import NEVER
from kvviz.model.loop.attention import rope_policies, use
from kvviz.model.loop.bookkeeping import reads_query_rows
from kvviz.model.loop.cache import State, gathered
from kvviz.model.loop.config import PREFILL_CHUNK, check_chunk


class PromptFeed:
    """A prompt's attention rows on their way to the policies, per (layer, stream): one
    kvviz.core.harness.PromptRows each, built with what its configs' policies need
    (harness.prefill_needs), so memory stays linear in the prompt's length. Policies that
    need every row are fed them here, in order, as the blocks are computed. After the
    forward it is each configuration's prompt (kvviz.core.groups: `length`, `rows(s)`,
    `key_norms(s)`, `value_norms(s)`, `calibration(s)`, and `keys(s)`, `queries(s)` for a
    policy that reads key and query vectors, by stream s = layer x G + head)."""

    def __init__(self, T0: int, configs, policies, L: int, G: int, chunk: int = PREFILL_CHUNK):
        check_chunk(chunk)
        self.T0, self.chunk, self.seconds = T0, int(chunk), 0.0
        self.length, self.G = T0, G
        self.rows = []
        self.norms = self.vnorms = None
        self.everything = False
        self.query = reads_query_rows(policies)  # each row's query heads go to the policies too
        # each layer's keys (Hk, T0, D) and queries (Hq, T0, D), after RoPE, when a policy reads them
        self.vectors = any(harness.reads_vectors(group.stream_policy(0)) for group in policies
                           if group.stream_policy(0) is not None)
        self.keys_by_layer, self.queries_by_layer = [None] * L, [None] * L
        # the policies that undo RoPE: handed the model's base once (`check_rope`)
        self.rope_thetas = rope_policies(policies)
        tails = [0]
        for layer in range(L):
            per = []
            for g in range(G):
                tail, sums, streamed = 1, False, []
                for group in policies:
                    p = group.stream_policy(layer * G + g)
                    if p is None:
                        continue
                    harness.refuse_vectors_in_prefill(p)  # vectors and attention rows: not in one pass
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
        self.on_layer = None  # called with each layer once its rows are fed

    def blocks(self) -> list[tuple[int, int]]:
        """The blocks of at most `chunk` prompt rows some policy reads (or an allocator
        calibrates on), in order: every row, or the calibration rows and the last ones."""
        spans = [(0, self.T0)] if self.everything else [(0, self.calib_n), (self.first, self.T0)]
        if not self.everything and self.calib_n >= self.first:
            spans = [(0, self.T0)]
        return [(a, min(b, a + self.chunk)) for lo, b in spans for a in range(lo, b, self.chunk)]

    def layer_read(self, layer: int) -> None:
        """Every row of `layer` has been fed (the attention function says so): `on_layer`, if set."""
        if self.on_layer is not None:
            self.on_layer(layer)

    def wants(self, a: int, b: int) -> bool:
        """Whether any policy reads prompt rows a..b-1 (or an allocator calibrates on them)."""
        return b > self.first or a < self.calib_n

    def set_norms(self, which: str, layer: int, norms) -> None:
        """A layer's prompt key or value norms (G, T0), kept when a policy reads them."""
        store = self.norms if which == "key" else self.vnorms
        if store is not None:
            store[layer] = norms

    def set_vectors(self, layer: int, keys, queries) -> None:
        """A layer's prompt keys (Hk, T0, D) and queries (Hq, T0, D), kept when a policy reads them."""
        if self.vectors:
            self.keys_by_layer[layer], self.queries_by_layer[layer] = keys, queries

    def _kv_head(self, s: int, what: str):
        layer, g = s // self.G, s % self.G
        keys = self.keys_by_layer[layer]
        if keys is None:
            return None, None, None
        if self.G == 1 and keys.shape[0] > 1:
            raise ValueError(f"the prompt's {what} belong to one KV head, and the model has {keys.shape[0]} KV "
                             "heads: run a policy that reads them at kv-head granularity (--granularity kv-head)")
        return layer, g, keys.shape[0]

    def keys(self, s: int):
        """Stream s's prompt keys (T0, D), or None when none were kept."""
        layer, g, _ = self._kv_head(s, "keys")
        return None if layer is None else self.keys_by_layer[layer][g]

    def queries(self, s: int):
        """Stream s's prompt queries (T0, group, D), or None when none were kept."""
        layer, g, Hk = self._kv_head(s, "queries")
        if layer is None:
            return None
        q = self.queries_by_layer[layer]
        group = q.shape[0] // Hk
        return q[g * group:(g + 1) * group].transpose(1, 0, 2)

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
        self.keys, self.queries = feed.keys, feed.queries


def prompt_state(torch, T0: int, configs, policies, L: int, Hk: int, G: int, chunk: int, device) -> State:
    """The State a prompt is read through in one pass: nothing to mask, a PromptFeed armed."""
    st = State(torch, 1, L, Hk, G, 0, device)
    st.bias_t = None  # nothing is evicted while the prompt is read
    st.feed = PromptFeed(T0, configs, policies, L, G, chunk)
    return st


def read_prompt(mdl, torch, ids_t, configs, policies, evicted_at, G: int, chunk: int, device,
                by_layer: bool = False):
    """A prompt read in one pass with the full cache (batch 1), its rows fed to the policies a
    block at a time (PromptFeed), then each policy's one-shot eviction. Returns (the cache,
    the last position's logits (1, V), the feed). `by_layer` (freed eviction, where
    `evicts_by_layer`): each layer evicts as its rows are read and its cache is gathered
    then (`LayerEviction`, left in `feed.on_layer`: the cache's layers hold only the kept
    positions, by index; `feed.on_layer.state` builds the freed lane)."""
    from transformers import DynamicCache

    from kvviz.model.models import attention_shape

    shape = attention_shape(mdl)
    L, Hk = shape.layers, shape.kv_heads
    T0 = int(ids_t.shape[0])
    st = prompt_state(torch, T0, configs, policies, L, Hk, G, chunk, device)
    cache = DynamicCache()
    if by_layer:
        LayerEviction(torch, cache, st.feed, configs, policies, evicted_at)
    use(mdl, st)
    try:
        with torch.no_grad():
            out = mdl(input_ids=ids_t.view(1, T0), position_ids=torch.arange(T0, device=device).view(1, T0),
                      cache=cache, use_cache=True, logits_to_keep=1)  # not (T0, vocabulary) logits
            logits = out.logits[:, -1]
            del out
    finally:
        use(mdl, None)
    if not by_layer:
        st.feed.evict(configs, policies, evicted_at)
    return cache, logits, st.feed


def evicts_by_layer(policies) -> bool:
    """Whether a prompt's one-shot eviction can run layer by layer, as each layer's rows are
    read, and free the rest of the layer's cache then: one configuration, one independent
    policy per stream (groups.PolicyLayers). The full cache keeps every position; an
    allocator decides from a layer's heads together and may plan across layers; several
    configurations share the prompt's cache: with any of these, eviction waits for the
    whole prompt."""
    return len(policies) == 1 and type(policies[0]) is PolicyLayers


class LayerEviction:
    """A prompt read in one pass with freed eviction (where `evicts_by_layer`), each layer
    evicted as soon as its rows are read (`PromptFeed.on_layer`): the configuration's
    streams of the layer take their one-shot prompt eviction (kvviz.core.harness.prefill,
    exactly what PolicyLayers.prefill does for that layer, victims logged at step T0 - 1:
    the same victims, as each stream's policy is its own object), and the layer's cache is
    gathered at once to the kept positions, `width` = min(budget, T0) entries per KV head
    (a stream holding fewer is padded, never read), so that the full keys and values of at
    most one layer are alive beside the kept ones. `state` then gives the freed State and
    slot layers by `kvviz.model.loop.cache.gathered`'s own rule, as from the full cache."""

    def __init__(self, torch, cache, feed: PromptFeed, configs, policies, evicted_at):
        if not evicts_by_layer(policies):
            raise ValueError("LayerEviction takes one configuration with one policy per stream")
        self.torch, self.cache, self.feed = torch, cache, feed
        self.cfg, self.group, self.evicted_at = configs[0], policies[0], evicted_at
        self.width = min(self.group.budget, feed.T0)
        self.kept = {}  # layer -> (Hk, width) int64: the positions kept, in order (-1: padding)
        feed.on_layer = self

    def __call__(self, layer: int) -> None:
        torch, feed, T0, G = self.torch, self.feed, self.feed.T0, self.feed.G
        for g, p in enumerate(self.group.policies[layer]):
            s = layer * G + g
            try:
                vectors = ({"keys": feed.keys(s), "queries": feed.queries(s)}
                           if harness.reads_vectors(p) else {})
                victims = harness.prefill(p, feed.rows_of(s), T0, self.group.budget, feed.key_norms(s),
                                          feed.value_norms(s), **vectors)
            except BudgetError as exc:
                raise BudgetError(f"{self.cfg.label}, layer {layer}: {exc}") from None
            self.evicted_at[0, layer, g, victims] = T0 - 1
        lay = self.cache.layers[layer]
        _, Hk, _, D = lay.keys.shape
        held = self.evicted_at[0, layer, :, :T0] == NEVER  # (G, T0)
        if G == 1:
            held = np.repeat(held, Hk, axis=0)
        pos = np.full((Hk, self.width), -1, np.int64)
        for h in range(Hk):
            kept = np.flatnonzero(held[h])
            if len(kept) > self.width:
                raise ValueError(f"{self.cfg.label}, layer {layer}: a stream kept {len(kept)} positions, "
                                 f"more than its budget of {self.width}")
            pos[h, : len(kept)] = kept
        index = torch.as_tensor(np.maximum(pos, 0), device=lay.keys.device)[None, :, :, None].expand(
            1, Hk, self.width, D)
        with torch.no_grad():
            lay.keys = lay.keys[:1].gather(2, index)
            lay.values = lay.values[:1].gather(2, index)
        self.kept[layer] = pos

    def state(self, budget, T: int, device, limit: int | None = None):
        """(State, [(keys, values) per layer]) of the freed cache from the layers gathered
        during the pass: `kvviz.model.loop.cache.gathered` (`budget` as it takes it) over
        them, its slots' entries then read as the positions they hold."""
        from types import SimpleNamespace

        L, G = self.evicted_at.shape[1:3]
        if len(self.kept) != L:
            raise ValueError(f"the prompt's eviction reached {len(self.kept)} of {L} layers")
        held = np.zeros((1, L, G, self.width), bool)  # by entry of each gathered layer
        for layer, pos in self.kept.items():
            held[0, layer] = (pos >= 0)[:1] if G == 1 else pos >= 0
        st, layers = gathered(self.torch, SimpleNamespace(layers=self.cache.layers), held, budget, T, device, limit)
        for layer, pos in self.kept.items():
            entry = st.slot_pos[0, layer]  # (Hk, S): an entry of the gathered layer, or < 0 (none)
            real = np.take_along_axis(pos, np.maximum(entry, 0), axis=-1)
            st.slot_pos[0, layer] = np.where(entry >= 0, real, entry)
        return st, layers
