"""The contract for allocators (kvviz.core.policies.alloc), as `kvviz check` states it for policies.

`check_allocator(make)` runs an allocator built by `make(budget)` over layers of random
KV-head rows (random weights, ties, and one head given one-hot rows so the others' slots
are pitted against its; an allocator that asks for calibration rows gets rows of the same
kind first) and returns one RuleResult per rule:

- total: after every step no head is over its cap and the layer holds at most its
  total (heads x the layer's per-head budget); exactly down to it when over;
- floor: no eviction takes a head below its floor (a head at or under it loses nothing);
- candidates: every victim was one of its own head's candidates at that step;
- determinism: two runs give identical victims at every step;
- refusals: every parameter outside its rule, and a budget of 0 or -1, raise ValueError
  naming it.

An allocator `make` builds by hand, without a scorer factory, gets the registry's
(`make_policy`, and the registered policies as its scorer's choices), as make_policy gives
one it builds.
"""
from __future__ import annotations

import numpy as np

from kvviz.core import harness
from kvviz.core.check_rules import BIG_BUDGET, RuleResult, bad_values
from kvviz.core.policies import make_policy, scorer_names

HEADS, BUDGET, STEPS = 3, 16, 120
CALIBRATION = 48  # at most this many calibration rows for an allocator that asks for them


def _rows(rng, kind: str, g: int, n: int) -> np.ndarray:
    if kind == "ties":
        return rng.choice(np.array([0.25, 0.5, 1.0], np.float32), n)
    if kind == "onehot" and g == 0 and n:
        row = np.zeros(n, np.float32)
        row[rng.integers(n)] = 1.0
        return row
    return rng.random(n).astype(np.float32)


def _run(make, seed: int, kind: str, layers: int = 2):
    """Step one allocator over `layers` layers; (log, failures by rule)."""
    alloc = make(BUDGET)
    if alloc.factory is None:  # built by hand: the registry builds its scorers
        alloc.factory, alloc.scorers = make_policy, scorer_names()
    groups = [alloc.group(d, layers, HEADS) for d in range(layers)]
    rng = np.random.default_rng(seed)
    calibration = min(int(alloc.calibration_rows()), CALIBRATION)
    if calibration:  # rows of the same kind, read with the full cache
        for group in groups:
            group.calibrate([[_rows(rng, kind, g, t) for t in range(calibration)]
                             for g in range(HEADS)])
    log, fails = [], {}
    for t in range(STEPS):
        for d, group in enumerate(groups):
            before = None
            for g, p in enumerate(group.policies):
                raw = _rows(rng, kind, g, len(p.held())) if p.uses_attention else None
                harness.feed(p, t, raw, 1.0 if p.reads_key_norms else None,
                             1.0 if p.reads_value_norms else None)
            before = [(p.held().copy(), p.candidates().copy()) for p in group.policies]
            try:
                victims = group.evict()
                group.enforce(t)
            except ValueError as exc:
                fails.setdefault("total", f"step {t}, layer {d}: {exc}")
                return log, fails
            counts = group.held_counts()
            over = sum(len(k) for k, _ in before) - group.total
            if over > 0 and int(counts.sum()) != group.total:
                fails.setdefault("total", f"step {t}, layer {d}: holds {int(counts.sum())} after "
                                 f"evicting, its total is {group.total}")
            for g, ((kept, cand), v) in enumerate(zip(before, victims)):
                if len(kept) > group.floor and counts[g] < group.floor or \
                        len(kept) <= group.floor and len(v):
                    fails.setdefault("floor", f"step {t}, layer {d}, head {g}: held {len(kept)}, "
                                     f"left {int(counts[g])}, floor {group.floor}")
                if not np.isin(v, kept[cand]).all():
                    fails.setdefault("candidates", f"step {t}, layer {d}, head {g}: victims "
                                     f"{sorted(set(v.tolist()) - set(kept[cand].tolist()))} were "
                                     "not candidates")
            log.append([v.tolist() for v in victims])
    return log, fails


def _refusals(make_cls) -> list[str]:
    registry = {"factory": make_policy, "scorers": scorer_names()}
    problems = []
    for budget in (0, -1):
        try:
            make_cls(budget=budget, **registry)
            problems.append(f"budget={budget} was accepted")
        except ValueError as exc:
            if "budget" not in str(exc):
                problems.append(f"budget={budget} refused without naming it: {exc}")
    for spec in make_cls.specs:
        for value in bad_values(spec):
            try:
                make_cls(budget=BIG_BUDGET, **registry, **{spec.name: value})
                problems.append(f"{spec.name}={value!r} was accepted")
            except ValueError as exc:
                if spec.name not in str(exc):
                    problems.append(f"{spec.name}={value!r} refused without naming it: {exc}")
    return problems


def check_allocator(make, cls=None, seeds=(0, 1, 2)) -> list[RuleResult]:
    """Every rule above, for the allocator `make(budget)` builds (`cls`: its class, for the
    refusal probes; default the class of what `make` returns)."""
    cls = cls or type(make(BUDGET))
    fails: dict = {}
    for seed in seeds:
        for kind in ("random", "ties", "onehot"):
            log, found = _run(make, seed, kind)
            for k, v in found.items():
                fails.setdefault(k, f"{kind} rows, seed {seed}: {v}")
            if "total" not in found and _run(make, seed, kind)[0] != log:
                fails.setdefault("determinism", f"{kind} rows, seed {seed}: two runs differ")
    out = [RuleResult("contract", rule, rule not in fails, fails.get(rule, ""))
           for rule in ("total", "floor", "candidates")]
    out.append(RuleResult("determinism", "two runs, identical victims", "determinism" not in fails,
                          fails.get("determinism", "")))
    refused = _refusals(cls)
    out.append(RuleResult("refusals", "bad parameters and budgets raise ValueError naming them",
                          not refused, "; ".join(refused)))
    return out
