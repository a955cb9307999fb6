"""The GPU check: kvviz's model engine on a CUDA device, in one run of under ten minutes.

    python3 scripts/gpu_check.py                 # on a machine with a CUDA GPU
    python3 scripts/gpu_check.py --device cpu --quick   # the same checks, small, anywhere

Needs only torch, transformers, tokenizers and numpy (no model download, no GGUF, no
Streamlit): every model is built here from a config with random weights.

1. Equivalences at a budget that evicts nothing, both eviction modes (masked, freed), on
   tiny models of three architectures: the loop's per-token NLL equals a plain forward
   pass's, and generation equals the model's own greedy `generate`, token for token.
2. A long prompt (8,192 tokens) read in prefill mode with 10 configurations, both modes, on
   a model with SmolLM2-135M's exact configuration (same shapes, so the same speed and
   memory): seconds, peak device memory, agreement of the two modes' tokens.
3. The decode table (kvviz.studies.cache_perf): tokens per second and cache bytes for the
   full cache, masked and freed eviction, at 2,048, 4,096 and 8,192 tokens, budgets 256,
   512 and 1,024, batch 1 and 8, with the bytes each step brought to the host.

Every figure is printed; the exit status is 1 on any mismatch, 0 otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2)


def tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` tokens "t0".."tN" (no download): texts are
    space-separated token names."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0")


def build(kind: str, config: dict, device: str, dtype: str = "float32", seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{kind}Config")(**config)
    mdl = getattr(transformers, f"{kind}ForCausalLM")(cfg).eval().to(device=device, dtype=getattr(torch, dtype))
    mdl.set_attn_implementation("eager")
    mdl.generation_config.eos_token_id = None  # random weights: run every row to its length
    mdl.generation_config.pad_token_id = 0
    mdl.kvviz_provenance = {"model": f"random {kind} ({cfg.num_hidden_layers} layers)", "model_type": cfg.model_type,
                            "dtype": dtype, "device": str(device)}
    return tokenizer(cfg.vocab_size), mdl


def equivalences(device: str, length: int, report) -> bool:
    """Budget >= every position: the loop equals a plain forward, generation equals
    generate, in both eviction modes and both prompt modes."""
    import numpy as np
    import torch

    from kvviz.model.loop import LoopConfig, generate, run_loop

    ok = True
    for kind in ("Llama", "Qwen2", "Mistral"):
        extra = {"sliding_window": None} if kind in ("Qwen2", "Mistral") else {}
        tok, mdl = build(kind, {**TINY, **extra}, device)
        ids = np.random.default_rng(1).integers(3, TINY["vocab_size"], length).tolist()
        text = " ".join(f"t{i}" for i in ids)
        with torch.no_grad():
            logits = mdl(torch.tensor([ids], device=device)).logits[0, :-1].double()
        plain = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
        plain = plain.cpu().numpy()
        wide = [LoopConfig("tova", {}, length + 64), LoopConfig("snapkv", {}, length + 64)]
        for ev in ("masked", "freed"):
            res = run_loop(text, wide, max_tokens=length, model=(tok, mdl), rows_layers=[], eviction=ev)
            err = float(np.abs(res.nll - plain[None]).max())
            good = err < 1e-3
            ok &= good
            report(f"{kind:<8} loop {ev:<6} NLL vs plain forward: max |diff| {err:.2e} {'ok' if good else 'MISMATCH'}")
            with torch.no_grad():
                want = mdl.generate(torch.tensor([ids], device=device), max_new_tokens=16, do_sample=False)[0, length:]
            for mode in ("decode", "prefill"):
                gen = generate(ids, wide, 16, prompt_mode=mode, model=(tok, mdl), eviction=ev)
                same = all(gen.new_ids[c].tolist() == want.tolist() for c in range(len(gen.configs)))
                ok &= same
                report(f"{kind:<8} generate {ev:<6} {mode:<7} vs plain greedy generate: "
                       f"{'same tokens' if same else 'MISMATCH'}")
    return ok


def long_prompt(device: str, dtype: str, length: int, report) -> bool:
    """`length` tokens in prefill mode, 10 configurations, masked against freed."""
    import numpy as np
    import torch

    from kvviz.model.loop import LoopConfig, generate

    tok, mdl = build("Llama", SMOLLM2, device, dtype)
    ids = np.random.default_rng(2).integers(3, SMOLLM2["vocab_size"], length).tolist()
    names = [("tova", {}), ("snapkv", {}), ("h2o", {}), ("streaming-llm", {}), ("knorm", {})]
    cfgs = [LoopConfig(n, p, b) for b in (256, 1024) for n, p in names][:9]
    gens = {}
    for ev in ("masked", "freed"):
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        gens[ev] = g = generate(ids, cfgs, 8, prompt_mode="prefill", model=(tok, mdl), eviction=ev)
        secs = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
        report(f"{length}-token prompt, prefill, {len(g.configs)} configurations, {ev}: {secs:.1f} s "
               f"(prompt {g.meta['prompt_seconds']:.1f} s), peak device memory {peak:.2f} GiB, "
               f"cache held {g.meta['cache_bytes'] / 2**20:.0f} MB of {g.meta['full_cache_bytes'] / 2**20:.0f} MB")
    same = np.array_equal(gens["masked"].new_ids, gens["freed"].new_ids)
    evicted = np.array_equal(gens["masked"].evicted_at, gens["freed"].evicted_at)
    report(f"masked vs freed at {length}: tokens {'same' if same else 'DIFFER'}, "
           f"evictions {'same' if evicted else 'DIFFER'}")
    return bool(same and evicted)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32", help="of the SmolLM2-shaped model (float32, bfloat16)")
    p.add_argument("--quick", action="store_true", help="small sizes: the checks' code, not their figures")
    args = p.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    from kvviz.studies import cache_perf

    def report(line):
        print(line, flush=True)

    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    report(f"gpu_check on {where}: torch {torch.__version__}")
    start = time.perf_counter()
    ok = equivalences(args.device, 24 if args.quick else 96, report)
    ok &= long_prompt(args.device, args.dtype, 300 if args.quick else 8192, report)
    _, mdl = build("Llama", SMOLLM2 if not args.quick else {**TINY, "vocab_size": 512}, args.device, args.dtype)
    lengths, budgets, batches = ([160], [64], [1, 2]) if args.quick else ([2048, 4096, 8192], [256, 512, 1024], [1, 8])
    rows = cache_perf.measure((None, mdl), lengths, budgets, batches, 8 if args.quick else 32, log=report)
    report(cache_perf.table(rows))
    report(f"{'all checks passed' if ok else 'A CHECK FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
