"""The loop's cache state: what the attention function and the bookkeeping share for one
lane of batch rows (`State`), the fixed-size cache layers of a freed cache (`SlotLayer`),
and the lanes a run's configurations are read in.

Two ways to evict (kvviz.model.loop.config.EVICTIONS):
- "masked": the whole DynamicCache is kept; the attention function adds a bias of 0 or
  -inf per (config, layer, KV head, position) before the softmax, which is exactly removal
  (keys are stored after RoPE, so positions survive either way). Memory is the full
  cache's, per configuration.
- "freed": each configuration's cache holds only its kept positions, in a fixed number of
  slots per layer (`SlotLayer`), sized by the layer's budget (`SlotPlan`): a new token is
  written into a slot an eviction freed, so the cache's memory is the budget's, not the
  text's. Per-stream policies hold budget + 1 slots per KV head; an allocator that moves
  slots between a layer's KV heads draws them from one pool of heads x (budget + 1) slots
  per layer (a slot belongs to the head whose position it holds; the other heads see it
  masked), so it holds no more keys and values than a uniform policy at the same budget.
  Where streams hold different counts the empty slots are masked (-inf). The full-cache
  row runs beside it in its own ordinary cache (its own forward: a "lane").

The bias and the step's group-mean weights are torch tensors sharing memory with numpy
arrays on the CPU, so the policy bookkeeping reads and writes them without copies; on a
GPU only the step's weights on the held slots come to the host, and only the bias
entries an eviction changed go back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvviz.core.replay import NEVER


class State:
    """What the attention function and the bookkeeping share for one lane of B batch rows.

    Host arrays (numpy) are what the policies read and write: `cur` (B, L, G, T) the step's
    weights by position (mean over each group's query heads), `knorm` (B, L, G) the new key's
    L2 norm. Masked (`slots` None): `bias` (B, L, Hk, T) by position. Freed (`slots`: the
    slots of every layer, or one count per layer; S their largest): `bias` (B, L, Hk, S) by
    slot, `slot_pos` (B, L, Hk, S) the position each slot holds for each KV head (-1 empty,
    -2 past the layer's slots), `write` (B, L, Hk) the slot each head's next token goes to;
    the attention function records weights by slot (`cur_s`) and `pull` scatters them to
    positions. `pooled`: a layer's KV heads share its slots (a slot holds one head's
    position: the others see -1 there and a bias of -inf); else each head has its own.

    On the CPU host and device arrays are the same memory; on a GPU `pull` brings the
    step's weights (held slots only, when freed) and statistics in one copy and `push`
    sends back only the bias entries that changed (`dirty`)."""

    def __init__(self, torch, B: int, L: int, Hk: int, G: int, T: int, device="cpu", slots=None,
                 pooled: bool = False):
        self.B, self.L, self.Hk, self.G, self.T = B, L, Hk, G, 0
        self.on_host = torch.device(device).type == "cpu"
        self.device = device
        self.freed = slots is not None
        self.pooled = bool(pooled) and self.freed
        if self.freed:
            self.layer_slots = np.broadcast_to(np.asarray(slots, np.int64), (L,)).copy()
            slots = int(self.layer_slots.max())
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
        self.feeds = None  # a batch of prompts: [(row, left padding, PromptFeed)], one per row
        # each query head's weights, for a policy that reads per-query-head rows (CPU only):
        # `qcur` (B, L, Hq, T) by position; freed: recorded by slot (`qcur_s`) and scattered
        self.want_q = None  # set by `mark_query_rows` before the first forward
        self.qcur = self.qcur_s = None
        # the step's keys (B, Hk, cache length, D) and queries (B, Hq, D) per layer, after RoPE,
        # for a policy that reads key or query vectors (CPU only; set by `mark_query_rows`)
        self.want_kq = None
        self.step_keys, self.step_queries = [None] * L, [None] * L
        self.rope_thetas = []  # the policies that undo RoPE: handed the model's base once
        # masked: each row's cache index of its position 0 (a batch of prompts left-padded to
        # one length); `bias`, `cur` and `qcur` are by cache index, the policies by position
        self.pad = np.zeros(B, np.int64)
        if self.freed:
            self.bias_h = torch.full((B, L, Hk, slots), -np.inf)  # every slot empty
            self.bias = self.bias_h.numpy()
            self.bias_t = self._dev(torch, self.bias_h)
            self.cur_s_h = torch.zeros(B, L, G, slots)
            self.cur_s = self.cur_s_h.numpy()
            self.cur_s_t = self._dev(torch, self.cur_s_h)
            self.slot_pos = np.full((B, L, Hk, slots), -1, np.int64)
            past = np.arange(slots) >= self.layer_slots[:, None]  # (L, S): past the layer's own slots
            self.slot_pos[np.broadcast_to(past[None, :, None, :], self.slot_pos.shape)] = -2
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
        return self.qcur[b, layer, heads][:, np.asarray(held) + self.pad[b]]

    def keys(self, b: int, layer: int, g: int, positions) -> np.ndarray:
        """Stream g's cached keys at `positions` this step, float32 (n, D), after RoPE: by cache
        index (position + padding) when masked, by the slot each position holds when freed."""
        keys = self.step_keys[layer][b, g]
        positions = np.asarray(positions, np.int64)
        if self.freed:
            sp = self.slot_pos[b, layer, g]
            order = np.argsort(sp, kind="stable")
            idx = order[np.searchsorted(sp[order], positions)]
        else:
            idx = positions + self.pad[b]
        return keys[idx].float().numpy()

    def queries(self, b: int, layer: int, g: int) -> np.ndarray:
        """Stream g's query heads' vectors this step, float32 (group, D), after RoPE."""
        q = self.step_queries[layer][b]
        Hq = q.shape[0]
        heads = slice(None) if self.G == 1 else slice(g * (Hq // self.Hk), (g + 1) * (Hq // self.Hk))
        return q[heads].float().numpy()

    # -- freed: the slots ---------------------------------------------------------------
    def heads(self, g: int) -> slice:
        """The KV heads policy stream g decides for: all of them at layer granularity."""
        return slice(None) if self.G == 1 else slice(g, g + 1)

    def place(self, pos, active=None) -> None:
        """Freed: each (active) row's next token `pos` (one position, or one per row) goes,
        for each KV head, to its lowest empty slot (pooled: the heads take the layer's lowest
        empty slots in head order)."""
        rows = np.arange(self.B) if active is None else np.flatnonzero(active)
        each = np.broadcast_to(np.asarray(pos, np.int64), (self.B,))
        if self.pooled:
            free = (self.slot_pos[rows] == -1).all(axis=2)  # (rows, L, S): no head holds it
            short = free.sum(axis=-1) < self.Hk
            if short.any():
                r, layer = np.argwhere(short)[0]
                raise ValueError(f"freed cache overflow: row {rows[r]}, layer {layer} holds all but "
                                 f"{int(free[r, layer].sum())} of its {self.layer_slots[layer]} pooled slots at "
                                 f"position {each[rows[r]]}, one needed per KV head: a policy kept more than its "
                                 "budget")
            s = np.argsort(~free, axis=-1, kind="stable")[..., : self.Hk]  # (rows, L, Hk)
        else:
            empty = self.slot_pos[rows] == -1
            if not empty.any(axis=-1).all():
                full = np.argwhere(~empty.any(axis=-1))[0]
                raise ValueError(f"freed cache overflow: row {rows[full[0]]}, layer {full[1]}, KV head {full[2]} "
                                 f"holds all {self.layer_slots[full[1]]} slots at position {each[rows[full[0]]]}: "
                                 "a policy kept more than its budget")
            s = empty.argmax(axis=-1)  # (rows, L, Hk): the lowest empty slot
        b, layer, h = np.meshgrid(rows, np.arange(self.L), np.arange(self.Hk), indexing="ij")
        self.write[b, layer, h] = s
        self.slot_pos[b, layer, h, s] = each[b]
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
            """A cache layer of fixed size: keys and values (B, Hk, S, D), S the layer's slots
            (`State.layer_slots`), each step's new token written into the slot its State
            chose (`State.write`), not appended. Pooled (`State.pooled`): one pool (B, 1, S, D)
            the layer's KV heads share, handed to attention as (B, Hk, S, D) without a copy (an
            expanded view; the bias masks every slot a head does not hold). Positions are
            explicit (position_ids), so a slot's order says nothing; the attention function
            masks empty slots. `get_seq_length` counts the positions read, as transformers'
            generate expects of a cache."""

            is_croppable = False

            def __init__(self, state, layer: int, keys=None, values=None, seen: int = 0):
                super().__init__()
                self.state, self.layer, self.seen = state, layer, seen
                if keys is not None:
                    self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True

            def lazy_initialization(self, key_states, value_states):
                B, Hk, _, D = key_states.shape
                shape = (B, 1 if self.state.pooled else Hk, int(self.state.layer_slots[self.layer]), D)
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
                if self.state.pooled:  # each head's token into its own slot of the layer's pool
                    S = self.keys.shape[2]
                    idx = self.state.write_t[:B, self.layer, :, None].expand(B, Hk, D)
                    keys, values = self.keys.view(B, S, D), self.values.view(B, S, D)
                    new_k, new_v = key_states.reshape(B, Hk, D), value_states.reshape(B, Hk, D)
                    if key_states.requires_grad:
                        self.keys = keys.scatter(1, idx, new_k).view(B, 1, S, D)
                        self.values = values.scatter(1, idx, new_v).view(B, 1, S, D)
                    else:
                        keys.scatter_(1, idx, new_k)
                        values.scatter_(1, idx, new_v)
                    self.seen += 1
                    return self.keys.expand(B, Hk, S, D), self.values.expand(B, Hk, S, D)
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
                return self.keys.shape[-2] if self.is_initialized else int(self.state.layer_slots[self.layer]), 0

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


@dataclass(frozen=True)
class SlotPlan:
    """How a freed cache lays out one configuration's slots: `budgets[layer]` the layer's
    per-KV-head budget; `pooled` whether the layer's KV heads share one pool (an allocator
    that moves slots between them) or hold their own. A layer then has budget + 1 slots per
    KV head (one step admits one position per head before the eviction), pooled or not, so
    every configuration at one budget holds the same keys and values."""

    budgets: tuple
    pooled: bool = False

    def layer_slots(self, Hk: int, held=None, limit: int | None = None) -> np.ndarray:
        """Slots per layer (int64 (L,)): budget + 1 per KV head, at most `limit` (the
        positions the run will ever see, when known); pooled, Hk times that per layer. With
        `held` ((rows, L, Hk) counts after a prompt's eviction), at least the most a head
        holds + 1 (pooled: the most a layer holds + one per head)."""
        per = np.asarray(self.budgets, np.int64) + 1
        if limit is not None:
            per = np.minimum(per, limit)
        if self.pooled:
            pool = Hk * per
            return pool if held is None else np.maximum(pool, np.asarray(held).sum(axis=-1).max(axis=0) + Hk)
        if held is not None:
            most = np.asarray(held).max(axis=(0, 2)) + 1
            per = np.maximum(per, most if limit is None else np.minimum(most, limit))
        return per


def slot_plan(group, L: int) -> SlotPlan:
    """A StreamGroup's SlotPlan over L layers (kvviz.core.groups: `layer_budgets`,
    `shares_slots`)."""
    return SlotPlan(tuple(int(b) for b in group.layer_budgets(L)), bool(group.shares_slots))


def lanes_for(torch, configs, policies, eviction: str, L: int, Hk: int, G: int, T: int, device) -> list[Lane]:
    """The lanes of a run read token by token from an empty cache. Masked: every config in
    one lane over one DynamicCache. Freed: the full row in its own lane, the evicting rows
    in one lane per SlotPlan (`by_plan`), each layer's slots as the plan says."""
    from transformers import DynamicCache

    C = len(configs)
    if eviction == "masked":
        return [Lane(np.arange(C), State(torch, C, L, Hk, G, T, device), DynamicCache())]
    for cfg, group in zip(configs, policies):
        if getattr(group, "plans_layers", False):
            raise ValueError(f"{cfg.label}: {group.allocator.title} sets its layers' budgets from the first rows it "
                             "reads (plan_layers), and a freed cache read token by token is sized before any row is "
                             "read: read the prompt in one pass (prompt_mode='prefill'; kvviz generate --prompt-mode "
                             "prefill) or evict masked (eviction='masked')")
    full = np.array([c for c, cfg in enumerate(configs) if cfg.is_full])
    lanes = [Lane(full, State(torch, len(full), L, Hk, G, T, device), DynamicCache())] if len(full) else []
    for plan, rest in by_plan(configs, policies, L):
        st = State(torch, len(rest), L, Hk, G, T, device, slots=plan.layer_slots(Hk, limit=T), pooled=plan.pooled)
        st.place(0)
        lanes.append(Lane(rest, st, slot_cache(st)))
    return lanes


def by_plan(configs, policies, L: int) -> list[tuple[SlotPlan, np.ndarray]]:
    """Freed: the evicting configs grouped by their SlotPlan, one lane each, so that every
    row's cache is its own size (a batched tensor has one size for all its rows)."""
    plans = [None if cfg.is_full else slot_plan(group, L) for cfg, group in zip(configs, policies)]
    order = sorted({p for p in plans if p is not None}, key=lambda p: (p.pooled, p.budgets))
    return [(p, np.array([c for c, q in enumerate(plans) if q == p])) for p in order]


def by_budget(configs, policies) -> list[tuple[int, np.ndarray]]:
    """The evicting configs grouped by the most one stream may hold (`capacity`)."""
    cap = [group.capacity for group in policies]  # None: the full cache evicts nothing
    return [(b, np.array([c for c in range(len(configs)) if cap[c] == b]))
            for b in sorted({x for x in cap if x is not None})]


def lanes_after_prompt(torch, cache, configs, policies, evicted_at, eviction: str, T: int, device) -> list[Lane]:
    """The lanes after a prompt read in one pass (batch 1, full `cache`) and each config's
    one-shot eviction (`evicted_at` (C, L, G, T), victims at step T0 - 1). Masked: the cache
    repeated per config, victims masked. Freed: the full row keeps `cache`; each evicting
    row's cache is gathered to its kept positions, one lane per SlotPlan (the plan read
    after the eviction: an allocator may set its layers' budgets from the prompt)."""
    C, L, G, _ = evicted_at.shape
    T0 = cache.get_seq_length()
    Hk = cache.layers[0].keys.shape[1]
    if eviction == "masked":
        cache.batch_repeat_interleave(C)
        return [Lane(np.arange(C), masked_state(torch, evicted_at[..., :T0], Hk, T, device), cache)]
    full = np.array([c for c, cfg in enumerate(configs) if cfg.is_full])
    lanes = [Lane(full, State(torch, len(full), L, Hk, G, T, device), cache)] if len(full) else []
    for plan, rest in by_plan(configs, policies, L):
        st, layers = gathered(torch, cache, evicted_at[rest][..., :T0] == NEVER, plan, T, device, limit=T)
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


def gathered(torch, cache, held, budget, T: int, device, limit: int | None = None):
    """Freed: a State (positions 0..T-1) over slots and, per layer, keys and values gathered
    from a batch-1 `cache` of T0 positions to the `held` ones (bool (E, L, G, T0)). `budget`:
    a SlotPlan (or an int: that budget in every layer, not pooled); each layer's slots as
    `SlotPlan.layer_slots` gives them for the most any row holds there. Per KV head: keys
    (E, Hk, S_l, D), head h's kept positions in its first slots. Pooled: (E, 1, S_l, D), the
    heads' kept positions one after another (head 0's first)."""
    E, L, G, T0 = held.shape
    Hk = cache.layers[0].keys.shape[1]
    plan = budget if isinstance(budget, SlotPlan) else SlotPlan((int(budget),) * L)
    n_held = held.sum(axis=-1)  # (E, L, G)
    per_head = np.repeat(n_held, Hk, axis=2) if G == 1 else n_held  # (E, L, Hk)
    S_l = plan.layer_slots(Hk, per_head, limit)
    st = State(torch, E, L, Hk, G, T, device, slots=S_l, pooled=plan.pooled)
    S = st.S
    src = np.zeros((E, L, Hk, S), np.int64)  # the cache entry (head x T0 + position) each slot takes
    for e, layer, h in np.ndindex(E, L, Hk):
        kept = np.flatnonzero(held[e, layer, 0 if G == 1 else h])
        start = int(per_head[e, layer, :h].sum()) if plan.pooled else 0
        st.slot_pos[e, layer, h, start:start + len(kept)] = kept
        src[e, layer, 0 if plan.pooled else h, start:start + len(kept)] = h * T0 + kept
    st.bias[:] = np.where(st.slot_pos >= 0, 0.0, -np.inf)
    if not st.on_host:  # the whole bias once
        st.bias_t.copy_(st.bias_h)
    index = torch.as_tensor(src, device=device)
    layers = []
    for layer, lay in enumerate(cache.layers):
        D, n = lay.keys.shape[-1], int(S_l[layer])
        rows = 1 if plan.pooled else Hk
        idx = index[:, layer, :rows, :n, None].reshape(E, rows * n, 1).expand(E, rows * n, D)
        flat_k, flat_v = lay.keys.reshape(1, Hk * T0, D), lay.values.reshape(1, Hk * T0, D)
        layers.append((flat_k.expand(E, -1, -1).gather(1, idx).view(E, rows, n, D),
                       flat_v.expand(E, -1, -1).gather(1, idx).view(E, rows, n, D)))
    return st, layers


def cache_bytes(caches) -> int:
    """Bytes the caches hold in keys and values (what was allocated, empty slots included)."""
    total = 0
    for cache in caches:
        for lay in cache.layers:
            if getattr(lay, "keys", None) is not None and getattr(lay, "is_initialized", True):
                total += lay.keys.numel() * lay.keys.element_size() + lay.values.numel() * lay.values.element_size()
    return total


def lane_bytes(lanes, configs: int) -> np.ndarray:
    """Bytes of keys and values each configuration's cache holds (int64 (C,), C = `configs`):
    a lane's caches shared evenly by its rows (a batched tensor has one size for all its
    rows; masked, every row holds the whole cache)."""
    out = np.zeros(int(configs), np.int64)
    for lane in lanes:
        if len(lane.index):
            out[lane.index] = cache_bytes([lane.cache]) // len(lane.index)
    return out
