"""`kvviz calibrate headkv --out FILE`: a head-score table for the `headkv` allocator, from
pass-key prompts kvviz builds (kvviz.model.needle.prompt).

HeadKV (Fu et al. 2024, arXiv:2410.19258, Section 3.1) scores each head by how it attends
to the needle while the model retrieves and reasons about it. kvviz's score is that
attention's mass: for each prompt, the model reads the prompt followed by the pass key's
answer tokens (teacher-forced, one forward pass, eager attention); at every query that
predicts an answer token, each query head's attention on the key's tokens (both mentions in
the needle's sentence) is summed, and a KV head's score is the mean over its query heads,
those queries and the prompts. (The paper counts, per generated token, whether the head's
top-attended positions fall in the needle; the mass is its soft version, with no top-k to
choose.) The table is {"model", "score", "prompts", "length", "layers": {"<layer>":
[score per KV head]}}, which `headkv:scores=FILE` reads.

    kvviz calibrate headkv --out heads.json --prompts 4 --length 256

`kvviz calibrate headroles --out FILE`: a role table for the `headroles` allocator
(`headroles:roleTable=FILE`). DuoAttention (Xiao et al. 2024, arXiv:2410.10819) finds its
retrieval heads by optimising one gate per head on synthetic passkey data, so that
restricting the other heads to sinks + a recent window changes the output least. kvviz's
table is a training-free proxy of that, on the same kind of data: on the same pass-key
prompts, at the queries that answer the key (teacher-forced), each query head's share of
its attention outside the first `stream_sinks` positions and its `stream_recent` newest
(the mass it would lose as a streaming head; the needle sits there), the mean over a KV
head's query heads, those queries and the prompts. It is headroles' own proxy (which it
otherwise measures on a run's first rows) measured where retrieval happens; no gate is
learnt, so it ranks heads by what they read, not by what losing it costs the output. The
table is {"model", "proxy", "prompts", "length", "stream_sinks", "stream_recent",
"layers": {"<layer>": [proxy per KV head]}}.

    kvviz calibrate headroles --out roles.json --prompts 4 --length 256
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvviz.core.cli import one_line_error

SCORE = ("per KV head, the mean over its query heads, the answer's queries and the prompts of the "
         "attention mass on the pass key's tokens while the model copies the key (teacher-forced); "
         "written by `kvviz calibrate headkv`")


PROXY = ("per KV head, the mean over its query heads, the answer's queries and the prompts of the "
         "attention share outside the first stream_sinks positions and the stream_recent newest "
         "while the model copies the pass key (teacher-forced): the mass a streaming head would lose; "
         "written by `kvviz calibrate headroles`, a training-free proxy of DuoAttention's learnt gates")
METHODS = ("headkv", "headroles")


def parser(sub=None) -> argparse.ArgumentParser:
    """`kvviz calibrate`'s options: its own parser, or (given `sub`) its node in kvviz's tree."""
    kw = dict(prog="python -m kvviz calibrate",
              description="Calibration files for the allocators that read one: `headkv` (head scores "
                          "from pass-key prompts), `headroles` (retrieval and streaming roles' proxy "
                          "from pass-key prompts).")
    p = (sub.add_parser("calibrate", help="a calibration file for an allocator (headkv's head scores)", **kw)
         if sub is not None else argparse.ArgumentParser(**kw))
    p.error = one_line_error
    p.add_argument("method", choices=METHODS, help="the allocator to calibrate")
    p.add_argument("--out", required=True, help="the JSON table to write")
    p.add_argument("--model", help="a local Hugging Face model folder or .gguf file (default: the bundled "
                                   "SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=4, help="pass-key prompts (seeds 0..N-1, depths spread "
                                                          "from 10 to 90 percent)")
    p.add_argument("--length", type=int, default=256, help="tokens per prompt")
    p.add_argument("--stream-sinks", type=int, default=4, help="headroles: a streaming head's sinks "
                                                               "(its streamSinks)")
    p.add_argument("--stream-recent", type=int, default=28, help="headroles: a streaming head's recent "
                                                                 "window (its streamRecent)")
    p.set_defaults(func=run, parser=p)
    return p


def check(prompts: int, length: int) -> None:
    """ValueError naming the option and its rule."""
    if isinstance(prompts, bool) or int(prompts) != prompts or prompts < 1:
        raise ValueError(f"--prompts must be a positive integer, got {prompts!r}")
    if isinstance(length, bool) or int(length) != length or length < 1:
        raise ValueError(f"--length must be a positive integer, got {length!r}")


def depths(prompts: int) -> list[float]:
    """Where each prompt's key sits: evenly from 10 to 90 percent (50 for one prompt)."""
    if prompts == 1:
        return [50.0]
    return [10.0 + 80.0 * i / (prompts - 1) for i in range(prompts)]


def _per_kv_head(tok, model, prompts: int, length: int, per_layer) -> list[list[float]]:
    """[layer][kv head]: `per_layer(attn, prompt, queries)` -> (heads,) tensor, over pass-key
    prompts (seeds 0..prompts-1, `depths`) read with their answer, averaged over each KV
    head's query heads and the prompts, float64 rounded to 6 digits. `queries` are the
    positions whose next token is an answer token; `attn` is one layer's (1, heads, T, T)."""
    import numpy as np
    import torch

    from kvviz.model.models import attention_shape
    from kvviz.model.needle.prompt import build

    shape = attention_shape(model)
    group = shape.heads // shape.kv_heads
    total = np.zeros((shape.layers, shape.kv_heads), np.float64)
    device = next(model.parameters()).device
    for seed, depth in enumerate(depths(prompts)):
        prompt = build(tok, length, depth, seed)
        answer = tok.encode(" " + prompt.key, add_special_tokens=False)
        ids = torch.tensor([list(prompt.ids) + list(answer)], device=device)
        with torch.no_grad():
            out = model(ids, output_attentions=True, use_cache=False)
        queries = [len(prompt.ids) - 1 + j for j in range(len(answer))]
        for layer, attn in enumerate(out.attentions):
            mass = per_layer(attn, prompt, queries)
            total[layer] += mass.reshape(shape.kv_heads, group).mean(dim=-1).cpu().numpy()
    return [[round(float(s), 6) for s in row] for row in total / prompts]


def head_scores(tok, model, prompts: int = 4, length: int = 256) -> list[list[float]]:
    """[layer][kv head] scores (see the module docstring), float64 means rounded to 6 digits."""
    check(prompts, length)

    def key_mass(attn, prompt, queries):  # each answer query's weight on the key's positions
        return attn[0][:, queries][:, :, list(prompt.key_positions)].sum(dim=-1).double().mean(dim=-1)

    return _per_kv_head(tok, model, prompts, length, key_mass)


def streaming_loss(tok, model, prompts: int = 4, length: int = 256, sinks: int = 4,
                   recent: int = 28) -> list[list[float]]:
    """[layer][kv head] proxies for `kvviz calibrate headroles` (see the module docstring):
    at each answer query q (its row over positions 0..q), the share outside 0..sinks-1 and
    the `recent` newest, float64 means rounded to 6 digits."""
    import torch

    check(prompts, length)
    check_stream(sinks, recent)

    def outside_window(attn, prompt, queries):
        shares = []
        for q in queries:
            row = attn[0, :, q, : q + 1].double()  # (heads, q + 1)
            outside = row[:, sinks: max(sinks, q + 1 - recent)].sum(dim=-1)
            shares.append(outside / row.sum(dim=-1).clamp_min(1e-300))
        return torch.stack(shares, dim=-1).mean(dim=-1)  # (heads,)

    return _per_kv_head(tok, model, prompts, length, outside_window)


def check_stream(sinks: int, recent: int) -> None:
    """ValueError naming the option and its rule (headroles' own: sinks >= 0, recent >= 1)."""
    if isinstance(sinks, bool) or int(sinks) != sinks or sinks < 0:
        raise ValueError(f"--stream-sinks must be an integer >= 0, got {sinks!r}")
    if isinstance(recent, bool) or int(recent) != recent or recent < 1:
        raise ValueError(f"--stream-recent must be an integer >= 1, got {recent!r}")


def write_roles(path, proxies: list, model_name: str, prompts: int, length: int, sinks: int,
                recent: int) -> Path:
    """The role table `headroles:roleTable=` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"model": model_name, "proxy": PROXY, "prompts": prompts, "length": length,
           "stream_sinks": sinks, "stream_recent": recent,
           "layers": {str(layer): row for layer, row in enumerate(proxies)}}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def write_table(path, scores: list, model_name: str, prompts: int, length: int) -> Path:
    """The table file `headkv:scores=` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"model": model_name, "score": SCORE, "prompts": prompts, "length": length,
           "layers": {str(layer): row for layer, row in enumerate(scores)}}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def run(args) -> int:
    from kvviz.model.capture import require_stack
    from kvviz.model.models import load_model

    try:
        check(args.prompts, args.length)
        check_stream(args.stream_sinks, args.stream_recent)
        require_stack("kvviz calibrate", args.model)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=__import__("sys").stderr)
        return 2
    tok, model = load_model(args.model, command="calibrate")
    name = Path(str(args.model)).name if args.model else "SmolLM2-135M-Instruct"
    if args.method == "headroles":
        scores = streaming_loss(tok, model, args.prompts, args.length, args.stream_sinks, args.stream_recent)
        path = write_roles(args.out, scores, name, args.prompts, args.length, args.stream_sinks,
                           args.stream_recent)
    else:
        scores = head_scores(tok, model, args.prompts, args.length)
        path = write_table(args.out, scores, name, args.prompts, args.length)
    print(f"wrote {path}: {len(scores)} layers x {len(scores[0])} KV heads, from {args.prompts} "
          f"pass-key prompts of {args.length} tokens")
    return 0


if __name__ == "__main__":
    args = parser().parse_args()
    raise SystemExit(args.func(args))
