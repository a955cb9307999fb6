"""A small synthetic pass-key results folder in `kvviz needle`'s schema, for the view's tests.

No model runs: each policy's eviction log is drawn from a seeded rng, with one rule that makes
the folder tell a story the tests can check: TOVA at the smaller budget loses the key (in one
layer) at the cells listed in TOVA_FORGETS, while H2O and Scissorhands keep it there. An
answer is correct iff every key token is held in every layer at the end of the prompt, the
way the real runs are scored by their digits. The tables come from kvviz.model.needle's writer.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kvviz.model.needle.results import run_id, save_run, write_tables

KEY = "7391"
LENGTHS = (48, 96)
DEPTHS = (10, 50, 90)
SEEDS = (0, 1)
BUDGETS = (16, 32)
POLICIES = ("tova", "h2o", "scissorhands", "streaming-llm")
LAYERS, NEW = 3, 4
TOVA_FORGETS = {(96, 50, 0), (96, 90, 1), (48, 10, 0)}  # (length, depth, seed) at budget 16
H2O_SC_FORGET: set = set()  # cells where h2o and scissorhands lose the key at budget 16
SC_FORGET: set = set()  # cells where scissorhands alone loses the key at budget 16
K1_FORGETS: set = set()  # cells where "snapkv1" (snapkv, poolKernel 1) loses it at budget 16
SPECS = {"snapkv1": ("snapkv", {"pool_kernel": 1})}  # fixture names for parameterised policies
FILLER = ["The", " grass", " is", " green", ".", " The", " sky", " is", " blue", "."]


def _label(policy, budget):
    return "full" if policy == "full" else f"{policy}@{budget}"


def _held(ev, positions, step):
    """(L, G) share of `positions` held after `step` (the harness's rule)."""
    e = ev[..., positions]
    return ((e < 0) | (e > step)).mean(-1)


def write_run(out: Path, length: int, depth: int, seed: int, mode: str, gran: str,
              budgets=BUDGETS, policies=POLICIES) -> None:
    rng = np.random.default_rng([length, int(depth * 10), seed, mode == "prefill", gran == "kv-head"])
    G = 2 if gran == "kv-head" else 1
    T0, T = length, length + NEW
    q0 = T0 - 8
    k0 = 4 + int(round(depth / 100 * (q0 - 12)))
    key_pos = list(range(k0, k0 + len(KEY)))
    tokens = [FILLER[i % len(FILLER)] for i in range(T0)]
    for i, p in enumerate(key_pos):
        tokens[p] = KEY[i]
    tokens[q0:] = [" What", " is", " the", " key", "?", " The", " key", " is"]
    configs = [{"policy": "full", "params": {}, "budget": None, "label": "full"}]
    configs += [{"policy": SPECS.get(p, (p, {}))[0], "params": SPECS.get(p, (p, {}))[1],
                 "budget": b, "label": _label(p, b), "name": p} for b in budgets for p in policies]
    C = len(configs)
    ev = np.full((C, LAYERS, G, T), -1, np.int32)
    for c, cfg in enumerate(configs[1:], 1):
        for li in range(LAYERS):
            for g in range(G):
                for p in range(T0):
                    if p in key_pos or rng.random() > 0.4:
                        continue
                    ev[c, li, g, p] = T0 - 1 if mode == "prefill" else rng.integers(p, T0)
        small, cell = cfg["budget"] == min(budgets), (length, depth, seed)
        forgets = {"tova": cell in TOVA_FORGETS and small, "h2o": cell in H2O_SC_FORGET and small,
                   "scissorhands": (cell in H2O_SC_FORGET or cell in SC_FORGET) and small,
                   "snapkv1": cell in K1_FORGETS and small,
                   "streaming-llm": depth < 90}.get(cfg.pop("name"), False)
        if forgets:  # lose the key in layer 1 (every head), a few steps after it was read
            ev[c, 1, :, key_pos] = T0 - 1 if mode == "prefill" else key_pos[-1] + 3
    held_end = _held(ev, key_pos, T0 - 1)       # (C, L, G)
    correct = [bool((held_end[c] == 1).all()) for c in range(C)]
    answers = [f" {KEY}." if ok else " the key is the key" for ok in correct]
    meta = dict(id=run_id(length, depth, seed, mode, gran), length=length, depth=depth,
                seed=seed, prompt_mode=mode, granularity=gran, key=KEY, key_positions=key_pos,
                question_start=q0, prompt_len=T0, max_new_tokens=NEW, haystack="synthetic",
                model={"name": "synthetic"}, kvviz_version="test", configs=configs,
                answers=answers, correct=correct, agreement=[1.0] * C, layers=LAYERS,
                kv_heads=G)
    save_run(out, meta, np.arange(T0), tokens, np.tile(np.arange(NEW), (C, 1)), ev)


def write_results(out, modes=("decode", "prefill"), grans=("layer",), lengths=LENGTHS,
                  depths=DEPTHS, seeds=SEEDS, **kw) -> Path:
    """The whole folder: runs/*.npz, then results.csv/json by kvviz.model.needle's own writer."""
    out = Path(out)
    for m in modes:
        for g in grans:
            for n in lengths:
                for d in depths:
                    for s in seeds:
                        write_run(out, n, d, s, m, g, **kw)
    write_tables(out)
    return out
