"""Write a tiny random-weight causal LM folder (no download) to try `--model` with.

    .venv/bin/python scripts/tiny_model.py --arch qwen2 --out /tmp/tinyqwen

Hidden size 64, 2-3 layers, 4 heads (2 KV heads where the architecture groups them; GPT-2
and GPT-NeoX are multi-head, GPTBigCode and Falcon multi-query with one), the bundled SmolLM2
tokenizer saved beside the weights: a few MB, built in about a second. The weights are random, so its attention
and losses mean nothing; it exercises the architecture's code path (tests/test_models.py
builds the same folders).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gpt2", "gpt_neox", "falcon", "gpt_bigcode",
         "gptj", "olmo2", "stablelm")


def config(arch: str):
    """The tiny config of `arch`; Gemma 2 keeps softcapping and a 32-token sliding window;
    GPT-NeoX and StableLM rotate a quarter of each head (partial rotary), GPT-J 8 of 16 dims;
    GPT-2 and GPTBigCode learn absolute positions."""
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=4096)
    if arch == "qwen2":
        return tf.Qwen2Config(**dict(common, num_hidden_layers=2))
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch == "phi3":
        return tf.Phi3Config(**dict(common, num_hidden_layers=2))
    if arch == "gemma2":
        return tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=32,
                               attn_logit_softcapping=5.0, final_logit_softcapping=30.0)
    tiny = dict(vocab_size=49152, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "gpt2":
        return tf.GPT2Config(**tiny, n_embd=64, n_layer=3, n_head=4, n_positions=256)
    if arch == "gpt_bigcode":
        return tf.GPTBigCodeConfig(**tiny, n_embd=64, n_layer=3, n_head=4, n_positions=256, multi_query=True)
    if arch == "gptj":
        return tf.GPTJConfig(**tiny, n_embd=64, n_layer=3, n_head=4, n_positions=256, rotary_dim=8)
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(**tiny, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.25)
    if arch == "falcon":
        return tf.FalconConfig(**tiny, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                               max_position_embeddings=256, multi_query=True, new_decoder_architecture=False,
                               alibi=False)
    if arch == "olmo2":
        return tf.Olmo2Config(**common)
    if arch == "stablelm":
        return tf.StableLmConfig(**dict(common, num_hidden_layers=2), partial_rotary_factor=0.25)
    raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")


def save_tokenizer(out: Path) -> None:
    """The bundled SmolLM2 tokenizer, from kvviz's GGUF cache when it is there (about 2 s),
    else parsed from the GGUF itself (20 s or more)."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvviz.model.gguf_cache import cache_root, problem
    from kvviz.model.models import resolve, source_sha256

    src = resolve(None)
    cached = cache_root() / "gguf" / source_sha256(src)
    if cached.is_dir() and problem(cached) is None:
        tok = AutoTokenizer.from_pretrained(cached, local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(src.path.parent, gguf_file=src.path.name, local_files_only=True)
    tok.save_pretrained(out)


def build(arch: str, out: Path, tokenizer_from: Path | None = None, seed: int = 0) -> Path:
    """Save the model (and the tokenizer, copied from `tokenizer_from` if given) to `out`."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    out = Path(out)
    AutoModelForCausalLM.from_config(config(arch)).save_pretrained(out)
    if tokenizer_from is None:
        save_tokenizer(out)
    else:
        for f in Path(tokenizer_from).iterdir():
            shutil.copy(f, out / f.name)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/tiny_model.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen2", choices=ARCHS)
    p.add_argument("--out", required=True, help="folder to write")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(build(args.arch, Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
