"""How long a model load takes: the first (a GGUF dequantised and cached) and a cached one.

    .venv/bin/python scripts/load_bench.py [--model SPEC] [--cache-dir DIR]

Both loads run in fresh processes, one after the other, against an empty cache folder (a
temporary one unless --cache-dir is given), so the first really is the first. Printed:
each load's own seconds (what `kvviz capture` / `kvviz loop` wait for after their imports)
the imports (torch, transformers and transformers' model code, which it imports lazily on
the first model whatever loads it) and the process wall time. Target: cached load <= 3 s
on a quiet 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch, transformers  # noqa: F401
# transformers imports its model code lazily, on the first model: the same ~3 s for any
# model, kvviz or plain from_pretrained, so it is timed as an import, not as the load.
import transformers.modeling_utils, transformers.masking_utils, transformers.generation  # noqa: F401,E401
t1 = time.perf_counter()
from kvviz.model.models import load_model
tok, mdl = load_model(None if sys.argv[1] == "-" else sys.argv[1], "load-bench")
print(json.dumps({"imports": t1 - t0, "load": mdl.kvviz_load_seconds}))
"""


def one(spec: str, env: dict) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, spec], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"error: the load failed:\n{out.stderr[-2000:]}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    data["wall"] = time.perf_counter() - start
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/load_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="-", help="a model spec for --model (default: the bundled SmolLM2)")
    p.add_argument("--cache-dir", help="cache folder to use (default: a fresh temporary one)")
    args = p.parse_args(argv)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "2")
    with tempfile.TemporaryDirectory(prefix="kvviz-load-bench-") as tmp:
        env["XDG_CACHE_HOME"] = args.cache_dir or tmp
        first = one(args.model, env)
        cached = one(args.model, env)
    print(f"model {args.model if args.model != '-' else 'SmolLM2-135M (bundled GGUF)'}; "
          f"cache {args.cache_dir or 'a fresh temporary folder'}")
    print(f"{'load':<8}{'load s':>9}{'imports s':>11}{'process s':>11}")
    for name, r in (("first", first), ("cached", cached)):
        print(f"{name:<8}{r['load']:>9.1f}{r['imports']:>11.1f}{r['wall']:>11.1f}")
    print(f"cached load {cached['load']:.1f} s (target <= 3 s on a quiet machine), "
          f"{first['load'] / max(cached['load'], 1e-9):.1f}x faster than the first")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
