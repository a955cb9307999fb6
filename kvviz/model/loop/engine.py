"""The torch side of the loop: one batched teacher-forced decode under eviction.

Two ways to evict (`EVICTIONS`):
- "masked": the whole DynamicCache is kept; a registered attention function adds a bias of
  0 or -inf per (config, layer, KV head, position) before the softmax, which is exactly
  removal (keys are stored after RoPE, so positions survive either way). Memory is the
  full cache's, per configuration.
- "freed": each configuration's cache holds only its kept positions, in a fixed number of
  slots per layer and KV head (`SlotLayer`): a new token is written into a slot an eviction
  freed, so the cache's memory is the budget's, not the text's. Where streams hold
  different counts the empty slots are masked (-inf). The full-cache row runs beside it
  in its own ordinary cache (its own forward: a "lane").

The bias and the step's group-mean weights are torch tensors sharing memory with numpy
arrays on the CPU, so the policy bookkeeping reads and writes them without copies; on a
GPU only the step's weights on the held slots come to the host, and only the bias
entries an eviction changed go back.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvviz.core import harness
from kvviz.core.groups import AllocatedLayers, PolicyLayers, StreamGroup, Unevicted
from kvviz.core.policies import Place
from kvviz.core.policies.base import BudgetError
from kvviz.core.replay import NEVER
from kvviz.core.streams import Streams
from kvviz.core.trace import packed_offset
from kvviz.model.loop.config import GRANULARITIES, PREFILL_CHUNK, check_chunk, check_configs, check_eviction
from kvviz.model.loop.result import LoopResult

ATTN_NAME = "kvviz_loop"
MOVED = [0]  # bytes brought from the device to the host by `step`, since the process started
_LOCK = threading.Lock()  # one loop per process at a time: the attention function reads _STATE
_STATE = None


class State:
    """What the attention function and the bookkeeping share for one lane of B batch rows.

    Host arrays (numpy) are what the policies read and write: `cur` (B, L, G, T) the step's
    weights by position (mean over each group's query heads), `knorm` (B, L, G) the new key's
    L2 norm. Masked (`slots` None): `bias` (B, L, Hk, T) by position. Freed (`slots` = S):
    `bias` (B, L, Hk, S) by slot, `slot_pos` (B, L, Hk, S) the position each slot holds
    (-1 empty), `write` (B, L, Hk) the slot the next token goes to; the attention function
    records weights by slot (`cur_s`) and `pull` scatters them to positions.

    On the CPU host and device arrays are the same memory; on a GPU `pull` brings the
    step's weights (held slots only, when freed) and statistics in one copy and `push`
    sends back only the bias entries that changed (`dirty`)."""

    def __init__(self, torch, B: int, L: int, Hk: int, G: int, T: int, device="cpu", slots: int | None = None):
        self.B, self.L, self.Hk, self.G, self.T = B, L, Hk, G, 0
        self.on_host = torch.device(device).type == "cpu"
        self.device = device
        self.freed = slots is not None
        self.S = slots
        # L2 norms of this step's new key and value (mean over KV heads if G == 1)
        self.knorm_h, self.vnorm_h = torch.zeros(B, L, G), torch.zeros(B, L, G)
        self.knorm, self.vnorm = self.knorm_h.numpy(), self.vnorm_h.numpy()
        self.knorm_t, self.vnorm_t = self._dev(torch, self.knorm_h), self._dev(torch, self.vnorm_h)
        self.cur_h = torch.zeros(B, L, G, 0)
        self.dirty = []  # (flat bias indices, value) since the last push
        self.stale = []  # freed: (row, layer, stream, positions) evicted since the last pull
        self._moved = 0
        self.feed = None  # a PromptFeed while a prompt is read in one pass
        # each query head's weights, for a policy that reads per-query-head rows (CPU only):
        # `qcur` (B, L, Hq, T) by position; freed: recorded by slot (`qcur_s`) and scattered
        self.want_q = None  # set by `mark_query_rows` before the first forward
        self.qcur = self.qcur_s = None
        if self.freed:
            self.bias_h = torch.full((B, L, Hk, slots), -np.inf)  # every slot empty
            self.bias = self.bias_h.numpy()
            self.bias_t = self._dev(torch, self.bias_h)
            self.cur_s_h = torch.zeros(B, L, G, slots)
            self.cur_s = self.cur_s_h.numpy()
            self.cur_s_t = self._dev(torch, self.cur_s_h)
            self.slot_pos = np.full((B, L, Hk, slots), -1, np.int64)
            self.write = np.zeros((B, L, Hk), np.int64)
            self.write_t = torch.from_numpy(self.write) if self.on_host else torch.zeros(
                B, L, Hk, dtype=torch.long, device=device)
        else:
            self.bias_h = torch.zeros(B, L, Hk, 0)
        self.grow(torch, T)

    def _dev(self, torch, host):
        return host if self.on_host else host.to(self.device)

    def grow(self, torch, T: int) -> None:
        """Room for T positions, what is set kept (kvviz.hf does not know the length ahead)."""
        if T <= self.T:
            return
        B, L, G, old = self.cur_h.shape
        if not self.freed:
            bias = torch.zeros(B, L, self.Hk, T)  # 0 = held, -inf = evicted
            bias[..., :old] = self.bias_h
            self.bias_h, self.bias = bias, bias.numpy()
            self.bias_t = self._dev(torch, self.bias_h)
        cur = torch.zeros(B, L, G, T)  # this step's weights by position
        cur[..., :old] = self.cur_h
        self.cur_h, self.cur = cur, cur.numpy()
        if not self.freed:
            self.cur_t = self._dev(torch, self.cur_h)
        self.T = T

    def query_buffer(self, torch, Hq: int):
        """Where this step's per-query-head weights go (B, L, Hq, width): by slot when freed,
        else by position; made on first use and grown with the positions (host memory: on a
        GPU `mark_query_rows` refuses the run first)."""
        T = max(self.T, 1)
        if self.qcur is None or self.qcur.shape[-1] < T:
            grown = np.zeros((self.B, self.L, Hq, T), np.float32)
            if self.qcur is not None:
                grown[..., : self.qcur.shape[-1]] = self.qcur
            self.qcur = grown
        if self.freed:
            if self.qcur_s is None:
                self.qcur_s = np.zeros((self.B, self.L, Hq, self.S), np.float32)
            return torch.from_numpy(self.qcur_s)
        return torch.from_numpy(self.qcur)

    def query_rows(self, b: int, layer: int, g: int, held) -> np.ndarray:
        """Stream g's query heads' weights on the positions `held` this step, (heads, n): the
        heads of KV head g at kv-head granularity, every head of the layer at layer granularity."""
        Hq = self.qcur.shape[2]
        heads = slice(None) if self.G == 1 else slice(g * (Hq // self.Hk), (g + 1) * (Hq // self.Hk))
        return self.qcur[b, layer, heads][:, held]

    # -- freed: the slots ---------------------------------------------------------------
    def heads(self, g: int) -> slice:
        """The KV heads policy stream g decides for: all of them at layer granularity."""
        return slice(None) if self.G == 1 else slice(g, g + 1)

    def place(self, pos: int, active=None) -> None:
        """Freed: each (active) row's next token `pos` goes to its lowest empty slot."""
        rows = np.arange(self.B) if active is None else np.flatnonzero(active)
        empty = self.slot_pos[rows] < 0
        if not empty.any(axis=-1).all():
            full = np.argwhere(~empty.any(axis=-1))[0]
            raise ValueError(f"freed cache overflow: row {rows[full[0]]}, layer {full[1]}, KV head {full[2]} "
                             f"holds all {self.S} slots at position {pos}: a policy kept more than its budget")
        b, layer, h = np.meshgrid(rows, np.arange(self.L), np.arange(self.Hk), indexing="ij")
        s = empty.argmax(axis=-1)  # (rows, L, Hk): the lowest empty slot
        self.write[b, layer, h] = s
        self.slot_pos[b, layer, h, s] = pos
        self._set(np.ravel_multi_index((b, layer, h, s), self.bias.shape).ravel(), 0.0)

    def _set(self, flat, value) -> None:
        self.bias.reshape(-1)[flat] = value
        if not self.on_host:
            self.dirty.append((np.asarray(flat, np.int64), value))

    @property
    def moved(self) -> int:
        """Bytes the last `pull` brought from the device to the host (0 on the CPU)."""
        return self._moved

    def free(self, b: int, layer: int, g: int, victims) -> None:
        """Freed: the victims' slots emptied (masked until a token is written there)."""
        hs = self.heads(g)
        pos = self.slot_pos[b, layer, hs]  # (h, S)
        hit = np.isin(pos, victims)
        idx = np.argwhere(hit)
        pos[hit] = -1
        heads = np.arange(self.Hk)[hs]
        flat = np.ravel_multi_index((np.full(len(idx), b), np.full(len(idx), layer), heads[idx[:, 0]], idx[:, 1]),
                                    self.bias.shape)
        self._set(flat, -np.inf)
        self.stale.append((b, layer, g, victims))  # its weight in `cur` is cleared at the next pull

    # -- host <-> device ----------------------------------------------------------------
    def pull(self, torch, stats, t: int):
        """Host copy of this step's weights (into `cur`) and of `stats` (returned, or None).
        Masked: positions 0..t; freed: the S slots, scattered to their positions."""
        src = self.cur_s if self.freed else None
        if self.on_host:
            host = None if stats is None else stats.numpy()
        else:
            w = self.cur_s_t if self.freed else self.cur_t[..., : t + 1]
            parts = [w.reshape(-1).double(), self.knorm_t.reshape(-1).double(), self.vnorm_t.reshape(-1).double()]
            flat = torch.cat(parts + ([] if stats is None else [stats.reshape(-1)])).cpu().numpy()
            self._moved = flat.nbytes
            n, k = w.numel(), 2 * self.knorm.size
            if self.freed:
                self.cur_s.reshape(-1)[:] = flat[:n]
            else:
                self.cur[..., : t + 1] = flat[:n].reshape(self.cur[..., : t + 1].shape)
            self.knorm.reshape(-1)[:] = flat[n:n + k // 2]
            self.vnorm.reshape(-1)[:] = flat[n + k // 2:n + k]
            host = None if stats is None else flat[n + k:].reshape(stats.shape)
        if src is not None and self.qcur_s is not None:
            qpos = np.repeat(self.slot_pos, self.qcur.shape[2] // self.Hk, axis=2)  # (B, L, Hq, S)
            held = qpos >= 0
            b, layer, h, _ = np.nonzero(held)
            self.qcur[b, layer, h, qpos[held]] = self.qcur_s[held]
        if src is not None:
            for b, layer, g, victims in self.stale:  # evicted since the last step: no weight now
                self.cur[b, layer, g, victims] = 0.0
            self.stale = []
            pos = self.slot_pos if self.G > 1 else self.slot_pos[:, :, :1]  # (B, L, G, S)
            held = pos >= 0
            b, layer, g, _ = np.nonzero(held)
            self.cur[b, layer, g, pos[held]] = src[held]
        return host

    def push(self, torch) -> None:
        if self.freed and not self.on_host:
            self.write_t.copy_(torch.from_numpy(self.write))
        if self.on_host or not self.dirty:
            self.dirty = []
            return
        flat = np.concatenate([f for f, _ in self.dirty])
        vals = np.concatenate([np.full(len(f), v, np.float32) for f, v in self.dirty])
        self.dirty = []
        self.bias_t.view(-1)[torch.as_tensor(flat, device=self.device)] = torch.as_tensor(vals, device=self.device)


def slot_layer_class():
    """`SlotLayer`, defined on first use (transformers is imported lazily)."""
    global _SLOT_LAYER
    if _SLOT_LAYER is None:
        from transformers.cache_utils import DynamicLayer

        class SlotLayer(DynamicLayer):
            """A cache layer of fixed size: keys and values (B, Hk, S, D), each step's new token
            written into the slot its State chose (`State.write`), not appended. Positions
            are explicit (position_ids), so a slot's order says nothing; the attention
            function masks empty slots. `get_seq_length` counts the positions read, as
            transformers' generate expects of a cache."""

            is_croppable = False

            def __init__(self, state, layer: int, keys=None, values=None, seen: int = 0):
                super().__init__()
                self.state, self.layer, self.seen = state, layer, seen
                if keys is not None:
                    self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True

            def lazy_initialization(self, key_states, value_states):
                B, Hk, _, D = key_states.shape
                shape = (B, Hk, self.state.S, D)
                self.device = key_states.device
                self.keys = key_states.new_zeros(shape)
                self.values = value_states.new_zeros(shape)
                self.is_initialized = True

            def update(self, key_states, value_states, *args, **kwargs):
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                if key_states.shape[2] != 1:
                    raise ValueError("a freed cache takes one token per step")
                B, Hk, _, D = key_states.shape
                idx = self.state.write_t[:B, self.layer, :, None, None].expand(B, Hk, 1, D)
                if key_states.requires_grad:  # in place would break the backward pass through earlier steps
                    self.keys = self.keys.scatter(2, idx, key_states)
                    self.values = self.values.scatter(2, idx, value_states)
                else:
                    self.keys.scatter_(2, idx, key_states)
                    self.values.scatter_(2, idx, value_states)
                self.seen += 1
                return self.keys, self.values

            def get_seq_length(self) -> int:
                return self.seen

            def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
                return self.keys.shape[-2] if self.is_initialized else self.state.S, 0

            def batch_repeat_interleave(self, repeats: int) -> None:
                raise ValueError("a freed cache cannot be repeated")

        _SLOT_LAYER = SlotLayer
    return _SLOT_LAYER


_SLOT_LAYER = None


def slot_cache(state: State, layers=None, seen: int = 0):
    """A transformers Cache of `SlotLayer`s over `state` (layers given, or allocated on first use)."""
    from transformers.cache_utils import Cache

    cls = slot_layer_class()
    if layers is None:
        return Cache(layers=[cls(state, i) for i in range(state.L)])
    return Cache(layers=[cls(state, i, k, v, seen) for i, (k, v) in enumerate(layers)])


@dataclass
class Lane:
    """Batch rows that share one forward call: `index` the configs (global indices, batch
    order), their `state` and `cache`."""

    index: np.ndarray
    state: State
    cache: object


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention with the running lane's eviction bias; records the group means.

    query (B, Hq, q, D), key/value (B, Hk, k, D); query head h reads KV head h // (Hq/Hk),
    as transformers' repeat_kv lays them out, so grouping avoids repeating the keys. A
    one-token step records its weights into `cur` (by position, self dropped) or `cur_s`
    (freed: by slot); a prompt read with a PromptFeed armed goes through `_prompt`.
    """
    import torch

    st = _STATE
    layer = module.layer_idx
    B, Hq, q, D = query.shape
    Hk, k = key.shape[1], key.shape[2]
    g = Hq // Hk
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")  # this layer's own window, as the model passes it
    if q > 1:
        return _prompt(st, layer, query, key, value, scaling, softcap, window), None
    scores = torch.matmul(query.reshape(B, Hk, g * q, D), key.transpose(-1, -2)) * scaling
    if softcap:  # Gemma 2's attention logit softcapping, as its eager attention does it
        scores = torch.tanh(scores / softcap) * softcap
    if st is not None:
        scores = scores + st.bias_t[:B, layer, :, None, :k]
    if window:
        scores = _outside_window(torch, st, layer, scores, k, int(window))
    w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(w, value).view(B, Hq, q, D).transpose(1, 2).contiguous()
    if st is not None and q == 1 and st.want_q:
        n = k if st.freed else k - 1  # freed: by slot; masked: by position, self dropped
        st.query_buffer(torch, Hq)[:B, layer, :, :n] = w.detach().view(B, Hq, k)[..., :n]
    if st is not None and q == 1 and st.freed:
        w = w.view(B, Hk, g, k)  # by slot, the new token's own slot included (never read as a held weight)
        idx = st.write_t[:B, layer, :, None, None].expand(B, Hk, 1, D)
        norms = key.detach().gather(2, idx)[:, :, 0].float().norm(dim=-1)  # (B, Hk): the new key, after RoPE
        vnorms = value.detach().gather(2, idx)[:, :, 0].float().norm(dim=-1)
        if st.G == 1:
            st.cur_s_t[:B, layer, 0, :k] = w.detach().mean(dim=(1, 2))
            st.knorm_t[:B, layer, 0], st.vnorm_t[:B, layer, 0] = norms.mean(dim=1), vnorms.mean(dim=1)
        else:
            st.cur_s_t[:B, layer, :, :k] = w.detach().mean(dim=2)
            st.knorm_t[:B, layer], st.vnorm_t[:B, layer] = norms, vnorms
    elif st is not None and q == 1:
        t = k - 1  # self weight dropped: the policies decide about earlier positions
        w = w.detach().view(B, Hk, g, k)[..., :t]
        norms = key[:, :, t].detach().float().norm(dim=-1)  # (B, Hk): the new key, after RoPE, as cached
        vnorms = value[:, :, t].detach().float().norm(dim=-1)
        if st.G == 1:
            st.cur_t[:B, layer, 0, :t] = w.mean(dim=(1, 2))
            st.knorm_t[:B, layer, 0], st.vnorm_t[:B, layer, 0] = norms.mean(dim=1), vnorms.mean(dim=1)
        else:
            st.cur_t[:B, layer, :, :t] = w.mean(dim=2)
            st.knorm_t[:B, layer], st.vnorm_t[:B, layer] = norms, vnorms
    return out, None


def _outside_window(torch, st: State | None, layer: int, scores, k: int, window: int):
    """A one-token step's scores (B, Hk, g, k) with the keys older than the layer's sliding
    window at -inf, as transformers' sliding mask has it: the query at position t reads keys
    t - window + 1..t. Masked: key index = position (t = k - 1); freed: the slots' positions."""
    if st is None or not st.freed:
        if k > window:
            scores = scores.clone()
            scores[..., : k - window] = float("-inf")
        return scores
    pos = st.slot_pos[: scores.shape[0], layer]  # (B, Hk, S); the new token holds the highest
    old = (pos >= 0) & (pos <= pos.max(axis=-1, keepdims=True) - window)
    if not old.any():
        return scores
    return scores.masked_fill(torch.as_tensor(old, device=scores.device)[:, :, None, :k], float("-inf"))


def _prompt(st: State | None, layer: int, query, key, value, scaling, softcap, window=None):
    """Several queries at once (a prompt), `CHUNK` (or the feed's chunk) queries at a time,
    causal (and within the layer's sliding `window`, if it has one): the output as eager
    attention gives it, with no (q, k) array held. When a
    PromptFeed is armed (a prompt from an empty cache), each block's group-mean rows of
    batch row 0 go to it while they exist."""
    import torch

    B, Hq, q, D = query.shape
    Hk, k = key.shape[1], key.shape[2]
    g = Hq // Hk
    past = k - q
    feed = None if st is None else st.feed
    if feed is not None:
        if past:
            raise ValueError("a prompt is read in one pass from an empty cache")
        for which, x in (("key", key), ("value", value)):
            norms = x[0].detach().float().norm(dim=-1)  # (Hk, k)
            feed.set_norms(which, layer, (norms.mean(dim=0, keepdim=True) if st.G == 1 else norms).cpu().numpy())
    chunk = feed.chunk if feed is not None else PREFILL_CHUNK
    out = query.new_empty(B, Hk, g, q, D)
    for a in range(0, q, chunk):
        b = min(q, a + chunk)
        m, end = b - a, past + b
        s = torch.matmul(query[:, :, a:b].reshape(B, Hk, g * m, D), key[:, :, :end].transpose(-1, -2)) * scaling
        if softcap:  # Gemma 2's attention logit softcapping, as its eager attention does it
            s = torch.tanh(s / softcap) * softcap
        s = s.view(B, Hk, g, m, end)
        keys = torch.arange(end, device=s.device)[None, :]
        queries = torch.arange(past + a, end, device=s.device)[:, None]
        later = keys > queries
        if window:  # the layer's sliding window: query i reads keys i - window + 1..i
            later = later | (keys <= queries - int(window))
        s = s.masked_fill(later, float("-inf"))  # causal: query i reads keys 0..i
        if st is not None and not st.freed and st.bias_t is not None:
            s = s + st.bias_t[:B, layer, :, None, None, :end]
        w = torch.softmax(s, dim=-1, dtype=torch.float32).to(query.dtype)
        out[:, :, :, a:b] = torch.matmul(w.view(B, Hk, g * m, end), value[:, :, :end]).view(B, Hk, g, m, D)
        if feed is not None and feed.wants(a, b):
            w0 = w[0].detach().float()
            rows = w0.mean(dim=(0, 1))[None] if st.G == 1 else w0.mean(dim=1)  # (G, m, end)
            qrows = None
            if feed.query:  # (G, query heads of the stream, m, end)
                qrows = (w0.reshape(1, Hk * g, m, end) if st.G == 1 else w0).cpu().numpy()
            feed.add(layer, a, rows.cpu().numpy(), qrows)
    return out.view(B, Hq, q, D).transpose(1, 2).contiguous()


def no_mask(batch_size=None, q_length=None, kv_length=None, *args, attention_mask=None, **kwargs):
    """The mask builder registered with the attention function: none, since the function
    masks causally itself, block by block (no (q, k) mask is built). It reads unpadded
    sequences only, so a padding mask is refused rather than ignored."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("kvviz reads unpadded sequences: attention_mask must be all ones")
    return None


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
                raise BudgetError(f"{cfg.label}, {exc}") from None
            evicted_at[c].reshape(-1, evicted_at.shape[-1])[streams, victims] = self.T0 - 1
        self.seconds += time.perf_counter() - t0


class _Prompt:
    """A PromptFeed as a group's prompt (`rows(s)` is the feed's `rows_of`)."""

    def __init__(self, feed: PromptFeed):
        self.length, self.rows = feed.T0, feed.rows_of
        self.key_norms, self.value_norms, self.calibration = feed.key_norms, feed.value_norms, feed.calibration


def register():
    """The attention function, and `no_mask` as its mask builder (it masks causally itself)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, attention)
    AttentionMaskInterface.register(ATTN_NAME, no_mask)


@contextmanager
def attached(mdl, state: State | None = None):
    """`mdl` runs the eviction attention inside the block (one block at a time per process),
    over `state` until `use` names another lane's; its previous attention implementation
    comes back on exit, error or not."""
    global _STATE
    with _LOCK:
        register()
        check_architecture(mdl)
        settable = interface_settable(mdl)  # Falcon's is routed instead
        previous = mdl.config._attn_implementation
        _STATE = state
        try:
            if settable:
                mdl.set_attn_implementation(ATTN_NAME)
            with routed(mdl):
                yield state
        finally:
            _STATE = None
            if settable:
                mdl.set_attn_implementation(previous)


def use(state: State | None) -> None:
    """The lane the next forward runs (inside `attached`)."""
    global _STATE
    _STATE = state


def tokenize(tok, text: str, max_tokens: int) -> list[int]:
    """As kvviz.model.capture does (kvviz.model.models.tokenize): BOS as the tokenizer's convention says."""
    from kvviz.model.models import tokenize as tokens

    return tokens(tok, text, max_tokens)[0]


def check_inputs(text, granularity, max_tokens, eviction="masked") -> None:
    check_eviction(eviction)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text is empty: give the loop something to read")
    if isinstance(max_tokens, bool) or int(max_tokens) != max_tokens or max_tokens < 2:
        raise ValueError(f"max_tokens must be an integer >= 2, got {max_tokens!r}")


def lanes_for(torch, configs, policies, eviction: str, L: int, Hk: int, G: int, T: int, device) -> list[Lane]:
    """The lanes of a run read token by token from an empty cache. Masked: every config in
    one lane over one DynamicCache. Freed: the full row in its own lane, the evicting rows
    in one lane per budget over slots (budget + 1 per layer and KV head: one step admits
    one position before the eviction)."""
    from transformers import DynamicCache

    C = len(configs)
    if eviction == "masked":
        return [Lane(np.arange(C), State(torch, C, L, Hk, G, T, device), DynamicCache())]
    full = np.array([c for c, cfg in enumerate(configs) if cfg.is_full])
    lanes = [Lane(full, State(torch, len(full), L, Hk, G, T, device), DynamicCache())] if len(full) else []
    for budget, rest in by_budget(configs, policies):
        st = State(torch, len(rest), L, Hk, G, T, device, slots=min(T, budget + 1))
        st.place(0)
        lanes.append(Lane(rest, st, slot_cache(st)))
    return lanes


def by_budget(configs, policies) -> list[tuple[int, np.ndarray]]:
    """Freed: the evicting configs grouped by the most one stream may hold (`capacity`: the
    budget, or an allocator's largest cap), one lane each, so that every row's cache is its
    own size (a batched tensor has one size for all its rows)."""
    cap = [group.capacity for group in policies]  # None: the full cache evicts nothing
    return [(b, np.array([c for c in range(len(configs)) if cap[c] == b]))
            for b in sorted({x for x in cap if x is not None})]


def lanes_after_prompt(torch, cache, configs, policies, evicted_at, eviction: str, T: int, device) -> list[Lane]:
    """The lanes after a prompt read in one pass (batch 1, full `cache`) and each config's
    one-shot eviction (`evicted_at` (C, L, G, T), victims at step T0 - 1). Masked: the cache
    repeated per config, victims masked. Freed: the full row keeps `cache`; each evicting
    row's cache is gathered to its kept positions."""
    C, L, G, _ = evicted_at.shape
    T0 = cache.get_seq_length()
    Hk = cache.layers[0].keys.shape[1]
    if eviction == "masked":
        cache.batch_repeat_interleave(C)
        return [Lane(np.arange(C), masked_state(torch, evicted_at[..., :T0], Hk, T, device), cache)]
    full = np.array([c for c, cfg in enumerate(configs) if cfg.is_full])
    lanes = [Lane(full, State(torch, len(full), L, Hk, G, T, device), cache)] if len(full) else []
    for budget, rest in by_budget(configs, policies):
        st, layers = gathered(torch, cache, evicted_at[rest][..., :T0] == NEVER, budget, T, device, limit=T)
        st.place(T0)
        lanes.append(Lane(rest, st, slot_cache(st, layers, seen=T0)))
    return lanes


def masked_state(torch, evicted, Hk: int, T: int, device) -> State:
    """A masked State for T positions whose prompt victims (`evicted` (C, L, G, T0): any step
    but NEVER) are masked already."""
    C, L, G, T0 = evicted.shape
    st = State(torch, C, L, Hk, G, T, device)
    gone = evicted != NEVER
    st.bias[..., :T0][np.broadcast_to(gone, (C, L, Hk, T0)) if G == 1 else gone] = -np.inf
    if not st.on_host:  # the whole bias once
        st.bias_t.copy_(st.bias_h)
    return st


def prompt_state(torch, T0: int, configs, policies, L: int, Hk: int, G: int, chunk: int, device) -> State:
    """The State a prompt is read through in one pass: nothing to mask, a PromptFeed armed."""
    st = State(torch, 1, L, Hk, G, 0, device)
    st.bias_t = None  # nothing is evicted while the prompt is read
    st.feed = PromptFeed(T0, configs, policies, L, G, chunk)
    return st


def gathered(torch, cache, held, budget: int, T: int, device, limit: int | None = None):
    """Freed: a State (positions 0..T-1) over slots and, per layer, keys and values
    (E, Hk, S, D) gathered from a batch-1 `cache` of T0 positions to the `held` ones (bool
    (E, L, G, T0)), S = the largest held count or `budget`, + 1 (room for the next token),
    at most `limit` (the positions the run will ever see, when known)."""
    E, L, G, T0 = held.shape
    Hk = cache.layers[0].keys.shape[1]
    n_held = held.sum(axis=-1)
    S = max(int(n_held.max()), budget) + 1
    S = S if limit is None else min(limit, S)
    st = State(torch, E, L, Hk, G, T, device, slots=S)
    pos = np.zeros((E, L, G, S), np.int64)
    valid = np.arange(S) < n_held[..., None]
    for e, layer, g in np.ndindex(E, L, G):
        kept = np.flatnonzero(held[e, layer, g])
        pos[e, layer, g, : len(kept)] = kept
    if G == 1:
        pos, valid = np.repeat(pos, Hk, axis=2), np.repeat(valid, Hk, axis=2)
    st.slot_pos[:] = np.where(valid, pos, -1)
    st.bias[:] = np.where(valid, 0.0, -np.inf)
    if not st.on_host:  # the whole bias once
        st.bias_t.copy_(st.bias_h)
    index = torch.as_tensor(pos, device=device)  # (E, L, Hk, S)
    layers = []
    for layer, lay in enumerate(cache.layers):
        D = lay.keys.shape[-1]
        idx = index[:, layer, :, :, None].expand(E, Hk, S, D)
        layers.append((lay.keys.expand(E, -1, -1, -1).gather(2, idx),
                       lay.values.expand(E, -1, -1, -1).gather(2, idx)))
    return st, layers


def cache_bytes(caches) -> int:
    """Bytes the caches hold in keys and values (what was allocated, empty slots included)."""
    total = 0
    for cache in caches:
        for lay in cache.layers:
            if getattr(lay, "keys", None) is not None and getattr(lay, "is_initialized", True):
                total += lay.keys.numel() * lay.keys.element_size() + lay.values.numel() * lay.values.element_size()
    return total


def step(mdl, lanes, ids, t: int, configs, policies, evicted_at, stats=None, active=None) -> tuple:
    """The step contract, shared by `run` and generation: one forward per lane of token
    `ids` (C,) at position t through the eviction attention, `stats(logits (C, V))` on the
    device, each lane's one host copy, each active config's bookkeeping, the bias pushed.
    Returns (host stats or None, model seconds, bookkeeping seconds)."""
    import torch

    C = ids.shape[0]
    t0 = time.perf_counter()
    for lane in lanes:
        mark_query_rows(lane.state, policies)
    with torch.no_grad():
        logits = None
        for lane in lanes:
            n = len(lane.index)
            use(lane.state)
            out = mdl(input_ids=ids[lane.index].reshape(n, 1) if len(lanes) > 1 else ids.reshape(C, 1),
                      position_ids=torch.full((n, 1), t, dtype=torch.long, device=ids.device),
                      cache=lane.cache, use_cache=True)
            last = out.logits[:, -1]
            if len(lanes) == 1:
                logits = last
            else:
                if logits is None:
                    logits = last.new_empty(C, last.shape[-1])
                logits[torch.as_tensor(lane.index, device=last.device)] = last
            del out
        use(None)
        s = None if stats is None else stats(logits)
        host = lanes[0].state.pull(torch, s, t)
        for lane in lanes[1:]:
            lane.state.pull(torch, None, t)
        moved = sum(lane.state.moved for lane in lanes)
    t1 = time.perf_counter()
    MOVED[0] += moved
    for lane in lanes:
        bookkeeping(lane, configs, policies, evicted_at, t, active)
        if lane.state.freed and t + 1 < lane.state.T:
            lane.state.place(t + 1, None if active is None else active[lane.index])
        lane.state.push(torch)
    return host, t1 - t0, time.perf_counter() - t1


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
    use(st)
    try:
        with torch.no_grad():
            out = mdl(input_ids=ids_t.view(1, T0), position_ids=torch.arange(T0, device=device).view(1, T0),
                      cache=cache, use_cache=True, logits_to_keep=1)  # not (T0, vocabulary) logits
            logits = out.logits[:, -1]
            del out
    finally:
        use(None)
    st.feed.evict(configs, policies, evicted_at)
    return cache, logits, st.feed


def run(text, configs, granularity="layer", max_tokens=1024, progress=None, model=None,
        rows_layers=None, rows_tokens=None, seed=0, timings=None, device="cpu",
        dtype="float32", eviction="masked") -> LoopResult:
    check_inputs(text, granularity, max_tokens, eviction)
    configs = check_configs(configs)
    import torch

    from kvviz.model.models import (
        attention_shape,
        check_layers,
        default_layers,
        load_model,
        model_provenance,
        token_strings,
    )
    from kvviz.model.models import tokenize as tokens

    tok, mdl = load_model(model, "loop", device, dtype)
    check_architecture(mdl)
    ids, offsets, bos = tokens(tok, text, int(max_tokens))
    T = len(ids)
    if T < 2:
        raise ValueError("text must tokenise to at least 2 tokens")
    shape = attention_shape(mdl)
    L, Hk = shape.layers, shape.kv_heads
    G = 1 if granularity == "layer" else Hk
    rows_layers = default_layers(L) if rows_layers is None else check_layers(rows_layers, L, "rows_layers")
    Tr = T if rows_tokens is None else max(0, min(int(rows_tokens), T))
    C = len(configs)
    policies = [make_policies(c, L, G, T, seed) for c in configs]
    evicted_at = np.full((C, L, G, T), NEVER, np.int64)
    rows = np.zeros((C, len(rows_layers), G, packed_offset(Tr)), np.float32) if rows_layers else None
    nll = np.zeros((C, T - 1))
    p_true = np.zeros((C, T - 1))
    kl = np.zeros((C, T - 1))
    top1 = np.zeros((C, T - 1), np.int64)
    f = next(i for i, c in enumerate(configs) if c.is_full)
    model_s = np.zeros(T)
    book_s = np.zeros(T)
    device = next(mdl.parameters()).device
    refuse_uncalibrated(configs, policies, "loop")
    with attached(mdl):
        lanes = lanes_for(torch, configs, policies, eviction, L, Hk, G, T, device)
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        for t in range(T):
            def stats(logits, t=t):  # (C, 3): nll, argmax, KL(full || config), on the device
                logp = torch.log_softmax(logits.double(), dim=-1)
                return torch.stack([-logp[:, ids[t + 1]], logp.argmax(dim=-1).double(),
                                    (logp[f].exp() * (logp[f] - logp)).sum(dim=-1).clamp_min(0)], 1)

            host, model_s[t], book_s[t] = step(mdl, lanes, ids_t[t].expand(C), t, configs, policies,
                                               evicted_at, stats if t < T - 1 else None)
            if host is not None:
                nll[:, t], top1[:, t], kl[:, t] = host[:, 0], host[:, 1].astype(np.int64), host[:, 2]
            if t < Tr and rows is not None:  # `cur` is still step t's: the bookkeeping reads it only
                off = packed_offset(t)
                for lane in lanes:
                    rows[lane.index, :, :, off:off + t] = lane.state.cur[:, rows_layers, :, :t]
            if progress is not None:
                progress(t + 1, T)
        held_bytes = cache_bytes(lane.cache for lane in lanes)
    np.exp(-nll, out=p_true)
    if timings is not None:
        timings.update(model=model_s, bookkeeping=book_s)
    return LoopResult(configs=configs, granularity=granularity, tokens=token_strings(tok, ids, text, offsets),
                      token_ids=np.array(ids, np.int64), nll=nll, p_true=p_true, kl_tokens=kl, top1=top1,
                      evicted_at=evicted_at, layers=list(range(L)), rows=rows, rows_layers=rows_layers,
                      rows_tokens=Tr,
                      meta={"model_seconds": float(model_s.sum()), "bookkeeping_seconds": float(book_s.sum()),
                            "seed": seed, "bos": bos, "eviction": eviction,
                            **memory(mdl, configs, policies, evicted_at, held_bytes, T - 1),
                            **model_provenance(mdl)})


def memory(mdl, configs, policies, evicted_at, held_bytes: int, step: int) -> dict:
    """The two memories of a run at `step`, side by side: the keys and values the caches hold
    (`cache_bytes`) beside what the full cache would hold for the same rows, and the
    policies' own bookkeeping (each policy's bytes per slot x the slots it holds)."""
    from kvviz.model.models import attention_shape

    shape = attention_shape(mdl)
    L, Hk, D = shape.layers, shape.kv_heads, shape.head_dim
    item = next(mdl.parameters()).element_size()
    C, _, G, T = evicted_at.shape
    n = step + 1
    full = C * L * Hk * n * D * 2 * item
    book = 0
    for c, cfg_c in enumerate(configs):
        if cfg_c.is_full:
            continue
        ev = evicted_at[c, ..., :n]
        slots = int(((ev == NEVER) | (ev > step)).sum())
        book += slots * policies[c].bytes_per_slot
    return {"cache_bytes": int(held_bytes), "full_cache_bytes": int(full), "policy_bytes": int(book)}


ALIBI = ("bloom", "mpt")  # model types whose positions are ALiBi biases


def check_architecture(mdl) -> None:
    """Refuse, in one line naming the model, its type and the reason, what the eviction
    attention does not reproduce: ALiBi position biases (Bloom, MPT, Falcon with `alibi`),
    and any other model whose attention does not go through transformers'
    AttentionInterface (so no key could be masked in it), except Falcon's, which `attached`
    routes through `attention` itself (`falcon_forward`). Sliding-window layers are applied
    as the model applies them (`attention`); softcapping is implemented."""
    from kvviz.model.models import model_provenance, text_config

    cfg = text_config(mdl)
    kind = getattr(cfg, "model_type", None)
    name = model_provenance(mdl)["model"]
    if kind in ALIBI or getattr(cfg, "alibi", False):
        why = "its positions are ALiBi attention biases, which kvviz's eviction attention does not add"
    elif kind != "falcon" and not interface_settable(mdl):
        why = "its attention does not go through transformers' AttentionInterface, so no key can be masked in it"
    else:
        return
    raise ValueError(f"model {name} (model type {kind}) is not supported: {why}")


def interface_settable(mdl) -> bool:
    """Whether the model's attention goes through transformers' AttentionInterface (so
    `set_attn_implementation` takes kvviz's function); transformers' own test of it."""
    test = getattr(type(mdl), "_can_set_attn_implementation", None)
    return True if test is None else bool(test())


def falcon_forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
                   use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
    """FalconAttention.forward (rotary, no ALiBi) with its scores computed by `attention`:
    Falcon computes attention inline instead of through AttentionInterface. The queries, keys
    and values are split, rotated and cached exactly as Falcon does."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    query, key, value = self._split_heads(self.query_key_value(hidden_states))
    B, q = query.shape[:2]
    Hk = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    query = query.transpose(1, 2).reshape(B, self.num_heads, q, self.head_dim)
    key = key.transpose(1, 2).reshape(B, Hk, q, self.head_dim)
    value = value.transpose(1, 2).reshape(B, Hk, q, self.head_dim)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    out, _ = attention(self, query, key, value, None, self.inv_norm_factor)
    return self.dense(out.reshape(B, q, self.num_heads * self.head_dim)), None


@contextmanager
def routed(mdl):
    """Falcon's attention modules run `falcon_forward` inside the block (restored after)."""
    import types

    mods = [m for m in mdl.modules() if type(m).__name__ == "FalconAttention"]
    for m in mods:
        m.forward = types.MethodType(falcon_forward, m)
    try:
        yield
    finally:
        for m in mods:
            del m.forward


def make_policies(cfg, L: int, G: int, T: int, seed: int, vectorised: bool = True) -> StreamGroup:
    """A config's StreamGroup (kvviz.core.groups) over its L x G streams (stream s = layer *
    G + head): Unevicted for full; one Streams where the policy declares a vectorised form
    and `vectorised` allows (keyed into the flat (L, G, T) step weights); for an allocator,
    one LayerGroup per layer (its G streams share the layer's slots); else one policy per
    (layer, head), rng seeded per (seed, layer, head). Every per-stream policy is told its
    Place (layer of L; KV head of G at kv-head granularity). A prefill needs the per-stream
    objects: Streams holds at most budget + 1."""
    if cfg.is_full:
        return Unevicted(L * G)
    if cfg.is_allocator:
        alloc = cfg.make(0, 0, seed)
        return AllocatedLayers([alloc.group(layer, L, G) for layer in range(L)])
    if vectorised:
        policy = cfg.make(0, 0, seed)
        if type(policy).vectorised is not None:
            S = L * G
            return Streams(policy, S, offsets=np.arange(S) * T)
    return PolicyLayers([[cfg.make(layer, g, seed, place=Place(layer, L, g if G > 1 else None, G if G > 1 else None))
                          for g in range(G)] for layer in range(L)], cfg.budget)


READ_IN_ONE_PASS = {  # where each caller's user asks for a prompt read in one pass
    "loop": "kvviz loop reads its text token by token; run it as a prompt with kvviz generate --prompt-mode "
            "prefill (or kvviz needle --prompt-modes prefill)",
    "generate": "use prompt_mode='prefill' (kvviz generate --prompt-mode prefill; kvviz needle --prompt-modes "
                "prefill)"}


def refuse_uncalibrated(configs, policies, caller: str = "generate") -> None:
    """An allocator that decides from calibration rows read with the full cache (head roles)
    gets them from a prompt read in one pass; decoding token by token has none to give. The
    refusal names the way to one pass that the `caller` ("loop" or "generate") has."""
    for cfg, group in zip(configs, policies):
        if group.calibration_rows:
            raise ValueError(f"{cfg.label}: {cfg.policy} decides its heads' roles from calibration rows read with "
                             f"the full cache, which only a prompt read in one pass gives: {READ_IN_ONE_PASS[caller]}")


def reads_query_rows(policies) -> bool:
    """Whether any config's policy reads per-query-head rows (`Policy.reads_query_rows`)."""
    return any(group.reads_query_rows for group in policies)


def mark_query_rows(state: State, policies) -> None:
    """Before a lane's first forward: record each query head's weights if a policy reads them."""
    if state.want_q is None:
        state.want_q = reads_query_rows(policies)
        if state.want_q and not state.on_host:
            raise ValueError("per-query-head rows are supplied on the CPU only: run a policy that "
                             "reads them with --device cpu")


class LaneInputs:
    """Row i of a lane's State as a step's inputs by stream s = layer x G + head (what a
    StreamGroup's `step` reads, kvviz.core.groups)."""

    def __init__(self, state: State, i: int):
        self.state, self.i, self.G = state, i, state.G

    def weights(self, s: int, held) -> np.ndarray:
        return self.state.cur[self.i, s // self.G, s % self.G][held]

    def gather(self, keys) -> np.ndarray:
        return self.state.cur[self.i].reshape(-1).take(keys)  # keys = s x T + position

    def key_norm(self, s: int):
        return self.state.knorm[self.i, s // self.G, s % self.G]

    def value_norm(self, s: int):
        return self.state.vnorm[self.i, s // self.G, s % self.G]

    def query_rows(self, s: int, held) -> np.ndarray:
        return self.state.query_rows(self.i, s // self.G, s % self.G, held)


def _mark(state: State, evicted_at, c: int, i: int, layer: int, g: int, victims, t: int) -> None:
    """Config c (row i of its lane) evicted `victims` at (layer, stream g) at step t."""
    evicted_at[c, layer, g, victims] = t
    if state.freed:
        state.free(i, layer, g, victims)
        return
    heads = state.heads(g)
    state.bias[i, layer, heads][:, victims] = -np.inf
    if not state.on_host:
        hs = np.arange(state.Hk)[heads]
        b, h, v = np.meshgrid([i], hs, np.asarray(victims), indexing="ij")
        state.dirty.append((np.ravel_multi_index((b.ravel(), np.full(b.size, layer), h.ravel(), v.ravel()),
                                                 state.bias.shape), -np.inf))


def mark_victims(state: State, evicted_at, c: int, i: int, victims, t: int) -> None:
    """Config c (row i of its lane) evicted `victims` ((streams, positions)) at step t."""
    streams, pos = victims
    if not len(streams):
        return
    G = state.G
    if state.freed or not state.on_host:
        order = np.argsort(streams, kind="stable")
        streams, pos = streams[order], pos[order]
        starts = np.flatnonzero(np.r_[True, streams[1:] != streams[:-1]])
        for a, b in zip(starts, np.r_[starts[1:], len(streams)]):
            _mark(state, evicted_at, c, i, int(streams[a]) // G, int(streams[a]) % G, pos[a:b], t)
        return
    evicted_at[c].reshape(-1, evicted_at.shape[-1])[streams, pos] = t
    if G == 1:
        state.bias[i][streams, :, pos] = -np.inf
    else:
        state.bias[i].reshape(-1, state.bias.shape[-1])[streams, pos] = -np.inf


def bookkeeping(lane: Lane, configs, policies, evicted_at, t: int, active=None) -> None:
    """Each (active) configuration of the lane takes one step of its StreamGroup (each
    stream: the step's weights on its held positions, renormalised, admit t, evict to its
    budget, kvviz.core.harness); victims are masked (or their slots freed)."""
    state = lane.state
    for i, c in enumerate(lane.index):
        if active is not None and not active[c]:
            continue
        try:
            victims = policies[c].step(t, LaneInputs(state, i))
        except BudgetError as exc:
            raise BudgetError(f"{configs[c].label}, {exc}") from None
        mark_victims(state, evicted_at, c, i, victims, t)
