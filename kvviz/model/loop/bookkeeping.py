"""The loop's bookkeeping: each configuration's policies as one StreamGroup
(kvviz.core.groups), stepped on a lane's State after every forward; victims are masked
(or their slots freed); and the memory a run's policies held.
"""
from __future__ import annotations

import numpy as np

from kvviz.core.groups import AllocatedLayers, PolicyLayers, StreamGroup, Unevicted
from kvviz.core.policies import Place
from kvviz.core.policies.base import BudgetError
from kvviz.core.replay import NEVER
from kvviz.core.streams import Streams
from kvviz.model.loop.attention import rope_policies
from kvviz.model.loop.cache import Lane, State


def memory(mdl, configs, policies, evicted_at, held_bytes, step: int) -> dict:
    """The memories of a run at `step`, in bytes: the keys and values the caches hold
    (`held_bytes`: each configuration's, kvviz.model.loop.cache.lane_bytes, or their total)
    beside what the full cache would hold for the same rows, and the policies' own
    bookkeeping (each policy's bytes per slot x the slots it holds); totals over the rows
    (`cache_bytes`, `full_cache_bytes`, `policy_bytes`) and, per configuration in order,
    `memory_by_config` (`label`, `name` (as tables print it), `kv_held_bytes` (None when only
    the total is known), `full_cache_bytes`, `policy_bytes`)."""
    from kvviz.core.policies import config_label
    from kvviz.model.models import attention_shape

    shape = attention_shape(mdl)
    L, Hk, D = shape.layers, shape.kv_heads, shape.head_dim
    item = next(mdl.parameters()).element_size()
    C, _, G, T = evicted_at.shape
    n = step + 1
    full_one = L * Hk * n * D * 2 * item
    per = np.asarray(held_bytes, np.int64) if np.ndim(held_bytes) else None
    rows = []
    for c, cfg_c in enumerate(configs):
        book = 0
        if not cfg_c.is_full:
            ev = evicted_at[c, ..., :n]
            book = int(((ev == NEVER) | (ev > step)).sum()) * policies[c].bytes_per_slot
        rows.append({"label": cfg_c.label, "name": config_label(cfg_c.policy, cfg_c.params, budget=cfg_c.budget),
                     "kv_held_bytes": None if per is None else int(per[c]),
                     "full_cache_bytes": int(full_one), "policy_bytes": int(book)})
    return {"cache_bytes": int(held_bytes if per is None else per.sum()), "full_cache_bytes": int(C * full_one),
            "policy_bytes": int(sum(r["policy_bytes"] for r in rows)), "memory_by_config": rows}


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
        if type(policy).vectorised is not None and getattr(policy, "ratio", None) is None:
            S = L * G
            return Streams(policy, S, offsets=np.arange(S) * T,
                           names=[f"layer {s // G}" + (f", head {s % G}" if G > 1 else "") for s in range(S)])
    return PolicyLayers([[cfg.make(layer, g, seed, place=Place(layer, L, g if G > 1 else None, G if G > 1 else None))
                          for g in range(G)] for layer in range(L)], cfg.budget)


READ_IN_ONE_PASS = {  # where each caller's user asks for a prompt read in one pass
    "loop": "kvviz loop reads its text token by token; run it as a prompt with kvviz generate --prompt-mode "
            "prefill (or kvviz needle --prompt-modes prefill)",
    "generate": "use prompt_mode='prefill' (kvviz generate --prompt-mode prefill; kvviz needle --prompt-modes "
                "prefill)"}


def refuse_uncalibrated(configs, policies, caller: str = "generate", eviction: str = "masked") -> None:
    """Before a run read token by token: a group that asks for calibration rows read with the
    full cache and cannot take them token by token (`StreamGroup.calibrates_in_decode`; an
    allocator's configuration takes the first rows it sees) is refused, and so, in freed mode
    (its slots sized before any row is read), is an allocator that plans its layers' budgets
    from those rows (`plans_layers`); each refusal names it, what it lacks and the way to
    one pass that the `caller` ("loop" or "generate") has."""
    for cfg, group in zip(configs, policies):
        if group.calibration_rows and not group.calibrates_in_decode:
            raise ValueError(f"{cfg.label}: {cfg.policy} needs {group.calibration_rows} calibration rows read with "
                             "the full cache before it evicts and cannot take them token by token: "
                             f"{READ_IN_ONE_PASS[caller]}")
        if eviction == "freed" and getattr(group, "plans_layers", False):
            raise ValueError(f"{cfg.label}: {group.allocator.title} sets its layers' budgets from the first rows it "
                             "reads (plan_layers), and a freed cache read token by token is sized before any row is "
                             f"read: {READ_IN_ONE_PASS[caller]}; or evict masked")


def reads_query_rows(policies) -> bool:
    """Whether any config's policy reads per-query-head rows (`Policy.reads_query_rows`)."""
    return any(group.reads_query_rows for group in policies)


def reads_vectors(policies) -> list:
    """The groups whose policy reads key or query vectors (`reads_keys`, `reads_queries`)."""
    return [group for group in policies if getattr(group, "reads_keys", False)
            or getattr(group, "reads_queries", False)]


def mark_query_rows(state: State, policies) -> None:
    """Before a lane's first forward: record each query head's weights if a policy reads them,
    and the step's keys and queries if a policy reads those (each on the CPU only; key and
    query vectors per KV head, so at layer granularity only for a model with one KV head)."""
    if state.want_q is None:
        state.want_q = reads_query_rows(policies)
        if state.want_q and not state.on_host:
            raise ValueError("per-query-head rows are supplied on the CPU only: run a policy that "
                             "reads them with --device cpu")
    if state.want_kq is None:
        vectors = reads_vectors(policies)
        state.want_kq = bool(vectors)
        # the policies that undo RoPE: handed the model's base (or their own checked against
        # it) by the attention function at its first step (`check_rope`)
        state.rope_thetas = rope_policies(vectors)
        names = ", ".join(sorted({g.stream_policy(0).name for g in vectors}))
        if vectors and not state.on_host:
            raise ValueError(f"{names}: key and query vectors are supplied on the CPU only: run a "
                             "policy that reads them with --device cpu")
        if vectors and state.G == 1 and state.Hk > 1:
            raise ValueError(f"{names}: reads key and query vectors, which belong to one KV head, "
                             f"and the model has {state.Hk} KV heads: run it at kv-head granularity "
                             "(--granularity kv-head)")


class LaneInputs:
    """Row i of a lane's State as a step's inputs by stream s = layer x G + head (what a
    StreamGroup's `step` reads, kvviz.core.groups)."""

    def __init__(self, state: State, i: int):
        self.state, self.i, self.G = state, i, state.G

    def weights(self, s: int, held) -> np.ndarray:
        pad = self.state.pad[self.i]  # the row's cache index of position 0 (left padding)
        return self.state.cur[self.i, s // self.G, s % self.G][np.asarray(held) + pad if pad else held]

    def gather(self, keys) -> np.ndarray:
        pad = self.state.pad[self.i]
        return self.state.cur[self.i].reshape(-1).take(keys + pad if pad else keys)  # keys = s x T + position

    def key_norm(self, s: int):
        return self.state.knorm[self.i, s // self.G, s % self.G]

    def value_norm(self, s: int):
        return self.state.vnorm[self.i, s // self.G, s % self.G]

    def query_rows(self, s: int, held) -> np.ndarray:
        return self.state.query_rows(self.i, s // self.G, s % self.G, held)

    def keys(self, s: int, positions) -> np.ndarray:
        return self.state.keys(self.i, s // self.G, s % self.G, positions)

    def query(self, s: int) -> np.ndarray:
        return self.state.queries(self.i, s // self.G, s % self.G)


def _mark(state: State, evicted_at, c: int, i: int, layer: int, g: int, victims, t: int) -> None:
    """Config c (row i of its lane) evicted `victims` at (layer, stream g) at step t."""
    evicted_at[c, layer, g, victims] = t
    if state.freed:
        state.free(i, layer, g, victims)
        return
    victims = np.asarray(victims) + state.pad[i]  # by cache index
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
    pos = pos + state.pad[i]  # by cache index
    if G == 1:
        state.bias[i][streams, :, pos] = -np.inf
    else:
        state.bias[i].reshape(-1, state.bias.shape[-1])[streams, pos] = -np.inf


def bookkeeping(lane: Lane, configs, policies, evicted_at, t, active=None) -> None:
    """Each (active) configuration of the lane takes one step of its StreamGroup (each
    stream: the step's weights on its held positions, renormalised, admit t, evict to its
    budget, kvviz.core.harness); victims are masked (or their slots freed). `t`: the step,
    or one per configuration (C,) when the rows are at different positions."""
    state = lane.state
    for i, c in enumerate(lane.index):
        if active is not None and not active[c]:
            continue
        try:
            victims = policies[c].step(int(t if np.ndim(t) == 0 else t[c]), LaneInputs(state, i))
        except BudgetError as exc:
            raise type(exc)(f"{configs[c].label}, {exc}") from None
        mark_victims(state, evicted_at, c, i, victims, int(t if np.ndim(t) == 0 else t[c]))
