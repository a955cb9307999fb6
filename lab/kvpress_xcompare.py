"""Compare kvviz with kvpress's attention-scored presses (what lab/kvpress_attn.py recorded).

Run with kvviz's venv, after lab/kvpress_attn.py has written its JSON (lab/kvpress_xcheck.sh
runs both):

    HF_HUB_OFFLINE=1 .venv/bin/python -m lab.kvpress_xcompare --kvpress OUT/kvpress_attn.json \
        --out OUT [--write]

On the same token ids, kvviz reads the prompt in prefill mode at KV-head granularity
(kvviz.model.loop.generate) under adakv:scorer=snapkv and snapkv with kvpress's window (64
observed rows, the 64 newest positions protected), kernel 5, average pooling and alpha 0.20,
and under expected-attention when the registry has it. For every (layer, KV head) the kept
positions are compared with kvpress's: cells identical, Jaccard per cell (mean and least).

Where the two rules differ, a ladder of numpy re-statements on one eager forward of kvviz's
model (its per-query-head attention, pre-RoPE queries, keys and values) moves from kvpress's
rule to kvviz's one difference at a time; each rung is compared with both sides, so each
difference's share of the disagreement is measured, and the first and last rungs check that
the rules are stated right (they must reproduce kvpress's and kvviz's kept sets). kvviz's own
allocation code (kvviz.core.policies.alloc.shared_victims) is also run on kvpress's recorded
scores: where the scores are the same, the allocations must be too.

Writes OUT/kvpress_xcheck.json; with --write also docs/studies/loop_kvpress_attn.json and the
figures block of docs/studies/loop_kvpress_attn.md (rendered from that JSON by `render`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "docs/studies/loop_kvpress_attn.json"
PAGE = ROOT / "docs/studies/loop_kvpress_attn.md"
BEGIN, END = "<!-- figures: begin (rendered from loop_kvpress_attn.json) -->", "<!-- figures: end -->"
COMMAND = "./lab/kvpress_xcheck.sh /tmp/kvpress-xcheck --write"


# -- kept sets and their agreement (no model) ----------------------------------------------
def cells(kept: dict) -> dict:
    """{"layer,head": [positions]} or {(layer, head): ...} -> {(layer, head): frozenset}."""
    out = {}
    for k, v in kept.items():
        key = tuple(int(x) for x in k.split(",")) if isinstance(k, str) else tuple(int(x) for x in k)
        out[key] = frozenset(int(p) for p in v)
    return out


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a & b| / |a | b|; two empty sets agree (1.0)."""
    union = len(a | b)
    return 1.0 if union == 0 else len(a & b) / union


def agreement(a: dict, b: dict) -> dict:
    """How far two kept maps agree, cell by cell (both must have the same cells)."""
    a, b = cells(a), cells(b)
    if set(a) != set(b):
        raise ValueError(f"kept maps cover different (layer, head) cells: {sorted(set(a) ^ set(b))[:4]}")
    keys = sorted(a)
    jac = [jaccard(a[k], b[k]) for k in keys]
    worst = int(np.argmin(jac)) if keys else 0
    return {"cells": len(keys), "same_cells": sum(a[k] == b[k] for k in keys),
            "same_counts": sum(len(a[k]) == len(b[k]) for k in keys),
            "jaccard_mean": float(np.mean(jac)) if keys else 1.0,
            "jaccard_min": float(min(jac)) if keys else 1.0,
            "least_cell": f"{keys[worst][0]},{keys[worst][1]}" if keys else None,
            "kept_a": sum(len(a[k]) for k in keys), "kept_b": sum(len(b[k]) for k in keys),
            "only_first": sum(len(a[k] - b[k]) for k in keys), "only_second": sum(len(b[k] - a[k]) for k in keys)}


def as_kept(masks: np.ndarray) -> dict:
    """bool (L, G, T) -> {(layer, head): positions kept}."""
    L, G, _ = masks.shape
    return {(i, g): np.flatnonzero(masks[i, g]).tolist() for i in range(L) for g in range(G)}


# -- the allocation rules (no model) -------------------------------------------------------
def topk_keep(scores: np.ndarray, n_kept: int) -> np.ndarray:
    """A ScorerPress alone: per head its n_kept highest scores (ties to the lower position).
    scores (G, T) -> bool (G, T)."""
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :n_kept]
    keep = np.zeros(scores.shape, bool)
    np.put_along_axis(keep, order, True, axis=-1)
    return keep


def kvpress_adakv_keep(scores: np.ndarray, n_kept: int, alpha: float) -> np.ndarray:
    """AdaKVPress (kvpress 0.5.5): each head's top n_safe = max(1, int(n_kept x alpha)) forced
    in, then the layer's heads x (T - n_kept) lowest scores, flattened over heads, masked.
    scores (G, T) -> bool (G, T) kept."""
    G, T = scores.shape
    s = scores.astype(np.float64).copy()
    n_safe = max(1, int(n_kept * alpha)) if alpha > 0 and n_kept > 0 else 0
    top = np.argsort(-s, axis=-1, kind="stable")[:, :n_safe]
    np.put_along_axis(s, top, np.inf, axis=-1)
    flat = np.argsort(s.ravel(), kind="stable")[: G * (T - n_kept)]
    keep = np.ones(G * T, bool)
    keep[flat] = False
    return keep.reshape(G, T)


class _Stream:
    """One head as kvviz's shared_victims sees a scorer: held, candidates and priority."""

    def __init__(self, priority: np.ndarray, protected: int):
        self._p = np.asarray(priority, np.float64)
        self._c = np.arange(len(priority)) < len(priority) - protected

    def held(self):
        return np.arange(len(self._p))

    def candidates(self):
        return self._c

    def priority(self):
        return self._p


def kvviz_adakv_keep(priority: np.ndarray, budget: int, alpha: float, protected: int) -> np.ndarray:
    """kvviz's AdaKV choice, through kvviz's own code (alloc.shared_victims): the heads share
    heads x budget slots; the lowest priority across heads goes, no head below
    floor(alpha x budget), the `protected` newest positions never. (G, T) -> bool (G, T)."""
    from kvviz.core.policies.alloc import alpha_floor, shared_victims

    G, T = priority.shape
    victims = shared_victims([_Stream(priority[g], protected) for g in range(G)], G * budget,
                             alpha_floor(alpha, budget))
    keep = np.ones((G, T), bool)
    for g, v in enumerate(victims):
        keep[g, v] = False
    return keep


def kvviz_single_keep(priority: np.ndarray, budget: int, protected: int) -> np.ndarray:
    """A per-head scorer alone, kvviz's rule: the lowest priority outside the protected
    tail goes (ties to the lower position) until the head holds `budget`."""
    G, T = priority.shape
    keep = np.ones((G, T), bool)
    for g in range(G):
        cand = np.arange(T - protected)
        order = cand[np.argsort(priority[g, cand], kind="stable")]
        keep[g, order[: T - budget]] = False
    return keep


# -- the SnapKV scoring rules (no model) ---------------------------------------------------
def kvpress_pool(x: np.ndarray, kernel: int) -> np.ndarray:
    """torch's avg_pool1d(kernel, stride 1, padding kernel // 2): zeros padded and counted,
    every window divided by `kernel`."""
    r = kernel // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(r, r)])
    n = x.shape[-1]
    return sum(padded[..., d:d + n] for d in range(kernel)) / kernel


def snapkv_scores(attn: np.ndarray, groups: int, window: int, kernel: int, *, rows: str = "kvpress",
                  pooling: str = "kvpress") -> np.ndarray:
    """One layer's SnapKV scores (G, T) from its query heads' last `window` rows.

    attn (H, window, T): query T - window + i's softmax weights over positions 0..T-1.
    rows "kvpress": each query head's raw weights averaged over the window, then averaged
      over its GQA group; "kvviz": each group's mean row renormalised over the positions
      before its query (kvviz.core.harness.renormalise), summed over the window.
    pooling "kvpress": avg_pool1d over positions 0..T-window-1 only, zero padded, each
      window divided by the kernel; the window's own positions scored max + 1.
      "kvviz": kvviz.core.policies.snapkv.pool (avg) over every position, each window
      clamped to the positions that exist and divided by its size; the last `window`
      positions are protected by the caller (scored +inf here).
    """
    from kvviz.core.harness import renormalise
    from kvviz.core.policies.snapkv import pool

    H, W, T = attn.shape
    per = H // groups
    grouped = attn.astype(np.float64).reshape(groups, per, W, T).mean(axis=1)  # (G, W, T)
    if rows == "kvpress":
        s = grouped.mean(axis=1)
    elif rows == "kvviz":
        s = np.zeros((groups, T))
        for i in range(W):
            t = T - W + i
            s[:, :t] += renormalise(grouped[:, i, :t].astype(np.float32), t).astype(np.float64)
    else:
        raise ValueError(f"rows must be 'kvpress' or 'kvviz', got {rows!r}")
    if pooling == "kvpress":
        out = kvpress_pool(s[:, : T - W], kernel)
        return np.concatenate([out, np.full((groups, W), out.max() + 1)], axis=1)
    if pooling == "kvviz":
        out = pool(s, (kernel - 1) // 2, "avg")
        out[:, T - W:] = np.inf
        return out
    raise ValueError(f"pooling must be 'kvpress' or 'kvviz', got {pooling!r}")


# -- Expected Attention, kvpress's rule restated (no model) --------------------------------
def expected_attention_scores(q_pre: np.ndarray, keys: np.ndarray, values: np.ndarray, cos: np.ndarray,
                              sin: np.ndarray, *, n_sink: int = 4, use_covariance: bool = True,
                              use_vnorm: bool = True, epsilon: float = 0.0) -> np.ndarray:
    """ExpectedAttentionPress.score for one layer, float64.

    q_pre (H, T, d) the prompt's queries before RoPE; keys (G, T, d) after RoPE; values (G, T, d);
    cos, sin (n_future, d) the RoPE tables of positions T..T+n_future-1. The queries after the
    first n_sink give a mean and covariance (divided by their count); both are rotated by R,
    the mean over the future positions of cos I + sin P (P: RoPE's rotate-half as a matrix);
    each key's score is softmax over the non-sink keys of mu.k / sqrt(d) + k' cov k / (2d),
    averaged over the GQA group, times ||v||; the sinks get max + 1. Returns (G, T)."""
    H, T, d = q_pre.shape
    G = keys.shape[0]
    q = q_pre[:, n_sink:].astype(np.float64)
    mu = q.mean(axis=1)  # (H, d)
    c = q - mu[:, None]
    cov = np.einsum("hsi,hsj->hij", c, c) / q.shape[1]
    P = np.zeros((d, d))
    P[d // 2:, : d // 2], P[: d // 2, d // 2:] = np.eye(d // 2), -np.eye(d // 2)
    R = (cos.astype(np.float64)[:, :, None] * np.eye(d) + sin.astype(np.float64)[:, :, None] * P).mean(axis=0)
    mu = mu @ R.T
    cov = R @ cov @ R.T
    k = np.repeat(keys[:, n_sink:].astype(np.float64), H // G, axis=0)  # (H, n, d)
    logits = np.einsum("hd,hnd->hn", mu, k) / math.sqrt(d)
    if use_covariance:
        logits += np.einsum("hni,hij,hnj->hn", k, cov, k) / d / 2
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    s = (e / e.sum(axis=1, keepdims=True)).reshape(G, H // G, -1).mean(axis=1)
    if use_vnorm:
        s = (s + epsilon) * np.linalg.norm(values[:, n_sink:].astype(np.float64), axis=-1)
    return np.concatenate([np.full((G, n_sink), s.max() + 1), s], axis=1)


def score_gap(a: np.ndarray, b: np.ndarray) -> float:
    """The largest |a - b| relative to the largest |b|, over finite entries."""
    ok = np.isfinite(a) & np.isfinite(b)
    return float(np.abs(a[ok] - b[ok]).max() / np.abs(b[ok]).max())


# -- the page (no model) -------------------------------------------------------------------
def _agree_cells(a: dict) -> str:
    return (f"{a['same_cells']} / {a['cells']} | {a['jaccard_mean']:.4f} | {a['jaccard_min']:.4f} "
            f"({a['least_cell']}) | {a['only_first']} / {a['only_second']}")


def render(res: dict) -> str:
    """The figures block of docs/studies/loop_kvpress_attn.md, from the result file alone."""
    lines = [BEGIN, "",
             f"Measured {res['date']} with `{res['command']}` (kvpress {res['kvpress_version']}, transformers "
             f"{res['kvpress_transformers']} in its venv; kvviz with transformers {res['kvviz_transformers']}). "
             f"Text: BOS and the first {res['T'] - 1} tokens of `{res['text']}`, kvpress's token ids read by "
             f"both sides (kvpress's tokenizer adds the BOS, kvviz's does not; otherwise the same ids: "
             f"{'yes' if res['ids_are_kvviz_tokens_after_bos'] else 'NO'}); {res['budget']} positions kept per KV head "
             f"({res['layers']} layers x {res['kv_heads']} KV heads = {res['layers'] * res['kv_heads']} cells); "
             f"SnapKV window {res['window']}, kernel {res['kernel']}; AdaKV alpha {res['alpha']}.", "",
             "| comparison (first vs second) | cells identical | mean Jaccard | least Jaccard (layer,head) "
             "| positions kept by the first only / the second only |",
             "|---|---:|---:|---:|---:|"]
    for name, block in res["comparisons"].items():
        for row in block["rows"]:
            lines.append(f"| {name}: {row['what']} | {_agree_cells(row['agreement'])} |")
    lines += ["", "Score checks (largest difference relative to the largest score):", ""]
    for name, block in res["comparisons"].items():
        for what, v in block.get("score_gaps", {}).items():
            lines.append(f"- {name}: {what}: {v:.1e}")
    dec = res.get("decode")
    if dec:
        lines += ["", f"Decode: `{dec['press']}` after a {dec['prompt']}-token prompt, {dec['steps']} tokens "
                      f"teacher forced: {dec['compressions']} compressions; " + dec["summary"]]
    lines += ["", END]
    return "\n".join(lines)


def page_block(text: str) -> str:
    """The figures block as it stands in the page (markers included)."""
    a, b = text.index(BEGIN), text.index(END)
    return text[a:b + len(END)]


def write_page(res: dict, page: Path = PAGE) -> None:
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace(page_block(text), render(res)), encoding="utf-8")


# -- kvviz's side (the model) --------------------------------------------------------------
def model_inputs(pair, ids: list[int], window: int, n_future: int, starts=()) -> dict:
    """One eager forward of kvviz's model over ids: per layer the last `window` rows of each
    query head's weights (H, window, T), the pre-RoPE queries (H, T, d), the cache's keys and
    values (G, T, d), and the RoPE tables of positions s..s+n_future-1 for s = T and each of
    `starts` ({s: (cos, sin)})."""
    import torch

    tok, mdl = pair
    qs = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda m, i, o, k=k: qs.__setitem__(k, o.detach())) for k, layer in enumerate(mdl.model.layers)]
    T = len(ids)
    try:
        with torch.no_grad():
            out = mdl(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    H, d = mdl.config.num_attention_heads, mdl.config.hidden_size // mdl.config.num_attention_heads
    d = getattr(mdl.config, "head_dim", None) or d
    cos0, sin0 = mdl.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(T)[None])
    cos0, sin0 = cos0[0][None], sin0[0][None]  # (1, T, d), broadcast over the query heads
    q_post = []
    for i in range(len(qs)):
        q = qs[i][0].view(T, H, d).transpose(0, 1)
        q_post.append((q * cos0 + torch.cat([-q[..., d // 2:], q[..., : d // 2]], dim=-1) * sin0).numpy())
    rope = {}
    for s in {T, *starts}:
        cos, sin = mdl.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(s, s + n_future)[None])
        rope[s] = (cos[0].numpy(), sin[0].numpy())
    cache = out.past_key_values
    return {"attn": [a[0, :, T - window:, :].numpy() for a in out.attentions],
            "q_pre": [qs[i][0].view(T, H, d).transpose(0, 1).numpy() for i in range(len(qs))],
            "keys": [cache.layers[i].keys[0].numpy() for i in range(len(qs))],
            "values": [cache.layers[i].values[0].numpy() for i in range(len(qs))],
            "q_post": q_post, "rope": rope, "rope_theta": rope_theta(mdl.config)}


def rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    return float(theta if theta is not None else (config.rope_parameters or {})["rope_theta"])


def kvviz_expected_attention(x: dict, budget: int, params: dict, alpha: float | None = None,
                             length: int | None = None) -> dict:
    """kvviz's `expected-attention` policy (kvviz.core), one per (layer, KV head), fed every
    prompt row through kvviz.core.harness (the query vectors of the KV head's query heads after
    RoPE, the held keys, the value norms) and evicting once at the last row, as the model loop's
    prefill mode does; `length` rows of the prompt (default: all). With `alpha`, the heads of
    a layer share heads x budget instead: each head's priority after the last row, chosen by
    kvviz's AdaKV code (shared_victims).
    Returns {(layer, head): kept positions}."""
    from kvviz.core import harness
    from kvviz.core.policies import make_policy

    L, (G, T, _) = len(x["keys"]), x["keys"][0].shape
    T = length or T
    H = x["q_post"][0].shape[0]
    out = {}
    for i in range(L):
        vnorm = np.linalg.norm(x["values"][i].astype(np.float64), axis=-1).astype(np.float32)
        prio = []
        for g in range(G):
            pol = make_policy("expected-attention", budget=budget, rope_theta=x["rope_theta"], **params)
            heads = slice(g * H // G, (g + 1) * H // G)
            for t in range(T):
                keys = x["keys"][i][g][harness.keys_at(pol.held(), t)]
                args = dict(value_norm=vnorm[g, t], keys=keys, query=x["q_post"][i][heads, t])
                if t < T - 1 or alpha is not None:
                    harness.feed(pol, t, None, **args)
                else:
                    harness.step(pol, t, None, budget, **args)
            if alpha is None:
                out[(i, g)] = pol.held().tolist()
            else:
                prio.append(np.asarray(pol.priority(), np.float64))
        if alpha is not None:
            keep = kvviz_adakv_keep(np.stack(prio), budget, alpha, 0)
            out.update({(i, g): np.flatnonzero(keep[g]).tolist() for g in range(G)})
    return out


def kvviz_kept(pair, ids, configs) -> dict:
    """{label: {(layer, head): positions}} after kvviz reads ids in prefill mode, kv-head."""
    from kvviz.model.loop import generate

    g = generate(list(ids), configs, 1, granularity="kv-head", prompt_mode="prefill", model=pair)
    return {cfg.label: as_kept(g.held(c, g.prompt_len - 1)) for c, cfg in enumerate(g.configs) if not cfg.is_full}


def per_layer(fn, L: int) -> dict:
    """Stack a per-layer (G, T) bool into {(layer, head): positions}."""
    return as_kept(np.stack([fn(i) for i in range(L)]))


def compare(kv: dict, pair=None, log=print) -> dict:
    from kvviz.core.policies import POLICIES
    from kvviz.model.loop import LoopConfig
    from kvviz.model.models import load_model

    pair = pair or load_model(None, "generate")
    ids, B, W, K, alpha = kv["ids"], kv["budget"], kv["window"], kv["kernel"], kv["alpha"]
    T = len(ids)
    snap = {"obs_window": W, "recent_window": W, "pool_kernel": K, "pooling": "avg"}
    configs = [LoopConfig("adakv", {"scorer": "snapkv", "alpha": alpha, **snap}, B),
               LoopConfig("snapkv", snap, B)]
    ea = kv["expected_attention_params"]
    has_ea = "expected-attention" in POLICIES
    log(f"[xcheck] kvviz prefill over {T} tokens: {[c.label for c in configs]}")
    mine = kvviz_kept(pair, ids, configs)
    labels = [c.label for c in configs]
    dec = kv.get("decode") or {}
    first = (dec.get("events") or [None])[0]
    cut = first["step"] + 1 if first else None  # positions 0..cut-1 in the cache at the first cut
    starts = (dec["interval"], cut) if first else ()
    x = model_inputs(pair, ids, W, ea["n_future_positions"], starts)
    L, G = len(x["keys"]), x["keys"][0].shape[0]
    P = kv["presses"]
    theirs = {name: cells(P[name]["kept"]) for name in P}
    kv_scores = {name: [np.asarray(s, np.float64) for s in P[name]["scores"]] for name in P}
    out = {}

    def ladder(kind: str):
        alloc = (lambda s: kvpress_adakv_keep(s, B, alpha)) if kind == "adakv" else (lambda s: topk_keep(s, B))
        mine_alloc = ((lambda s: kvviz_adakv_keep(s, B, alpha, W)) if kind == "adakv"
                      else (lambda s: kvviz_single_keep(s, B, W)))
        press = "adakv_snapkv" if kind == "adakv" else "snapkv"
        label = labels[0] if kind == "adakv" else labels[1]
        sc = {(r, p): [snapkv_scores(x["attn"][i], G, W, K, rows=r, pooling=p) for i in range(L)]
              for r in ("kvpress", "kvviz") for p in ("kvpress", "kvviz")}
        rungs = [
            ("kvpress's rule restated on kvviz's model", alloc, ("kvpress", "kvpress")),
            ("kvpress's rule with kvviz's pooling swapped in", alloc, ("kvpress", "kvviz")),
            ("kvpress's rule with kvviz's rows swapped in (group mean, renormalised over earlier positions)",
             alloc, ("kvviz", "kvpress")),
            ("kvviz's rows and pooling with kvpress's allocation", alloc, ("kvviz", "kvviz")),
            ("kvviz's rule restated (rows, pooling, allocation)", mine_alloc, ("kvviz", "kvviz")),
        ]
        rows = [{"what": f"kvviz `{label}` vs kvpress", "agreement": agreement(mine[label], theirs[press])},
                {"what": ("kvviz's allocation code" if kind == "adakv" else "kvviz's per-head choice (restated)")
                 + " on kvpress's recorded scores vs kvpress",
                 "agreement": agreement(as_kept(np.stack([mine_alloc(s) for s in kv_scores[press]])),
                                        theirs[press])}]
        for what, fn, key in rungs:
            kept = as_kept(np.stack([fn(sc[key][i]) for i in range(L)]))
            rows.append({"what": f"{what} vs kvpress", "agreement": agreement(kept, theirs[press])})
            rows.append({"what": f"{what} vs kvviz", "agreement": agreement(kept, mine[label])})
        gaps = {"kvpress's rule on kvviz's model vs kvpress's recorded scores":
                max(score_gap(sc[("kvpress", "kvpress")][i], kv_scores[press][i]) for i in range(L))}
        return {"press": press, "kvviz": label, "rows": rows, "score_gaps": gaps}

    out["AdaKV(SnapKV)"] = ladder("adakv")
    out["SnapKV"] = ladder("single")
    ea_scores = [expected_attention_scores(x["q_pre"][i], x["keys"][i], x["values"][i], *x["rope"][T],
                                           n_sink=ea["n_sink"], use_covariance=ea["use_covariance"],
                                           use_vnorm=ea["use_vnorm"], epsilon=ea["epsilon"]) for i in range(L)]
    for name, press, alloc in (("Expected Attention", "expected_attention", lambda s: topk_keep(s, B)),
                               ("AdaKV(Expected Attention)", "adakv_expected_attention",
                                lambda s: kvpress_adakv_keep(s, B, alpha))):
        rows = [{"what": "kvpress's rule restated on kvviz's model (numpy, float64) vs kvpress",
                 "agreement": agreement(as_kept(np.stack([alloc(s) for s in ea_scores])), theirs[press])}]
        if press == "adakv_expected_attention":
            rows.append({"what": "kvviz's allocation code on kvpress's recorded scores vs kvpress",
                         "agreement": agreement(as_kept(np.stack([kvviz_adakv_keep(s, B, alpha, 0)
                                                                  for s in kv_scores[press]])), theirs[press])})
        spec = None
        if has_ea:
            # kvpress's prefill takes the statistics over every query after the sinks: a
            # query_window of T; kvviz's default keeps the last 256
            alpha_ = alpha if press == "adakv_expected_attention" else None
            spec = ",".join(f"{k}={v}" for k, v in ea.items())
            spec = (f"adakv:scorer=expected-attention,alpha={alpha}," if alpha_ is not None
                    else "expected-attention:") + spec
            for qw in (T, 256):
                log(f"[xcheck] kvviz {spec},query_window={qw} through kvviz.core.harness")
                got = kvviz_expected_attention(x, B, {**ea, "query_window": qw}, alpha_)
                rows.insert(len(rows) - (1 if alpha_ is not None else 0) if qw == 256 else 0,
                            {"what": f"kvviz `{spec},query_window={qw}` vs kvpress",
                             "agreement": agreement(got, theirs[press])})
        out[name] = {"press": press, "kvviz": spec, "rows": rows,
                     "score_gaps": {"kvpress's rule on kvviz's model vs kvpress's recorded scores":
                                    max(score_gap(ea_scores[i], kv_scores[press][i]) for i in range(L))}}
    if first:
        # DecodingPress buffers the hidden states of the decoded tokens since its last cut and
        # hands them to ExpectedAttentionPress.score, which takes their count as q_len
        P = dec["prompt"]
        theirs_cut = cells(first["kept"])

        def cut_keep(start):
            return per_layer(lambda i: topk_keep(expected_attention_scores(
                x["q_pre"][i][:, P:cut], x["keys"][i][:, :cut], x["values"][i][:, :cut], *x["rope"][start],
                n_sink=ea["n_sink"], use_covariance=ea["use_covariance"], use_vnorm=ea["use_vnorm"],
                epsilon=ea["epsilon"]), dec["target"]), L)
        by_sequence = cut_keep(cut)
        rows = [
            {"what": f"kvpress's rule restated, queries of positions {P}..{cut - 1} (the buffer), RoPE averaged "
                     f"over positions {dec['interval']}..{dec['interval'] + ea['n_future_positions'] - 1} "
                     f"(the buffer's length onward) vs kvpress",
             "agreement": agreement(cut_keep(dec["interval"]), theirs_cut)},
            {"what": f"the same, RoPE averaged over positions {cut}..{cut + ea['n_future_positions'] - 1} "
                     f"(the sequence's length onward) vs kvpress",
             "agreement": agreement(by_sequence, theirs_cut)}]
        spec = None
        if has_ea:
            # the buffer's queries after its first n_sink: the last cut - P - n_sink queries
            qw = cut - P - ea["n_sink"]
            spec = "expected-attention:" + ",".join(f"{k}={v}" for k, v in ea.items()) + f",query_window={qw}"
            log(f"[xcheck] kvviz {spec} over positions 0..{cut - 1}, cut to {dec['target']} at the last")
            got = kvviz_expected_attention(x, dec["target"], {**ea, "query_window": qw}, length=cut)
            rows += [{"what": f"kvviz `{spec}`, positions 0..{cut - 1} cut once at the last, vs kvpress",
                      "agreement": agreement(got, theirs_cut)},
                     {"what": "the same kvviz run vs kvpress's rule restated with the sequence's positions",
                      "agreement": agreement(got, by_sequence)}]
        out["Expected Attention, decoding (first cut)"] = {"press": "decode", "kvviz": spec, "rows": rows}
    return out, L, G


def decode_summary(dec: dict) -> dict | None:
    """What kvpress's DecodingPress(ExpectedAttentionPress) did: when it cut, to how many."""
    if not dec:
        return None
    ev = dec["events"]
    sizes = sorted({len(v) for e in ev for v in e["kept"].values()})
    sinks = all(set(range(4)) <= set(v) for e in ev for v in e["kept"].values())
    steps = [e["step"] for e in ev]
    return {"press": dec["press"], "prompt": dec["prompt"], "steps": dec["steps"], "compressions": len(ev),
            "summary": f"cuts at steps {steps} (every {dec['interval']} decoded tokens), each (layer, KV head) "
                       f"cut to {sizes} positions, the first 4 positions kept at every cut: "
                       f"{'yes' if sinks else 'no'}."}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpress", required=True, help="the JSON lab/kvpress_attn.py wrote")
    ap.add_argument("--out", required=True, help="folder for kvpress_xcheck.json")
    ap.add_argument("--write", action="store_true",
                    help="also write docs/studies/loop_kvpress_attn.json and the page's figures")
    a = ap.parse_args(argv)
    import transformers

    from kvviz.model.models import load_model

    kv = json.loads(Path(a.kvpress).read_text(encoding="utf-8"))
    pair = load_model(None, "generate")
    from kvviz.model.models import tokenize

    text = ROOT / "traces/sources" / kv["text"]
    own = tokenize(pair[0], text.read_text(encoding="utf-8"), kv["T"] - 1)[0]
    bos_only = [kv["ids"][0]] + own == list(kv["ids"])  # kvpress's tokenizer adds BOS, kvviz's does not
    comparisons, L, G = compare(kv, pair, log=lambda s: print(s, file=sys.stderr))
    res = {"date": datetime.date.today().isoformat(), "command": COMMAND,
           "kvpress_version": kv["kvpress_version"], "kvpress_transformers": kv["transformers_version"],
           "kvviz_transformers": transformers.__version__, "text": f"traces/sources/{kv['text']}", "T": kv["T"],
           "ids_are_kvviz_tokens_after_bos": bool(bos_only), "budget": kv["budget"], "window": kv["window"],
           "kernel": kv["kernel"], "alpha": kv["alpha"], "layers": L, "kv_heads": G,
           "expected_attention_params": kv["expected_attention_params"],
           "comparisons": comparisons, "decode": decode_summary(kv.get("decode"))}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kvpress_xcheck.json").write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    print(render(res))
    if a.write:
        RESULT.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        write_page(res)
        print(f"wrote {RESULT.relative_to(ROOT)} and {PAGE.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
