"""The torch side of the loop: one batched teacher-forced decode, evicted keys masked.

The whole DynamicCache is kept; a registered attention function adds a bias of 0 or
-inf per (config, layer, KV head, position) before the softmax, which is exactly
removal (keys are stored after RoPE, so positions survive either way). The bias and the
step's group-mean weights are torch tensors sharing memory with numpy arrays, so the
policy bookkeeping reads and writes them without copies.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np

from kvviz.core import harness
from kvviz.core.replay import NEVER
from kvviz.core.streams import STATES, Streams
from kvviz.core.trace import packed_offset
from kvviz.model.loop.config import GRANULARITIES, check_configs
from kvviz.model.loop.result import LoopResult

ATTN_NAME = "kvviz_loop"
_LOCK = threading.Lock()  # one loop per process at a time: the attention function reads _STATE
_STATE = None


class State:
    """What the attention function and the bookkeeping share for one run. The host arrays
    (numpy views of CPU tensors) are what the policies read and write; on a GPU the device
    tensors are separate: the step's weights come to the host in one copy with the step's
    statistics (`pull`), the bias goes back after the bookkeeping (`push`). On the CPU they
    are the same memory and neither copies.

    `record_prompt(T0)` arms a prefill: the next forward (any length) writes batch row 0's
    prompt rows (L, G, T0, T0) and key norms (L, G, T0) into `prompt` / `prompt_norms`."""

    def __init__(self, torch, B: int, L: int, Hk: int, G: int, T: int, device="cpu"):
        self.G, self.T = G, 0
        self.on_host = torch.device(device).type == "cpu"
        self.device = device
        self.knorm_h = torch.zeros(B, L, G)  # L2 norm of this step's new key (mean over KV heads if G == 1)
        self.knorm = self.knorm_h.numpy()
        self.knorm_t = self.knorm_h if self.on_host else self.knorm_h.to(device)
        self.bias_h = torch.zeros(B, L, Hk, 0)
        self.cur_h = torch.zeros(B, L, G, 0)
        self.grow(torch, T)
        self.prompt_t = self.prompt_norms_t = self.prompt = self.prompt_norms = None

    def grow(self, torch, T: int) -> None:
        """Room for T positions, what is set kept (kvviz.hf does not know the length ahead)."""
        if T <= self.T:
            return
        B, L, Hk, old = self.bias_h.shape
        bias = torch.zeros(B, L, Hk, T)  # 0 = held, -inf = evicted
        bias[..., :old] = self.bias_h
        self.bias_h, self.bias = bias, bias.numpy()
        self.cur_h = torch.zeros(B, L, self.G, T)  # this step's weights, mean over each group's query heads
        self.cur = self.cur_h.numpy()
        self.bias_t = self.bias_h if self.on_host else self.bias_h.to(self.device)
        self.cur_t = self.cur_h if self.on_host else self.cur_h.to(self.device)
        self.T = T

    def record_prompt(self, torch, T0: int) -> None:
        L, G = self.cur.shape[1:3]
        self.prompt_t = torch.zeros(L, G, T0, T0, device=self.device)
        self.prompt_norms_t = torch.zeros(L, G, T0, device=self.device)

    def pull_prompt(self) -> None:
        """The prefill's recorded rows to the host (one copy each), recording disarmed."""
        self.prompt = self.prompt_t.cpu().numpy()
        self.prompt_norms = self.prompt_norms_t.cpu().numpy()
        self.prompt_t = self.prompt_norms_t = None

    def pull(self, torch, stats):
        """Host copy of this step's weights (into `cur`) and of `stats` (returned, or None)."""
        if self.on_host:
            return None if stats is None else stats.numpy()
        parts = [self.cur_t.reshape(-1).double(), self.knorm_t.reshape(-1).double()]
        host = torch.cat(parts + ([] if stats is None else [stats.reshape(-1)])).cpu().numpy()
        n, k = self.cur.size, self.knorm.size
        self.cur.reshape(-1)[:] = host[:n]
        self.knorm.reshape(-1)[:] = host[n:n + k]
        return None if stats is None else host[n + k:].reshape(stats.shape)

    def push(self):
        if not self.on_host:
            self.bias_t.copy_(self.bias_h)


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention with the running loop's eviction bias; records the group means.

    query (B, Hq, q, D), key/value (B, Hk, k, D); query head h reads KV head h // (Hq/Hk),
    as transformers' repeat_kv lays them out, so grouping avoids repeating the keys. A
    one-token step records its row into `cur`; a prefill armed by `State.record_prompt`
    records batch row 0's q rows into `prompt_t`.
    """
    import torch

    st = _STATE
    B, Hq, q, D = query.shape
    Hk, k = key.shape[1], key.shape[2]
    g = Hq // Hk
    scores = torch.matmul(query.reshape(B, Hk, g * q, D), key.transpose(-1, -2)) * scaling
    softcap = kwargs.get("softcap")
    if softcap:  # Gemma 2's attention logit softcapping, as its eager attention does it
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = (scores.view(B, Hk, g, q, k) + attention_mask[..., :k].unsqueeze(2)).view(B, Hk, g * q, k)
    if st is not None:
        scores = scores + st.bias_t[:B, module.layer_idx, :, None, :k]
    w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(w, value).view(B, Hq, q, D).transpose(1, 2).contiguous()
    if st is not None and st.prompt_t is not None:
        w0 = w.view(B, Hk, g, q, k)[0].float()  # row i is query i over keys 0..k-1 (row i's self at i)
        norms = key[0].float().norm(dim=-1)  # (Hk, k)
        if st.G == 1:
            st.prompt_t[module.layer_idx, 0, :q, :k] = w0.mean(dim=(0, 1))
            st.prompt_norms_t[module.layer_idx, 0, :k] = norms.mean(dim=0)
        else:
            st.prompt_t[module.layer_idx, :, :q, :k] = w0.mean(dim=1)
            st.prompt_norms_t[module.layer_idx, :, :k] = norms
    elif st is not None and q == 1:
        t = k - 1  # self weight dropped: the policies decide about earlier positions
        w = w.view(B, Hk, g, k)[..., :t]
        norms = key[:, :, t].float().norm(dim=-1)  # (B, Hk): the new key, after RoPE, as cached
        if st.G == 1:
            st.cur_t[:, module.layer_idx, 0, :t] = w.mean(dim=(1, 2))
            st.knorm_t[:, module.layer_idx, 0] = norms.mean(dim=1)
        else:
            st.cur_t[:, module.layer_idx, :, :t] = w.mean(dim=2)
            st.knorm_t[:, module.layer_idx] = norms
    return out, None


def register():
    """The attention function, and the eager (additive causal) mask for it: without a
    registered mask transformers passes none, which a one-token step does not need but a
    prefill does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_NAME, attention)
    AttentionMaskInterface.register(ATTN_NAME, eager_mask)


@contextmanager
def attached(mdl, state: State):
    """`mdl` runs the eviction attention over `state` inside the block (one at a time per
    process); its previous attention implementation comes back on exit, error or not."""
    global _STATE
    with _LOCK:
        register()
        previous = mdl.config._attn_implementation
        _STATE = state
        try:
            mdl.set_attn_implementation(ATTN_NAME)
            yield state
        finally:
            _STATE = None
            mdl.set_attn_implementation(previous)


def tokenize(tok, text: str, max_tokens: int) -> list[int]:
    """As kvviz.model.capture does (kvviz.model.models.tokenize): BOS as the tokenizer's convention says."""
    from kvviz.model.models import tokenize as tokens

    return tokens(tok, text, max_tokens)[0]


def check_inputs(text, granularity, max_tokens) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text is empty: give the loop something to read")
    if isinstance(max_tokens, bool) or int(max_tokens) != max_tokens or max_tokens < 2:
        raise ValueError(f"max_tokens must be an integer >= 2, got {max_tokens!r}")


def step(mdl, cache, state: State, ids, t: int, configs, policies, evicted_at, stats=None,
         active=None) -> tuple:
    """The step contract, shared by `run` and generation: one batched forward of token
    `ids` (C,) at position t through the eviction attention, `stats(logits (C, V))` on the
    device, the step's one host copy, each active config's bookkeeping, the bias pushed.
    Returns (host stats or None, model seconds, bookkeeping seconds)."""
    import torch

    C = ids.shape[0]
    t0 = time.perf_counter()
    with torch.no_grad():
        out = mdl(input_ids=ids.reshape(C, 1),
                  position_ids=torch.full((C, 1), t, dtype=torch.long, device=ids.device),
                  cache=cache, use_cache=True)
        host = state.pull(torch, None if stats is None else stats(out.logits[:, -1]))
    del out
    t1 = time.perf_counter()
    bookkeeping(state, configs, policies, evicted_at, t, active)
    state.push()
    return host, t1 - t0, time.perf_counter() - t1


def run(text, configs, granularity="layer", max_tokens=1024, progress=None, model=None,
        rows_layers=None, rows_tokens=None, seed=0, timings=None, device="cpu",
        dtype="float32") -> LoopResult:
    check_inputs(text, granularity, max_tokens)
    configs = check_configs(configs)
    import torch
    from transformers import DynamicCache

    from kvviz.model.models import (
        check_layers,
        default_layers,
        load_model,
        model_provenance,
        text_config,
        token_strings,
    )
    from kvviz.model.models import tokenize as tokens

    tok, mdl = load_model(model, "loop", device, dtype)
    ids, offsets, bos = tokens(tok, text, int(max_tokens))
    T = len(ids)
    if T < 2:
        raise ValueError("text must tokenise to at least 2 tokens")
    cfg = text_config(mdl)
    check_architecture(mdl, T)
    L, Hk = cfg.num_hidden_layers, cfg.num_key_value_heads
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
    state = State(torch, C, L, Hk, G, T, device)
    with attached(mdl, state):
        cache = DynamicCache()  # full layers only: key index = position (see check_architecture)
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        for t in range(T):
            def stats(logits, t=t):  # (C, 3): nll, argmax, KL(full || config), on the device
                logp = torch.log_softmax(logits.double(), dim=-1)
                return torch.stack([-logp[:, ids[t + 1]], logp.argmax(dim=-1).double(),
                                    (logp[f].exp() * (logp[f] - logp)).sum(dim=-1).clamp_min(0)], 1)

            host, model_s[t], book_s[t] = step(mdl, cache, state, ids_t[t].expand(C), t, configs, policies,
                                               evicted_at, stats if t < T - 1 else None)
            if host is not None:
                nll[:, t], top1[:, t], kl[:, t] = host[:, 0], host[:, 1].astype(np.int64), host[:, 2]
            if t < Tr and rows is not None:  # `cur` is still step t's: the bookkeeping reads it only
                off = packed_offset(t)
                rows[:, :, :, off:off + t] = state.cur[:, rows_layers, :, :t]
            if progress is not None:
                progress(t + 1, T)
    np.exp(-nll, out=p_true)
    if timings is not None:
        timings.update(model=model_s, bookkeeping=book_s)
    return LoopResult(configs=configs, granularity=granularity, tokens=token_strings(tok, ids, text, offsets),
                      token_ids=np.array(ids, np.int64), nll=nll, p_true=p_true, kl_tokens=kl, top1=top1,
                      evicted_at=evicted_at, layers=list(range(L)), rows=rows, rows_layers=rows_layers,
                      rows_tokens=Tr,
                      meta={"model_seconds": float(model_s.sum()), "bookkeeping_seconds": float(book_s.sum()),
                            "seed": seed, "bos": bos, **model_provenance(mdl)})


def check_architecture(mdl, T: int) -> None:
    """Refuse, naming the model and the feature, what the masking attention function does not
    reproduce: sliding-window layers once the text is longer than the window (within the
    window a sliding layer attends to everything). Softcapping is implemented (`attention`)."""
    from kvviz.model.models import model_provenance, text_config

    cfg = text_config(mdl)
    name = model_provenance(mdl)["model"]
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or []
    sliding = "sliding_attention" in types or (window and getattr(cfg, "use_sliding_window", True)
                                               and not types)
    if sliding and window and T > window:
        raise ValueError(f"model {name}: sliding-window attention (window {window}) is not supported "
                         f"by the loop for a text of {T} tokens; use --max-tokens {window} or less")


def make_policies(cfg, L: int, G: int, T: int, seed: int, vectorised: bool = True):
    """A config's policy state: None for full; one Streams over its L x G streams where the
    policy is vectorised and `vectorised` allows (stream s = layer * G + head, keyed into the
    flat (L, G, T) step weights); else one policy per (layer, head), rng seeded per (seed,
    layer, head). A prefill needs the per-head objects: Streams holds at most budget + 1."""
    if cfg.is_full:
        return None
    if vectorised and cfg.policy in STATES:
        S = L * G
        return Streams(cfg.make(0, 0, seed), S, offsets=np.arange(S) * T)
    return [[cfg.make(layer, g, seed) for g in range(G)] for layer in range(L)]


def _mark(state: State, evicted_at, c: int, layer: int, g: int, victims, t: int) -> None:
    evicted_at[c, layer, g, victims] = t
    if state.G == 1:
        state.bias[c, layer][:, victims] = -np.inf
    else:
        state.bias[c, layer, g, victims] = -np.inf


def bookkeeping(state: State, configs, policies, evicted_at, t: int, active=None) -> None:
    """Each (active) policy takes one harness step (kvviz.core.harness.step: the step's weights
    on its held positions, renormalised, admit t, evict to budget); victims get -inf."""
    bias, G = state.bias, state.G
    for c, cfg in enumerate(configs):
        pol = policies[c]
        if pol is None or (active is not None and not active[c]):
            continue
        if isinstance(pol, Streams):
            raw = state.cur[c].reshape(-1).take(pol.held())  # (L*G, n); row t is cur[..., :t]
            victims = harness.step(pol, t, raw, cfg.budget)
            if victims.shape[1]:
                v = victims[:, 0]
                evicted_at[c].reshape(len(v), -1)[pol.streams, v] = t
                if G == 1:
                    bias[c][pol.streams, :, v] = -np.inf
                else:
                    bias[c].reshape(len(v), -1)[pol.streams, v] = -np.inf
            continue
        for layer, per_layer in enumerate(pol):
            for g, p in enumerate(per_layer):
                raw = state.cur[c, layer, g][p.held()] if p.uses_attention else None
                norm = state.knorm[c, layer, g] if p.reads_key_norms else None
                victims = harness.step(p, t, raw, cfg.budget, norm)
                if len(victims):
                    _mark(state, evicted_at, c, layer, g, victims, t)


def prefill_bookkeeping(state: State, configs, policies, evicted_at, T0: int) -> None:
    """After a prefill (`State.pull_prompt`): each policy observes prompt rows 0..T0-1 as
    recorded, without evicting (kvviz.core.harness.feed), then evicts once, down to its budget,
    at step T0-1 (the last row through kvviz.core.harness.step, so Policy.evict's one-shot
    choice). Needs per-(layer, head) policies (`make_policies(..., vectorised=False)`)."""
    rows, norms = state.prompt, state.prompt_norms
    for c, cfg in enumerate(configs):
        pol = policies[c]
        if pol is None:
            continue
        if isinstance(pol, Streams):
            raise ValueError("prefill_bookkeeping needs per-head policies, not Streams")
        for layer, per_layer in enumerate(pol):
            for g, p in enumerate(per_layer):
                for t in range(T0):
                    raw = rows[layer, g, t, :t] if p.uses_attention else None  # nothing evicted yet: held = 0..t-1
                    norm = norms[layer, g, t] if p.reads_key_norms else None
                    if t < T0 - 1:
                        harness.feed(p, t, raw, norm)
                    else:
                        victims = harness.step(p, t, raw, cfg.budget, norm)
                        if len(victims):
                            _mark(state, evicted_at, c, layer, g, victims, t)
