"""The loop's attention: a registered attention function (`attention`) that adds the running
lane's eviction bias and records the step's weights, the same for a prompt read in blocks
(`_prompt`), and Falcon's inline attention routed through it (`falcon_forward`).

The lane a forward runs is bound to the model, not held in a module global: `attached`
gives every module of the model one `Binding`, `use(mdl, state)` points it at a lane's
State, and the attention function reads it from the module it is called for. Two models
can run at once; one model runs one block at a time (its own lock).
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import numpy as np

from kvviz.model.loop.cache import State
from kvviz.model.loop.config import PREFILL_CHUNK

BOUND = "_kvviz_binding"  # the attribute every module of an attached model carries
_REGISTER = threading.Lock()  # guards the registration and the per-model locks
_MODEL_LOCKS = weakref.WeakKeyDictionary()  # model -> its lock: one block at a time per model


class Binding:
    """The lane (a kvviz.model.loop.cache.State, or None: plain attention) a model's next
    forward runs, one object shared by every module of the model."""

    __slots__ = ("state",)

    def __init__(self, state=None):
        self.state = state


def lane_of(module):
    """The State `module`'s model is bound to now, or None."""
    binding = module.__dict__.get(BOUND)
    return None if binding is None else binding.state


def bind(module, state) -> None:
    """Bind `module` (one attention module, or a model outside `attached`) to `state`."""
    binding = module.__dict__.get(BOUND)
    if binding is None:
        module.__dict__[BOUND] = Binding(state)
    else:
        binding.state = state


ATTN_NAME = "kvviz_loop"


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention with the running lane's eviction bias; records the group means.

    query (B, Hq, q, D), key/value (B, Hk, k, D); query head h reads KV head h // (Hq/Hk),
    as transformers' repeat_kv lays them out, so grouping avoids repeating the keys. A
    one-token step records its weights into `cur` (by position, self dropped) or `cur_s`
    (freed: by slot); a prompt read with a PromptFeed armed goes through `_prompt`.
    """
    import torch

    st = lane_of(module)
    layer = module.layer_idx
    B, Hq, q, D = query.shape
    Hk, k = key.shape[1], key.shape[2]
    g = Hq // Hk
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")  # this layer's own window, as the model passes it
    if q > 1:
        return _prompt(st, layer, query, key, value, scaling, softcap, window, module), None
    scores = torch.matmul(query.reshape(B, Hk, g * q, D), key.transpose(-1, -2)) * scaling
    if softcap:  # Gemma 2's attention logit softcapping, as its eager attention does it
        scores = torch.tanh(scores / softcap) * softcap
    if st is not None:
        scores = scores + st.bias_t[:B, layer, :, None, :k]
    if window:
        scores = _outside_window(torch, st, layer, scores, k, int(window))
    w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(w, value).view(B, Hq, q, D).transpose(1, 2).contiguous()
    if st is not None and q == 1 and st.want_kq:  # the cache's keys and the step's queries, as they are
        if st.rope_thetas:
            check_rope(getattr(module, "config", None), st.rope_thetas)
            st.rope_thetas = []
        st.step_keys[layer], st.step_queries[layer] = key.detach(), query.detach()[:, :, 0]
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


def rope_policies(groups) -> list:
    """Every stream's policy in `groups` that undoes RoPE on the queries (it reads them and
    declares rope_theta): what `check_rope` hands the model's base to."""
    from kvviz.core.policies.vectors import undoes_rope

    return [p for group in groups for s in range(group.size)
            if (p := group.stream_policy(s)) is not None and undoes_rope(p)]


def check_rope(config, policies) -> None:
    """Each policy that undoes RoPE on the queries (`rope_policies`) gets the model's base as
    the run's (its rope_theta left at the default takes it), before its first step. The
    model's RoPE must be plain (rope_type "default"), and a rope_theta given must be the
    model's: ValueError naming the policy, the parameter and the model's value otherwise."""
    from kvviz.core.policies.vectors import use_rope_theta
    from kvviz.model.models import model_rope

    theta, kind = model_rope(config)
    for policy in policies:
        if kind not in ("default", None):
            raise ValueError(f"{policy.name} undoes plain RoPE on the queries, and the model's RoPE is "
                             f"{kind!r} (scaled): its statistics would be wrong")
        use_rope_theta(policy, theta, "the model's config")


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


def _prompt(st: State | None, layer: int, query, key, value, scaling, softcap, window=None, module=None):
    """Several queries at once (a prompt), causal (and within the layer's sliding `window`,
    if it has one): the output as eager attention gives it, with no (q, k) array held.
    From an empty cache with no softcap, window or bias the output is PyTorch's fused
    attention (`fused_prompt`; a batch of left-padded prompts with its padding masked) and
    only the rows a PromptFeed wants are computed beside it; otherwise `CHUNK` (or the
    feed's chunk) queries at a time. When a PromptFeed is armed (a prompt from an empty
    cache), batch row 0's group-mean rows go to it while they exist; with `State.feeds` (a
    batch of left-padded prompts) each row's go to its own feed, from its padding on."""
    B, Hq, q, D = query.shape
    k = key.shape[2]
    # (batch row, its left padding, its PromptFeed): row 0's feed, or each row's (State.feeds)
    fed = [] if st is None else (st.feeds or ([] if st.feed is None else [(0, 0, st.feed)]))
    # a batch's bias is its padding only, which the fused path masks itself
    biased = st is not None and not st.freed and st.bias_t is not None and not st.feeds
    if fed:
        if k != q:
            raise ValueError("a prompt is read in one pass from an empty cache")
        for r, pad, feed in fed:
            for which, x in (("key", key), ("value", value)):
                norms = x[r, :, pad:].detach().float().norm(dim=-1)  # (Hk, k - pad)
                feed.set_norms(which, layer,
                               (norms.mean(dim=0, keepdim=True) if st.G == 1 else norms).cpu().numpy())
            if feed.rope_thetas:
                check_rope(getattr(module, "config", None), feed.rope_thetas)
                feed.rope_thetas = []
            if feed.vectors:  # the prompt's keys and queries, after RoPE, as they are
                feed.set_vectors(layer, key[r, :, pad:].detach().float().cpu().numpy(),
                                 query[r, :, pad:].detach().float().cpu().numpy())
    if k == q and not softcap and not window and not biased:
        out = fused_prompt(query, key, value, scaling, st.pad[:B] if st is not None and st.feeds else None)
        for r, pad, feed in fed:  # a padded row's queries and keys start at its padding
            for a, b in feed.blocks():
                w = _weights(query[r:r + 1, :, pad + a:pad + b], key[r:r + 1, :, pad:pad + b], scaling, a)
                _feed_rows(feed, st, layer, a, w)
            feed.layer_read(layer)
        return out
    return _blocked(st, layer, query, key, value, scaling, softcap, window, fed)


def fused_prompt(query, key, value, scaling, pads=None):
    """A prompt's causal attention from an empty cache by PyTorch's fused kernel (sdpa, each
    query head reading its group's KV head): (B, q, Hq, D), as the model's own sdpa gives it.
    `pads` (B,): each row's left padding, whose keys no real query reads (a padding query
    reads only itself, so that its row stays finite)."""
    import torch

    gqa = key.shape[1] != query.shape[1]
    if pads is None or not np.any(pads):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=gqa)
    else:
        i = torch.arange(query.shape[2], device=query.device)
        real = i[None, None, :] >= torch.as_tensor(np.asarray(pads), device=query.device)[:, None, None]
        mask = ((i[None, :] <= i[:, None]) & real) | (i[None, :] == i[:, None])  # (B, q, k)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None],
                                                               scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def _weights(query, key, scaling, start: int):
    """Causal attention weights (B, Hk, g, m, end) of queries start..start+m-1 on keys
    0..end-1 (an empty cache: query i is position i)."""
    import torch

    B, Hq, m, D = query.shape
    Hk, end = key.shape[1], key.shape[2]
    g = Hq // Hk
    s = torch.matmul(query.reshape(B, Hk, g * m, D), key.transpose(-1, -2)) * scaling
    s = s.view(B, Hk, g, m, end)
    later = torch.arange(end, device=s.device)[None, :] > torch.arange(start, start + m, device=s.device)[:, None]
    return torch.softmax(s.masked_fill(later, float("-inf")), dim=-1, dtype=torch.float32)


def _feed_rows(feed, st: State, layer: int, a: int, w) -> None:
    """One batch row's weights (1, Hk, g, m, end) of prompt rows a..a+m-1, group means (and
    each query head's rows when a policy reads them), to its PromptFeed."""
    _, Hk, g, m, end = w.shape
    w0 = w[0].detach().float()
    rows = w0.mean(dim=(0, 1))[None] if st.G == 1 else w0.mean(dim=1)  # (G, m, end)
    qrows = None
    if feed.query:  # (G, query heads of the stream, m, end)
        qrows = (w0.reshape(1, Hk * g, m, end) if st.G == 1 else w0).cpu().numpy()
    feed.add(layer, a, rows.cpu().numpy(), qrows)


def _blocked(st: State | None, layer: int, query, key, value, scaling, softcap, window, fed):
    """`_prompt` a block of queries at a time: softcapping, a sliding window, a bias, or
    queries after a cached past; `fed` as `_prompt` reads it ((row, padding, PromptFeed))."""
    import torch

    B, Hq, q, D = query.shape
    Hk, k = key.shape[1], key.shape[2]
    g = Hq // Hk
    past = k - q
    chunk = fed[0][2].chunk if fed else PREFILL_CHUNK
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
        for r, pad, feed in fed:  # a padded row's queries and keys start at its padding
            lo = max(a, pad)
            if lo < b and feed.wants(lo - pad, b - pad):
                _feed_rows(feed, st, layer, lo - pad, w[r:r + 1, :, :, lo - a:, pad:])
    for _, _, feed in fed:
        feed.layer_read(layer)
    return out.view(B, Hq, q, D).transpose(1, 2).contiguous()


def no_mask(batch_size=None, q_length=None, kv_length=None, *args, attention_mask=None, **kwargs):
    """The mask builder registered with the attention function: none, since the function
    masks causally itself, block by block (no (q, k) mask is built). It reads unpadded
    sequences only, so a padding mask is refused rather than ignored."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("kvviz reads unpadded sequences: attention_mask must be all ones")
    return None


def register():
    """The attention function, and `no_mask` as its mask builder (it masks causally itself)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, attention)
    AttentionMaskInterface.register(ATTN_NAME, no_mask)


@contextmanager
def attached(mdl, state=None):
    """`mdl` runs the eviction attention inside the block (one block at a time per model),
    over `state` until `use` names another lane's; its previous attention implementation
    comes back on exit, error or not."""
    with _REGISTER:
        register()
        lock = _MODEL_LOCKS.setdefault(mdl, threading.Lock())
    with lock:
        check_architecture(mdl)
        settable = interface_settable(mdl)  # Falcon's is routed instead
        previous = mdl.config._attn_implementation
        binding, mods = Binding(state), list(mdl.modules())
        for m in mods:
            m.__dict__[BOUND] = binding
        try:
            if settable:
                mdl.set_attn_implementation(ATTN_NAME)
            with routed(mdl):
                yield state
        finally:
            for m in mods:
                m.__dict__.pop(BOUND, None)
            if settable:
                mdl.set_attn_implementation(previous)


def use(mdl, state) -> None:
    """The lane `mdl`'s next forward runs (inside `attached`; None: plain attention)."""
    binding = mdl.__dict__.get(BOUND)
    if binding is None:
        raise ValueError("use: the model is not attached (run it inside kvviz.model.loop.engine.attached)")
    binding.state = state


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
