"""Record what kvpress's attention-scored presses keep on SmolLM2-135M: AdaKVPress(SnapKVPress),
SnapKVPress, ExpectedAttentionPress and AdaKVPress(ExpectedAttentionPress) after a prefill, and
DecodingPress(ExpectedAttentionPress) while it decodes.

Run with the kvpress venv (lab/kvpress_venv.sh), not kvviz's: kvpress 0.5.5 pins
transformers<5.3. Nothing here imports kvviz. lab/kvpress_xcheck.sh runs it, then
lab/kvpress_xcompare.py (kvviz's side) on what it wrote.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 /work/venv-kvpress/bin/python lab/kvpress_attn.py \
        --text traces/sources/execmodel.txt --tokens 512 --budget 128 --out /tmp/kvpress_attn.json

Prefill: the text's first `--tokens` tokens (BOS first) read in one forward pass (sdpa:
AdaKVPress refuses eager attention) with a press active. kvpress takes a compression ratio,
not a budget: the ratio 1 - (budget + 0.5) / T gives exactly `--budget` kept positions per
KV head (compute_n_kept, asserted). For each press the score tensor its scorer returned
(copied before AdaKVPress overwrites its top n_safe in place) and the kept positions per
(layer, KV head):
- AdaKVPress masks instead of pruning: head h keeps every position not in the layer's
  `masked_key_indices` for h;
- a ScorerPress alone keeps `scores.topk(n_kept)` (recomputed from the same score tensor).

Decode: the first `--decode-prompt` tokens are read with no press (DecodingPress skips a
prefill), then the next `--decode-steps` tokens one per forward call, teacher forced, under
DecodingPress(ExpectedAttentionPress(), compression_interval=I, target_size=B). After every
compression the positions each KV head holds are recovered by matching that head's kept keys,
bit for bit (`gather` copies), against the keys in its cache before the step.

Output JSON: ids, budget, window, compression_ratio, per press name {"kept": {"layer,head":
[positions]}, "scores": [[[float per position] per head] per layer]}, and "decode" {prompt,
steps, interval, target, "events": [{"step", "kept": {"layer,head": [positions]}}]}.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, run the same way in kvpress's venv
from kvpress_alloc import load_model, prefill  # noqa: E402  (sets the offline variables too)


def recording(scorer_cls, scores: dict, **kw):
    """`scorer_cls(**kw)` whose `score` keeps a copy of each layer's scores (layer -> (G, T))."""

    class Recording(scorer_cls):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            s = super().score(module, hidden_states, keys, values, attentions, kwargs)
            scores[module.layer_idx] = s[0].detach().clone()
            return s

    Recording.__name__ = f"Recording{scorer_cls.__name__}"
    return Recording(**kw)


def run_scorer(model, ids, scorer_cls, n_kept: int, **kw) -> dict:
    """A ScorerPress alone: kept = its scores' top n_kept per head."""
    scores = {}
    prefill(model, ids, recording(scorer_cls, scores, **kw))
    kept = {}
    for i, s in sorted(scores.items()):
        for g, row in enumerate(s.topk(n_kept, dim=-1).indices.tolist()):
            kept[f"{i},{g}"] = sorted(row)
    return {"kept": kept, "scores": [scores[i].tolist() for i in sorted(scores)]}


def run_adakv(model, ids, scorer_cls, alpha: float, **kw) -> dict:
    """AdaKVPress over a ScorerPress: kept = what its masked_key_indices leave."""
    from kvpress import AdaKVPress

    scores, masked = {}, {}

    class RecordingAdaKV(AdaKVPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            out = super().compress(module, hidden_states, keys, values, attentions, kwargs)
            _, h, s = module.masked_key_indices
            masked[module.layer_idx] = (h.tolist(), s.tolist(), keys.shape[1], keys.shape[2])
            return out

    prefill(model, ids, RecordingAdaKV(recording(scorer_cls, scores, **kw), alpha_safeguard=alpha))
    kept = {}
    for i, (hs, ss, G, k_len) in sorted(masked.items()):
        gone = [set() for _ in range(G)]
        for h, s in zip(hs, ss):
            gone[h].add(s)
        for g in range(G):
            kept[f"{i},{g}"] = [p for p in range(k_len) if p not in gone[g]]
    return {"kept": kept, "scores": [scores[i].tolist() for i in sorted(scores)], "alpha_safeguard": alpha}


def head_rows(layer) -> list[list[bytes]]:
    """Per KV head, one hashable row per cache slot: that slot's key."""
    k = layer.keys[0].float().numpy()  # (G, n, d)
    return [[k[g, i].tobytes() for i in range(k.shape[1])] for g in range(k.shape[0])]


def run_decode(model, ids, prompt: int, steps: int, interval: int, target: int, buffer: int) -> dict:
    """DecodingPress(ExpectedAttentionPress) over ids[prompt:prompt+steps], one token per call."""
    import torch
    from kvpress import DecodingPress, ExpectedAttentionPress
    from transformers import DynamicCache

    L = model.config.num_hidden_layers
    G = model.config.num_key_value_heads
    press = DecodingPress(ExpectedAttentionPress(), compression_interval=interval, target_size=target,
                          hidden_states_buffer_size=buffer)
    cache = DynamicCache(config=model.config)
    pos = [[list(range(prompt)) for _ in range(G)] for _ in range(L)]  # per head, cache order
    events = []
    start = time.perf_counter()
    with torch.no_grad(), press(model):
        model(input_ids=torch.tensor([ids[:prompt]]), past_key_values=cache, use_cache=True)
        for t in range(prompt, prompt + steps):
            before = [[dict(zip(r, p)) for r, p in zip(head_rows(cache.layers[i]), pos[i])] for i in range(L)]
            model(input_ids=torch.tensor([[ids[t]]]), past_key_values=cache,
                  position_ids=torch.tensor([[t]]), cache_position=torch.tensor([t]), use_cache=True)
            cut = False
            for i in range(L):
                rows = head_rows(cache.layers[i])
                for g in range(G):
                    new = [before[i][g].get(r, t) for r in rows[g]]
                    if len(set(new)) != len(new) or new.count(t) > 1:
                        raise RuntimeError(f"step {t} layer {i} head {g}: key matching failed")
                    cut = cut or len(new) < len(pos[i][g]) + 1
                    pos[i][g] = new
            if cut:
                events.append({"step": t, "kept": {f"{i},{g}": sorted(pos[i][g])
                                                   for i in range(L) for g in range(G)}})
            if (t - prompt) % 32 == 0:
                print(f"  decode {t - prompt + 1}/{steps} ({time.perf_counter() - start:.0f} s)",
                      file=sys.stderr, flush=True)
    return {"prompt": prompt, "steps": steps, "interval": interval, "target": target, "buffer": buffer,
            "press": f"DecodingPress(ExpectedAttentionPress(), compression_interval={interval}, "
                     f"target_size={target}, hidden_states_buffer_size={buffer})",
            "events": events, "seconds": round(time.perf_counter() - start, 1)}


def main(argv=None) -> int:
    import torch
    from kvpress import ExpectedAttentionPress, SnapKVPress
    from kvpress.utils import compute_n_kept

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--window", type=int, default=64, help="SnapKVPress window_size")
    ap.add_argument("--kernel", type=int, default=5, help="SnapKVPress kernel_size")
    ap.add_argument("--alpha", type=float, default=0.20, help="AdaKVPress alpha_safeguard")
    ap.add_argument("--decode-prompt", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=96)
    ap.add_argument("--decode-interval", type=int, default=32)
    ap.add_argument("--decode-target", type=int, default=128)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("KVVIZ_THREADS", "1")))
    tok, model = load_model("sdpa")
    ids = tok(Path(a.text).read_text(encoding="utf-8"))["input_ids"][: a.tokens]
    T = len(ids)
    ratio = 1 - (a.budget + 0.5) / T  # int(T x (1 - ratio)) = budget, clear of float truncation
    assert compute_n_kept(T, ratio) == a.budget, (compute_n_kept(T, ratio), a.budget)
    snap = {"compression_ratio": ratio, "window_size": a.window, "kernel_size": a.kernel}
    t0 = time.perf_counter()
    presses = {
        "adakv_snapkv": run_adakv(model, ids, SnapKVPress, a.alpha, **snap),
        "snapkv": run_scorer(model, ids, SnapKVPress, a.budget, **snap),
        "expected_attention": run_scorer(model, ids, ExpectedAttentionPress, a.budget, compression_ratio=ratio),
        "adakv_expected_attention": run_adakv(model, ids, ExpectedAttentionPress, a.alpha,
                                              compression_ratio=ratio),
    }
    print(f"prefill presses: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    decode = run_decode(model, ids, a.decode_prompt, a.decode_steps, a.decode_interval, a.decode_target,
                        256) if a.decode_steps else None
    ea = ExpectedAttentionPress()
    out = {"ids": ids, "T": T, "budget": a.budget, "compression_ratio": ratio, "window": a.window,
           "kernel": a.kernel, "alpha": a.alpha, "text": Path(a.text).name,
           "expected_attention_params": {"n_future_positions": ea.n_future_positions, "n_sink": ea.n_sink,
                                         "use_covariance": ea.use_covariance, "use_vnorm": ea.use_vnorm,
                                         "epsilon": ea.epsilon},
           "presses": presses, "decode": decode,
           "kvpress_version": importlib.metadata.version("kvpress"),
           "transformers_version": importlib.metadata.version("transformers"),
           "torch_version": torch.__version__}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out), encoding="utf-8")
    print(f"T={T} budget={a.budget} presses {sorted(presses)}; decode events "
          f"{len(decode['events']) if decode else 0}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
