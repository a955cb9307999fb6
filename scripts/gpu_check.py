"""On a machine with a GPU: the loop's equivalence checks and its perf benchmark on CUDA.

    .venv/bin/python scripts/gpu_check.py [--dtype float32|bfloat16|float16] [--tokens 64]

Checks (the CPU versions are tests/test_models.py): with a budget of the whole text the
loop's per-token NLL equals a plain forward pass on the same device; the CUDA NLL equals
the CPU's; capture's rows equal the eager attentions head-averaged. Then `kvviz loop --perf`
on CUDA. Prints the figures; exits 1 on a mismatch. Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
TEXT = ("The committee met at noon; the minutes record that the motion passed. "
        "It was a bright cold day in April, and the clocks were striking thirteen. ") * 4
TOL = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.05}  # NLL, nats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=tuple(TOL))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--perf-tokens", type=int, default=384)
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("no GPU check: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("no GPU: torch.cuda.is_available() is False; nothing to check (the CPU path is "
              "what tests/test_models.py covers)")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np

    from kvviz.model.capture import capture
    from kvviz.model.loop import LoopConfig, run_loop
    from kvviz.model.models import load_model, tokenize
    from kvviz.studies.loop_perf import main as perf

    tok, mdl = load_model(None, "gpu-check", "cuda", args.dtype)
    ids = tokenize(tok, TEXT, args.tokens)[0]
    with torch.no_grad():
        logp = torch.log_softmax(mdl(input_ids=torch.tensor([ids], device="cuda")).logits[0].double(), -1)
    plain = (-logp[:-1].gather(1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0]).cpu().numpy()
    cfgs = [LoopConfig("full"), LoopConfig("tova", {}, len(ids))]
    res = run_loop(TEXT, cfgs, max_tokens=args.tokens, model=(tok, mdl), rows_layers=())
    cpu = run_loop(TEXT, [LoopConfig("full")], max_tokens=args.tokens, rows_layers=(), device="cpu")
    figures = {"loop vs plain forward (cuda)": float(np.abs(res.nll - plain).max()),
               "cuda vs cpu": float(np.abs(res.nll[0] - cpu.nll[0]).max())}
    cap = capture(TEXT, max_tokens=args.tokens, model=(tok, mdl))
    with torch.no_grad():
        att = mdl(input_ids=torch.tensor([ids], device="cuda"), output_attentions=True).attentions
    lower = np.tril(np.ones((len(ids), len(ids)), bool), k=-1)
    figures["capture rows vs eager"] = float(max(
        np.abs(cap["attn"][i, 0] - np.where(lower, att[layer][0].float().mean(0).cpu().numpy(), 0)).max()
        for i, layer in enumerate(cap["layers"])))
    tol = {"loop vs plain forward (cuda)": TOL[args.dtype], "cuda vs cpu": TOL[args.dtype],
           "capture rows vs eager": 1e-3 if args.dtype == "float32" else 2e-2}
    bad = False
    for name, value in figures.items():
        ok = value <= tol[name]
        bad |= not ok
        print(f"{name:<30} max |diff| {value:.2e} (tolerance {tol[name]:.0e}) {'ok' if ok else 'MISMATCH'}")
    rc = perf(args.perf_tokens, budget=min(256, args.perf_tokens - 32), device="cuda", dtype=args.dtype)
    return 1 if bad or rc else 0


if __name__ == "__main__":
    raise SystemExit(main())
