"""Compare kvviz's closed loop with kvpress's DecodingPress(TOVAPress) run (kvpress_check.py).

Run with kvviz's venv, after lab/kvpress_check.py has written its .npz:

    HF_HUB_OFFLINE=1 .venv/bin/python lab/kvpress_compare.py \
        --kvpress /tmp/kvpress_tova.npz --text traces/sources/execmodel.txt --json OUT.json

It runs kvviz's loop (`tova`, layer granularity) over the same tokens and budgets and checks:
  1. the tokens are the same ids;
  2. full cache: per-token NLL of both stacks (transformers 5.2 batch 1 vs 5.24 batched);
  3. closed loop: the held set at every step and layer, and perplexity;
  4. open loop: kvviz's own `tova` policy replayed (kvviz.core.replay) over the attention rows
     kvpress's model produced, against kvpress's eviction log. This separates the two
     policies' semantics from the numerics of two different model runs.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from kvviz.core.policies import make_policy
from kvviz.core.replay import NEVER, Replay
from kvviz.core.trace import ArrayTrace, packed_offset


def held_sets_equal(ev_a: np.ndarray, ev_b: np.ndarray) -> np.ndarray:
    """(T,) bool: at step t (after its eviction) both logs hold the same positions 0..t."""
    T = len(ev_a)
    out = np.ones(T, bool)
    # position p held after step t iff p <= t and (ev == NEVER or ev > t); the sets differ at
    # t iff some p <= t has exactly one of the logs evicting it at a step <= t.
    ea = np.where(ev_a == NEVER, T, ev_a)
    eb = np.where(ev_b == NEVER, T, ev_b)
    lo, hi = np.minimum(ea, eb), np.maximum(ea, eb)
    diff = np.zeros(T + 1, int)
    for a, b in zip(lo[lo != hi], hi[lo != hi]):  # differs on steps a..b-1
        diff[a] += 1
        diff[b] -= 1
    out &= np.cumsum(diff)[:T] == 0
    return out


def kvpress_rows(held: np.ndarray, score: np.ndarray, T: int) -> np.ndarray:
    """Packed rows (as a kvviz trace) from kvpress's per-step scores on the held positions."""
    packed = np.zeros(packed_offset(T), np.float32)
    for t in range(1, T):
        ok = held[t] >= 0
        off = packed_offset(t)
        packed[off + held[t][ok]] = score[t][ok]
    return packed


def replay_open_loop(held: np.ndarray, score: np.ndarray, budget: int) -> np.ndarray:
    """kvviz's tova replayed over kvpress's rows, one layer per column: ev (L, T)."""
    T, L = held.shape[0], held.shape[1]
    ev = np.full((L, T), NEVER, np.int64)
    for layer in range(L):
        packed = kvpress_rows(held[:, layer], score[:, layer], T)
        # rows before the first cut: the full cache, which kvpress's hook did not score
        rep = Replay(ArrayTrace(packed, T), make_policy("tova", budget=budget))
        ev[layer] = rep.run().evicted_at
    return ev


def first_divergences(ev_kv, ev_loop, held, score, limit=5) -> list[dict]:
    """Where the closed loops first disagree, per layer: both victims and kvpress's scores."""
    out = []
    L, T = ev_kv.shape
    for layer in range(L):
        same = held_sets_equal(ev_kv[layer], ev_loop[layer])
        if same.all():
            continue
        t = int(np.argmin(same))
        vk = np.flatnonzero(ev_kv[layer] == t).tolist()
        vl = np.flatnonzero(ev_loop[layer] == t).tolist()
        sc = dict(zip(held[t, layer].tolist(), score[t, layer].tolist()))
        row = {"layer": layer, "step": t, "kvpress_victims": vk, "kvviz_victims": vl,
               "kvpress_scores": {int(p): sc.get(p) for p in vk + vl}}
        vals = [sc.get(p) for p in vk + vl if sc.get(p) is not None]
        if len(vals) >= 2 and max(vals) > 0:
            row["relative_gap"] = (max(vals) - min(vals)) / max(vals)
        out.append(row)
    out.sort(key=lambda r: r["step"])
    return out[:limit] if limit else out


def ppl(nll) -> float:
    return math.exp(float(np.mean(nll)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvpress", required=True, help=".npz written by kvpress_check.py")
    ap.add_argument("--text", required=True)
    ap.add_argument("--json", required=True, help="summary to write")
    ap.add_argument("--loop-result", help="kvviz loop result (.npz): loaded if it exists, "
                    "else run and saved there")
    args = ap.parse_args(argv)
    from kvviz.model.loop import LoopConfig, load_loop_result, run_loop

    kv = np.load(args.kvpress, allow_pickle=False)
    ids = kv["ids"]
    T = len(ids)
    budgets = sorted(int(k[3:]) for k in kv.files if k.startswith("ev_"))
    text = Path(args.text).read_text(encoding="utf-8")
    configs = [LoopConfig("full")] + [LoopConfig("tova", {}, b) for b in budgets]

    def progress(done, total):
        if done % 64 == 0 or done == total:
            print(f"  kvviz loop: {done}/{total}", file=sys.stderr, flush=True)

    if args.loop_result and Path(args.loop_result).exists():
        res = load_loop_result(args.loop_result)
        labels = [c.label for c in res.configs]
        if labels != [c.label for c in configs] or res.granularity != "layer":
            raise SystemExit(f"{args.loop_result} holds {labels} ({res.granularity})")
    else:
        res = run_loop(text, configs, granularity="layer", max_tokens=T, progress=progress,
                       rows_layers=())
        if args.loop_result:
            res.save(args.loop_result)
    summary = {"text": args.text, "n_tokens": T,
               "same_token_ids": bool(np.array_equal(res.token_ids, ids)), "budgets": {}}
    f = res.full_index
    d = np.abs(res.nll[f] - kv["nll_full"])
    summary["full"] = {"perplexity_kvpress_stack": ppl(kv["nll_full"]),
                       "perplexity_kvviz": ppl(res.nll[f]),
                       "max_abs_nll_diff": float(d.max()), "mean_abs_nll_diff": float(d.mean())}
    for ci, b in enumerate(budgets, start=1):
        ev_kv = kv[f"ev_{b}"].astype(np.int64)
        ev_loop = res.evicted_at[ci, :, 0, :]
        held, score = kv[f"held_{b}"], kv[f"score_{b}"]
        L = ev_kv.shape[0]
        same = np.stack([held_sets_equal(ev_kv[i], ev_loop[i]) for i in range(L)])
        ev_open = replay_open_loop(held, score, b)
        same_open = np.stack([held_sets_equal(ev_kv[i], ev_open[i]) for i in range(L)])
        nll_kv = kv[f"nll_{b}"]
        summary["budgets"][str(b)] = {
            "perplexity_kvpress": ppl(nll_kv), "perplexity_kvviz": ppl(res.nll[ci]),
            "max_abs_nll_diff": float(np.abs(nll_kv - res.nll[ci]).max()),
            "closed_loop_step_layer_pairs_identical": f"{int(same.sum())}/{same.size}",
            "closed_loop_layers_identical_throughout": int(same.all(axis=1).sum()),
            "closed_loop_first_divergence_step": int(np.argmin(same.all(axis=0)))
            if not same.all() else None,
            "open_loop_step_layer_pairs_identical": f"{int(same_open.sum())}/{same_open.size}",
            "open_loop_layers_identical_throughout": int(same_open.all(axis=1).sum()),
            "first_closed_loop_divergences": first_divergences(ev_kv, ev_loop, held, score),
            "first_open_loop_divergences": first_divergences(ev_kv, ev_open, held, score),
        }
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
