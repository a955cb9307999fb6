"""Run the shipped closed-loop study: texts x one granularity, every config in one batch.

    HF_HUB_OFFLINE=1 python lab/loop_ship.py --granularity layer [--max-tokens 1024] [--out-dir DIR]
        [--policies tova,knorm,...]   (default: the shipped study's eight)

Resumable: a (text, granularity) whose result file exists is skipped; each file is
written atomically (LoopResult.save, write_json). One torch thread: on a shared, busy
machine two OpenMP threads waiting on each other made a decode step ~8x slower.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXTS = {"prose": "execmodel.txt", "code": "graphlib.py.txt", "table": "elements.md"}
POLICIES = ["tova", "h2o", "snapkv:pool_kernel=1,obs_window=16", "snapkv:pool_kernel=5,obs_window=16",
            "streaming-llm:sinks=4", "streaming-llm:sinks=0", "scissorhands", "random"]
BUDGETS = [64, 128, 256]
SHIP_LAYERS = (0, 14, 29)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--granularity", required=True, choices=("layer", "kv-head"))
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--rows-tokens", type=int, default=128)
    p.add_argument("--texts", default=",".join(TEXTS))
    p.add_argument("--out-dir", default=str(ROOT / "traces" / "loop"))
    p.add_argument("--policies", default=None,
                   help="semicolon-separated name:k=v,... specs (default: the shipped study's)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from kvviz.model.loop import run_loop
    from kvviz.model.loop.cli import Progress, build_configs, write_json

    configs = build_configs(args.policies.split(";") if args.policies else POLICIES, BUDGETS)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.texts.split(","):
        npz = out_dir / f"{name}-{args.granularity}.npz"
        if npz.exists():
            print(f"skip {npz} (exists)", file=sys.stderr)
            continue
        text = (ROOT / "traces" / "sources" / TEXTS[name]).read_text(encoding="utf-8")
        start = time.perf_counter()
        res = run_loop(text, configs, granularity=args.granularity, max_tokens=args.max_tokens,
                       progress=Progress(f"{name} {args.granularity} x{len(configs)}"),
                       rows_layers=SHIP_LAYERS, rows_tokens=args.rows_tokens)
        seconds = time.perf_counter() - start
        res.meta.update(name=name, text_file=f"traces/sources/{TEXTS[name]}", seconds=round(seconds, 1))
        write_json(out_dir / f"{name}-{args.granularity}.json",
                   {"text": name, "n_tokens": len(res.tokens), "granularity": args.granularity,
                    "seconds": round(seconds, 1), "results": res.results})
        res.save(npz, layers=SHIP_LAYERS, rows_dtype="float16")
        print(f"wrote {npz} ({npz.stat().st_size} bytes) in {seconds:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
