"""Allocators on SmolLM2-135M: do AdaKV, PyramidKV and head roles beat their plain scorer at the
same total budget, and do the heads they favour attend to the pass key? docs/studies/alloc.md quotes it.

    OMP_NUM_THREADS=1 python -m lab.alloc_report --out out/alloc            # run + print
    python -m lab.alloc_report --out traces/alloc --report-only               # print only
    python -m lab.alloc_report --out traces/alloc --kvpress traces/alloc/kvpress.json --write

Stages (each resumable: a prompt or stage already in DIR is not run again):

1. Pass key: prompts of `--length` tokens at depths 10/50/90 %, seeds 0..3, read in prefill
   mode at kv-head granularity (kvviz.model.loop.generate) under every configuration (plain
   scorers, adakv over each, pyramidkv and headroles over tova) at each budget. Per prompt:
   each answer, whether it holds the key, how many of the key's leading digits it gives,
   each allocator's held count per (layer, KV head) after the prompt, how many of the key's
   tokens each (layer, KV head) still holds then, and the full cache's
   attention mass from the question's tokens onto the key's tokens per (layer, KV head)
   (one eager forward with output_attentions, mean over the question's rows and over the
   query heads of each KV head, summed over the key's positions).
2. KL: kvviz.model.loop.run_loop over a shipped text (teacher forced, kv-head), KL(full ||
   config) per token, mean after the first eviction.
3. Report: the tables below, computed from DIR's files; printed, and written to DIR/summary.json
   only with `--write` (or to the file `--json` names).

`--kvpress FILE` (written by lab/kvpress_alloc.py in kvpress's own venv) adds the
comparison of kvpress's AdaKVPress(KnormPress()) kept positions and PyramidKVPress's
per-layer budgets with kvviz's adakv:scorer=knorm and pyramidkv on the same prompt.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np

SCORERS = ("tova", "snapkv", "h2o")
BUDGETS = (64, 128, 256)
ROLE_BUDGETS = (32, 64, 128, 256)
DEPTHS = (10, 50, 90)
SEEDS = (0, 1, 2, 3)
STREAM_SLOTS = 32  # headroles' default streamSinks 4 + streamRecent 28


def config_specs(budgets=BUDGETS, role_budgets=ROLE_BUDGETS) -> list[tuple[str, str, int]]:
    """(name, policy spec, budget) for every configuration of the pass-key stage."""
    out = []
    for b in budgets:
        out += [(s, s, b) for s in SCORERS]
        out += [(f"adakv:{s}", f"adakv:scorer={s}", b) for s in SCORERS]
        out.append(("pyramidkv:tova", "pyramidkv:scorer=tova", b))
    out += [("headroles:tova", "headroles:scorer=tova", b) for b in role_budgets]
    return out


# -- answer functions (no model) ------------------------------------------------------------
def leading_digits(answer: str, key: str) -> int:
    """How many of `key`'s leading digits the answer's first number gives (0 when it has none)."""
    m = re.search(r"\d+", answer)
    if not m:
        return 0
    n = 0
    for a, b in zip(m.group(0), key):
        if a != b:
            break
        n += 1
    return n


def key_mass(attentions, question_start: int, key_positions, kv_heads: int) -> np.ndarray:
    """float64 (L, G): per layer and KV head, the attention mass the question's rows
    (question_start..end) put on the key's positions, summed over those positions, averaged
    over the rows and over the query heads that share the KV head (query head h reads KV head
    h // (H / G)). `attentions`: per layer an array (H, T, T) (rows = queries)."""
    out = []
    keys = np.asarray(list(key_positions), np.int64)
    for a in attentions:
        a = np.asarray(a, np.float64)
        H = a.shape[0]
        per_q = a[:, question_start:, :][:, :, keys].sum(-1).mean(-1)  # (H,)
        out.append(per_q.reshape(kv_heads, H // kv_heads).mean(-1))
    return np.array(out)


def pearson(x, y) -> float:
    x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    if x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def ranks(x) -> np.ndarray:
    """Average ranks (ties share the mean rank), 0-based."""
    x = np.asarray(x, np.float64).ravel()
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x), np.float64)
    r[order] = np.arange(len(x))
    for v in np.unique(x):
        same = x == v
        r[same] = r[same].mean()
    return r


def spearman(x, y) -> float:
    return pearson(ranks(x), ranks(y))


def accuracy_table(records: list[dict]) -> dict:
    """{name: {budget: (correct share, mean leading digits, n)}} from records with keys
    name, budget, correct (bool), digits (int)."""
    out: dict = {}
    for r in records:
        out.setdefault(r["name"], {}).setdefault(r["budget"], []).append(r)
    return {name: {b: (float(np.mean([r["correct"] for r in rs])), float(np.mean([r["digits"] for r in rs])),
                       len(rs)) for b, rs in sorted(by_b.items())}
            for name, by_b in out.items()}


def versus(table: dict, a: str, b: str) -> dict:
    """Per budget both have: (a's correct share - b's, a's mean digits - b's)."""
    return {bud: (table[a][bud][0] - table[b][bud][0], table[a][bud][1] - table[b][bud][1])
            for bud in table.get(a, {}) if bud in table.get(b, {})}


def roles_from_held(held, budget: int, stream_slots: int = STREAM_SLOTS) -> np.ndarray:
    """bool (..., G): which heads headroles made retrieval heads, read off what each holds
    after the prompt (a streaming head holds exactly its sinks + recent; a retrieval head
    more). Only defined when the budget is above the streaming slots."""
    if budget <= stream_slots:
        raise ValueError(f"at budget {budget} every head holds {stream_slots}: roles are not visible")
    return np.asarray(held) > stream_slots


def picked_top(retrieval, mass) -> float:
    """Share of layers (and prompts) where the KV head with the largest key mass is a retrieval
    head. `retrieval`, `mass`: (..., L, G)."""
    retrieval, mass = np.asarray(retrieval, bool), np.asarray(mass, np.float64)
    top = mass.argmax(-1)
    return float(np.take_along_axis(retrieval, top[..., None], -1).mean())


def kept_diff(a: dict, b: dict) -> dict:
    """Two kept-position maps {(layer, head): sorted positions}: per cell, positions only in a,
    only in b; and totals."""
    cells = sorted(set(a) | set(b))
    only_a = {c: sorted(set(a.get(c, ())) - set(b.get(c, ()))) for c in cells}
    only_b = {c: sorted(set(b.get(c, ())) - set(a.get(c, ()))) for c in cells}
    return {"cells": len(cells), "same_cells": sum(1 for c in cells if not only_a[c] and not only_b[c]),
            "only_a": {c: v for c, v in only_a.items() if v}, "only_b": {c: v for c, v in only_b.items() if v},
            "kept_a": sum(len(a.get(c, ())) for c in cells), "kept_b": sum(len(b.get(c, ())) for c in cells)}


# -- stages (the model) ----------------------------------------------------------------------
def _pair():
    import torch

    from kvviz.model.models import load_model

    torch.set_num_threads(1)
    return load_model(None, "needle", "cpu", "float32")


def eager_key_mass(pair, p) -> np.ndarray:
    import torch

    from kvviz.model.models import attention_shape

    tok, mdl = pair
    with torch.no_grad():
        out = mdl(input_ids=torch.tensor([list(p.ids)]), output_attentions=True, use_cache=False)
    atts = [a[0].float().numpy() for a in out.attentions]
    return key_mass(atts, p.question_start, p.key_positions, attention_shape(mdl).kv_heads)


def needle_stage(out: Path, length: int, depths=DEPTHS, seeds=SEEDS, pair=None, log=print):
    from kvviz.model.loop import LoopConfig, generate, parse_policy
    from kvviz.model.needle.prompt import build

    folder = out / "needle"
    folder.mkdir(parents=True, exist_ok=True)
    specs = config_specs()
    configs = [LoopConfig(*parse_policy(s), b) for _, s, b in specs]
    for d in depths:
        for s in seeds:
            path = folder / f"L{length}-d{d}-s{s}.json"
            if path.exists():
                continue
            pair = pair or _pair()
            t0 = time.perf_counter()
            p = build(pair[0], length, d, s)
            mass = eager_key_mass(pair, p)
            g = generate(list(p.ids), configs, 8, granularity="kv-head", prompt_mode="prefill", model=pair)
            f = g.full_index
            rows = []
            for (name, spec, b), c in zip(specs, [i for i in range(len(g.configs)) if i != f]):
                kept = g.held(c, g.prompt_len - 1)  # (layers, KV heads, positions)
                rows.append({"name": name, "spec": spec, "budget": b, "answer": g.texts[c],
                             "correct": p.key in g.texts[c], "digits": leading_digits(g.texts[c], p.key),
                             "held": kept.sum(-1).tolist(),
                             "key_held": kept[..., list(p.key_positions)].sum(-1).tolist()})
            rec = {"length": length, "depth": d, "seed": s, "key": p.key, "prompt_len": len(p.ids),
                   "key_positions": list(p.key_positions), "question_start": p.question_start,
                   "full_answer": g.texts[f], "full_correct": p.key in g.texts[f],
                   "key_mass": mass.tolist(), "rows": rows, "seconds": time.perf_counter() - t0}
            path.write_text(json.dumps(rec), encoding="utf-8")
            log(f"[alloc] {path.name}: full {g.texts[f]!r} key {p.key} ({rec['seconds']:.0f} s)")
    return pair


def loop_stage(out: Path, text_path: Path, max_tokens: int, budgets=(64, 128), pair=None, log=print):
    from kvviz.model.loop import LoopConfig, parse_policy, run_loop

    path = out / "loop.json"
    if path.exists():
        return pair
    pair = pair or _pair()
    specs = [(n, s, b) for b in budgets for n, s, _ in config_specs((b,), ())]
    configs = [LoopConfig(*parse_policy(s), b) for _, s, b in specs]
    t0 = time.perf_counter()
    res = run_loop(text_path.read_text(encoding="utf-8"), configs, granularity="kv-head",
                   max_tokens=max_tokens, model=pair)
    results = [r for r in res.results if r["policy"] != "full"]
    rows = [{"name": n, "budget": b, "kl_after_eviction": r["kl_after_eviction"], "kl": r["kl"],
             "top1_after_eviction": r["top1_agreement_after_eviction"],
             "ppl_ratio": r["perplexity_after_eviction"] / r["full_perplexity_after_eviction"]}
            for (n, _, b), r in zip(specs, results)]
    path.write_text(json.dumps({"text": text_path.name, "max_tokens": max_tokens, "rows": rows,
                                "seconds": time.perf_counter() - t0}), encoding="utf-8")
    log(f"[alloc] loop.json ({time.perf_counter() - t0:.0f} s)")
    return pair


def kvviz_kept(pair, ids: list[int], budget: int, kv_layers: int) -> dict:
    """kvviz's adakv:scorer=knorm and knorm alone, prefill, kv-head: kept positions per
    (layer, head) after the prompt, and pyramidkv's per-layer budgets."""
    from kvviz.core.policies import make_policy
    from kvviz.model.loop import LoopConfig, generate

    cfgs = [LoopConfig("adakv", {"scorer": "knorm"}, budget), LoopConfig("knorm", {}, budget)]
    g = generate(list(ids), cfgs, 1, granularity="kv-head", prompt_mode="prefill", model=pair)
    out = {}
    for c, cfg in enumerate(g.configs):
        if cfg.is_full:
            continue
        h = g.held(c, g.prompt_len - 1)
        out[cfg.policy] = {(i, j): np.flatnonzero(h[i, j]).tolist() for i in range(h.shape[0])
                           for j in range(h.shape[1])}
    out["pyramid"] = make_policy("pyramidkv", budget, scorer="tova").layer_budgets(kv_layers)
    return out


def kvpress_compare(kvpress_file: Path, pair=None) -> dict:
    d = json.loads(kvpress_file.read_text(encoding="utf-8"))
    pair = pair or _pair()
    L = len(d["pyramid_budgets"])
    mine = kvviz_kept(pair, d["ids"], d["budget"], L)
    theirs = {(int(k.split(",")[0]), int(k.split(",")[1])): v for k, v in d["adakv_kept"].items()}
    diff = kept_diff(theirs, mine["adakv"])
    knorm_theirs = {(int(k.split(",")[0]), int(k.split(",")[1])): v for k, v in d["knorm_kept"].items()}
    diff_plain = kept_diff(knorm_theirs, mine["knorm"])
    return {"budget": d["budget"], "T": len(d["ids"]), "adakv": _jsonable(diff), "knorm": _jsonable(diff_plain),
            "kvpress_pyramid": d["pyramid_budgets"], "kvpress_pyramid_cache_lengths": d["pyramid_cache_lengths"],
            "kvpress_pyramid_small_window": d["pyramid_budgets_small_window"],
            "small_window": d["small_window"], "kvviz_pyramid": mine["pyramid"],
            "small_window_same_as_kvviz": d["pyramid_budgets_small_window"] == mine["pyramid"],
            "kvpress_pyramid_total": sum(d["pyramid_budgets"]), "kvviz_pyramid_total": sum(mine["pyramid"])}


def _jsonable(diff: dict) -> dict:
    return {**diff, "only_a": {f"{k[0]},{k[1]}": v for k, v in diff["only_a"].items()},
            "only_b": {f"{k[0]},{k[1]}": v for k, v in diff["only_b"].items()}}


# -- report ----------------------------------------------------------------------------------
def load_needle(out: Path) -> list[dict]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted((out / "needle").glob("*.json"))]


def summarise(prompts: list[dict], loop: dict | None) -> dict:
    records = [{**r, "prompt": (p["depth"], p["seed"])} for p in prompts for r in p["rows"]]
    acc = accuracy_table(records)
    mass = np.array([p["key_mass"] for p in prompts])  # (P, L, G)
    heads = {}
    for s in SCORERS:
        for b in BUDGETS:
            held = np.array([next(r["held"] for r in p["rows"] if r["name"] == f"adakv:{s}" and r["budget"] == b)
                             for p in prompts], np.float64)  # (P, L, G)
            gain = held.mean(0) - b
            per_prompt = [spearman(h, m) for h, m in zip(held, mass)]
            heads[f"adakv:{s}@{b}"] = {
                "spearman_mean_cells": spearman(gain, mass.mean(0)), "pearson_mean_cells": pearson(gain, mass.mean(0)),
                "spearman_per_prompt_median": float(np.median(per_prompt)),
                "max_gain": float(gain.max()), "min_gain": float(gain.min()),
                "top_gainers": [(int(i // gain.shape[1]), int(i % gain.shape[1]), float(gain.flat[i]))
                                for i in np.argsort(-gain.ravel())[:5]],
                "top_key_heads_gain": [(int(i // gain.shape[1]), int(i % gain.shape[1]), float(gain.flat[i]))
                                       for i in np.argsort(-mass.mean(0).ravel())[:5]]}
    roles = {}
    for b in (64, 128, 256):
        held = np.array([next(r["held"] for r in p["rows"] if r["name"] == "headroles:tova" and r["budget"] == b)
                         for p in prompts])
        ret = roles_from_held(held, b)  # (P, L, G)
        roles[b] = {"retrieval_per_layer": sorted({int(x) for x in ret.sum(-1).ravel()}),
                    "picked_top_key_head": picked_top(ret, mass),
                    "key_mass_retrieval": float(mass[ret].mean()), "key_mass_streaming": float(mass[~ret].mean()),
                    "stable_across_prompts": float((ret == ret[:1]).all(0).all(-1).mean()),
                    "retrieval_share_per_head": ret.mean(0).round(3).tolist()}  # (L, G) over prompts
    return {"prompts": len(prompts), "full_correct": int(sum(p["full_correct"] for p in prompts)),
            "accuracy": {n: {str(b): v for b, v in t.items()} for n, t in acc.items()},
            "adakv_vs_plain": {s: {str(b): v for b, v in versus(acc, f"adakv:{s}", s).items()} for s in SCORERS},
            "pyramid_vs_uniform": {str(b): v for b, v in versus(acc, "pyramidkv:tova", "tova").items()},
            "heads": heads, "roles": {str(b): v for b, v in roles.items()}, "loop": loop,
            "key_mass_mean": mass.mean(0).tolist()}


def print_report(s: dict) -> None:
    print(f"pass key: {s['prompts']} prompts; full cache right on {s['full_correct']}")
    print("correct share (mean leading digits of the key given) per budget")
    for n, t in s["accuracy"].items():
        print(f"  {n:16} " + "  ".join(f"{b}: {v[0]:.2f} ({v[1]:.1f})" for b, v in t.items()))
    print("adakv - plain (correct share, digits):", json.dumps(s["adakv_vs_plain"]))
    print("pyramidkv - tova:", json.dumps(s["pyramid_vs_uniform"]))
    for k, h in s["heads"].items():
        print(f"  {k}: spearman(gain, key mass) over 90 cells {h['spearman_mean_cells']:.2f}, pearson "
              f"{h['pearson_mean_cells']:.2f}, per-prompt median {h['spearman_per_prompt_median']:.2f}; "
              f"gain {h['min_gain']:.1f}..{h['max_gain']:.1f}")
    for b, r in s["roles"].items():
        print(f"  headroles@{b}: retrieval heads per layer {r['retrieval_per_layer']}, top key head picked "
              f"{r['picked_top_key_head']:.2f}, key mass retrieval {r['key_mass_retrieval']:.4f} vs streaming "
              f"{r['key_mass_streaming']:.4f}, roles same in every prompt in {r['stable_across_prompts']:.2f} "
              "of layers")
    if s.get("loop"):
        print(f"KL after the first eviction ({s['loop']['text']}, {s['loop']['max_tokens']} tokens)")
        for r in s["loop"]["rows"]:
            print(f"  {r['name']:16} {r['budget']:>4}  KL {r['kl_after_eviction']:.4f}  top1 "
                  f"{r['top1_after_eviction']:.3f}  ppl/full {r['ppl_ratio']:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--text", default="traces/sources/execmodel.txt")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--no-loop", action="store_true")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--kvpress", help="the JSON lab/kvpress_alloc.py wrote")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--write", action="store_true",
                    help="write the summary to OUT/summary.json (without it, and without --json, the report "
                         "only prints)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    pair = None
    if not a.report_only:
        pair = needle_stage(out, a.length)
        if not a.no_loop:
            pair = loop_stage(out, Path(a.text), a.max_tokens, pair=pair)
    loop_path = out / "loop.json"
    loop = json.loads(loop_path.read_text(encoding="utf-8")) if loop_path.exists() else None
    s = summarise(load_needle(out), loop)
    if a.kvpress:
        cmp_path = out / "kvpress_compare.json"
        if not cmp_path.exists():
            cmp_path.write_text(json.dumps(kvpress_compare(Path(a.kvpress), pair)), encoding="utf-8")
        s["kvpress"] = json.loads(cmp_path.read_text(encoding="utf-8"))
        k = s["kvpress"]
        ad, kn = k["adakv"], k["knorm"]
        print(f"kvpress vs kvviz at budget {k['budget']} over {k['T']} tokens: adakv same cells "
              f"{ad['same_cells']}/{ad['cells']} (kept {ad['kept_a']} vs {ad['kept_b']}); knorm same cells "
              f"{kn['same_cells']}/{kn['cells']}; pyramid totals {k['kvpress_pyramid_total']} vs "
              f"{k['kvviz_pyramid_total']}; kvpress's schedule at window {k['small_window']} equals kvviz's: "
              f"{k['small_window_same_as_kvviz']}")
    print_report(s)
    for path in [a.json] * bool(a.json) + [out / "summary.json"] * a.write:
        Path(path).write_text(json.dumps(s, indent=1, default=float), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
