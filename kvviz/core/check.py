"""`kvviz check PATH[:CLASS]`: a conformance run for any policy or allocator, built-in or not.

What a policy author runs before trusting a number. Each rule is a `RuleResult`, pass or
fail, with the failing step and values; `check_policy` returns them all and the CLI exits
0 only if every one passes. The rules: the harness contract (victims ascending, unique,
drawn from the kept set and never from the slots `candidates()` excluded at that step;
exactly len(kept) - budget go when over, none at or under),
determinism (two runs with the same rng give identical logs), refusals (every parameter
outside its range, and budget < 1, raise ValueError naming it), robustness (null, all-zero
and one-hot rows never raise; the canonical trace and every shipped trace replay at
budgets 16, 64 and 256), a ratio budget (0.25x of the tokens seen, resolved at every step:
the held count follows the rule and the victims are the fixed budget's at the resolved
count), and, given the author's slow reference, a differential check on
Hypothesis scenarios (identical victims at every step, as tests/test_policies.py does).

An allocator (a registered name such as adakv, or an Allocator subclass in a file) is held
to the allocator contract instead (kvviz.core.check_alloc: total, floor, candidates,
determinism, refusals, victim order), with its default scorer; given a reference allocator
(`--reference PATH.py:FUNC`, see kvviz.core.reference_alloc), a differential check over
random scenarios too. A bare `--reference` takes each target's declared one (its class's
`reference`, as the built-ins declare theirs).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import inspect
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvviz.core import harness
from kvviz.core.budget import at_ratio, parse_budget
from kvviz.core.check_alloc import BUDGET as ALLOC_BUDGET
from kvviz.core.check_alloc import check_allocator
from kvviz.core.check_rules import BIG_BUDGET, RuleResult, bad_values
from kvviz.core.cli import one_line_error
from kvviz.core.plugins import load_file
from kvviz.core.policies import ALLOCATORS, POLICIES, Policy
from kvviz.core.policies.alloc import Allocator
from kvviz.core.policies.vectors import rope_theta_of, undoes_rope, use_rope_theta
from kvviz.core.replay import Replay, stream_vectors
from kvviz.core.trace import ArrayTrace, canonical, load_trace, packed_offset

BUDGETS = (16, 64, 256)
STEPS = 384  # rows per replay unless `full`; > 256 so every budget evicts
CONTRACT_BUDGETS = (64, 256, 1024)  # the first the class accepts with its defaults
TIE_WEIGHTS = np.array([0.0625, 0.125, 0.25, 0.5, 1.0], np.float32)


# -- loading what to check ------------------------------------------------------------------
def _checkable(c) -> bool:
    """A Policy or an Allocator subclass (not the bases themselves)."""
    return inspect.isclass(c) and issubclass(c, (Policy, Allocator)) and c not in (Policy, Allocator)


def load_target(spec: str) -> tuple[str, type]:
    """(label, class) for a registered name (a policy or an allocator), PATH.py[:CLASS] or
    MODULE[:CLASS] (a Policy or an Allocator subclass)."""
    spec = str(spec).strip()
    if spec in POLICIES:
        return spec, POLICIES[spec]
    if (pinned := _pinned(spec)) is not None:
        return spec, pinned
    if spec in ALLOCATORS:
        return spec, ALLOCATORS[spec]
    where, _, cls_name = spec.rpartition(":")
    if not where or not cls_name.isidentifier():
        where, cls_name = spec, ""
    module = _import(where)
    if cls_name:
        cls = getattr(module, cls_name, None)
        if not _checkable(cls):
            raise ValueError(f"{where}: no Policy or Allocator subclass named {cls_name!r}")
        return f"{where}:{cls_name}", cls
    found = [c for c in vars(module).values() if _checkable(c) and c.__module__ == module.__name__]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise ValueError(f"{where}: name the class as {where}:CLASS (Policy and Allocator "
                         f"subclasses defined there: {names})")
    return f"{where}:{found[0].__name__}", found[0]


def _pinned(spec: str):
    """For NAME:k=v,... of a registered policy: a subclass of its class with the given
    parameters pinned (the value is the default and the only one its rule allows, so every
    rule and the differential check's drawn scenarios run the policy as configured, and its
    declared reference with the same values); None when `spec` is not of that form."""
    import dataclasses

    from kvviz.core.policies import parse_params

    name, sep, rest = spec.partition(":")
    if not sep or name not in POLICIES or "=" not in rest:
        return None
    pairs = [kv.split("=", 1) for kv in rest.split(",") if kv.strip()]
    if any(len(kv) != 2 for kv in pairs):
        raise ValueError(f"{spec}: parameters are k=v pairs separated by commas")
    params = parse_params(name, dict(pairs), f"{spec}: ")
    base, extra = POLICIES[name], []
    for f in dataclasses.fields(base):
        if f.name in params:
            v, s = params[f.name], f.metadata["kvviz"]
            s = dataclasses.replace(s, choices=(v,)) if s.choices else (
                dataclasses.replace(s, min=v, max=v) if s.numeric else s)
            extra.append((f.name, f.type, dataclasses.field(default=v, metadata={**f.metadata, "kvviz": s})))
    cls = dataclasses.make_dataclass(base.__name__, extra, bases=(base,))
    cls.vectorised = base.vectorised  # the same rule: only the defaults moved
    return cls


def load_function(spec: str):
    """PATH.py:FUNC or MODULE:FUNC -> the callable."""
    where, _, name = str(spec).rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"--reference must be PATH.py:FUNC or MODULE:FUNC, got {spec!r}")
    fn = getattr(_import(where), name, None)
    if not callable(fn):
        raise ValueError(f"--reference {spec}: {where} has no callable {name!r}")
    return fn


def _import(where: str):
    path = Path(where)
    if where.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ValueError(f"{where}: no such file")
        try:
            return load_file(path)
        except Exception as exc:
            hint = (" (a file inside a package: name it as MODULE:NAME)"
                    if "relative import" in str(exc) else "")
            raise ValueError(f"{where}: failed to import ({type(exc).__name__}: {exc}){hint}") from None
    try:
        return importlib.import_module(where)
    except Exception as exc:
        raise ValueError(f"{where}: not a .py file and failed to import as a module "
                         f"({type(exc).__name__}: {exc})") from None


# -- helpers --------------------------------------------------------------------------------
def _make(cls, budget: int, rng_seed: int = 0, **params):
    if issubclass(cls, Policy) and cls.reads_query_rows:  # an allocator reads its scorer's
        cls = _fed_query_rows(cls)
    return _synthetic_rope(cls(budget=budget, rng=np.random.default_rng(rng_seed), **params))


def _synthetic_rope(policy):
    """`policy`, given SYNTHETIC_ROPE_THETA as the run's RoPE base if it undoes RoPE with its
    rope_theta left at the run's: the synthetic vectors (`_kn`) were never rotated, so any
    base will do, and a replay of a trace that records its own still takes that one."""
    if undoes_rope(policy) and rope_theta_of(policy) is None:
        use_rope_theta(policy, SYNTHETIC_ROPE_THETA, "kvviz check's synthetic vectors")
    return policy


@functools.lru_cache(maxsize=None)
def _fed_query_rows(cls):
    """`cls` fed synthetic per-query-head rows made from each step's row (`_query_rows`), so
    the check drives a policy that reads them on traces and rows, which have one row per
    stream; everything else is `cls`'s own."""
    class Fed(cls):
        reads_query_rows = False

        def advance(self, pos, attn, key_norm=None, value_norm=None, query_rows=None):
            given = {k: v for k, v in (("key_norm", key_norm), ("value_norm", value_norm)) if v is not None}
            super().advance(pos, attn, query_rows=_query_rows(attn, len(self.held())), **given)

    Fed.__name__ = Fed.__qualname__ = cls.__name__
    return Fed


def _query_rows(row, n: int) -> np.ndarray:
    """Synthetic rows of two query heads over `n` kept slots: the step's row and the same
    weights reversed (no attention: zeros), so the heads disagree and their mean has the
    row's mass."""
    if row is None:
        return np.zeros((2, n), np.float32)
    row = np.asarray(row, np.float32)
    return np.stack([row, row[::-1]])


def _fit_params(cls, budget: int) -> dict:
    """Defaults, with any parameter the class refuses at `budget` shrunk to budget // 2 (a
    recent window of 32 does not fit a budget of 16). Raises ValueError if nothing fits."""
    params: dict = {}
    for _ in range(len(cls.specs) + 1):
        try:
            _make(cls, budget, **params)
            return params
        except ValueError as exc:
            named = [s for s in cls.specs if s.name in str(exc) and s.name not in params]
            if not named or not getattr(named[0], "numeric", True):
                raise  # a choice, a string or a value: nothing to shrink
            s = named[0]
            params[s.name] = type(s.default)(max(s.min, min(s.default, budget // 2)))
    _make(cls, budget, **params)
    return params


def _contract_budget(cls) -> int:
    for budget in CONTRACT_BUDGETS:
        try:
            _make(cls, budget)
            return budget
        except ValueError:
            continue
    raise ValueError(f"{cls.__name__} refuses its own defaults at every budget in {CONTRACT_BUDGETS}")


def _victims(out) -> np.ndarray:
    return np.asarray(out).reshape(-1)


def _rows(rng, n: int, kinds=("random", "ties")) -> tuple[str, np.ndarray | None]:
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "null":
        return kind, None
    if kind == "zero":
        return kind, np.zeros(n, np.float32)
    if kind == "onehot":
        row = np.zeros(n, np.float32)
        if n:
            row[int(rng.integers(n))] = 1.0
        return kind, row
    if kind == "ties":
        return kind, rng.choice(TIE_WEIGHTS, size=n)
    return kind, rng.random(n, dtype=np.float32) + np.float32(1e-3)


def _norm(pos: int) -> float:
    """A synthetic key norm for position `pos`: varied, with ties."""
    return 1 + (pos * 7919 % 13) / 4


def _vnorm(pos: int) -> float:
    """A synthetic value norm for position `pos`: varied, with ties, unlike the key norm's."""
    return 0.5 + (pos * 104729 % 7) / 8


HEAD_DIM, GROUP = 4, 2  # the synthetic key and query vectors' shape
SYNTHETIC_ROPE_THETA = 10000.0  # the RoPE base undone on them (never rotated: any base will do)


def _key(pos) -> np.ndarray:
    """Synthetic keys at positions `pos` (an int or an array), float32 (..., HEAD_DIM): a
    fixed pseudo-random vector per position, so no two positions' keys tie (a tie in a key
    would be a tie in a float score two implementations may round apart)."""
    p = np.asarray(pos, np.float64)[..., None]
    i = np.arange(1, HEAD_DIM + 1)
    return (np.sin(p * 12.9898 * i + 78.233 * i) * 2).astype(np.float32)


def _query(pos: int) -> np.ndarray:
    """The synthetic query vectors of step `pos`, float32 (GROUP, HEAD_DIM), one per head."""
    return np.stack([_key(pos * 3.7 + 1000.5 + h) for h in range(GROUP)])


def _kn(policy, pos: int) -> dict:
    """The synthetic key and value norms, key vectors (at the policy's kept positions and
    `pos`) and query vectors, for a policy that reads them; else nothing."""
    out = {"key_norm": _norm(pos)} if policy.reads_key_norms else {}
    if policy.reads_value_norms:
        out["value_norm"] = _vnorm(pos)
    if getattr(policy, "reads_keys", False):
        out["keys"] = _key(np.append(np.asarray(policy.kept, np.int64), pos))
    if getattr(policy, "reads_queries", False):
        out["query"] = _query(pos)
    return out


def _fed_step(policy, t: int, row, budget):
    """One harness step given `row`, with the synthetic inputs the policy reads (`_kn`: its
    key vectors taken at its own kept positions); the victims."""
    given = _kn(policy, t)
    return harness.step(policy, t, row, budget, given.get("key_norm"), value_norm=given.get("value_norm"),
                        keys=given.get("keys"), query=given.get("query"))


def truncated(trace, steps: int | None):
    """The first `steps` rows of a trace as an ArrayTrace (generated once). Its key and value
    norms, key vectors (`keys`) and query vectors (`queries`) are the trace's own (with its
    recorded RoPE base, meta "rope_theta"), or synthetic ones (`_kn`; SYNTHETIC_ROPE_THETA)
    where it has none, so a policy that reads them replays every
    trace; that a real replay refuses such a trace is its own rule."""
    steps = trace.steps if steps is None else min(int(steps), trace.steps)
    norms = (trace.key_norms[:steps] if trace.key_norms is not None else
             np.array([_norm(t) for t in range(steps)], np.float32))
    given = getattr(trace, "value_norms", None)
    values = (given[:steps] if given is not None else
              np.array([_vnorm(t) for t in range(steps)], np.float32))
    if isinstance(trace, ArrayTrace):
        out = ArrayTrace(trace.packed[: packed_offset(steps)], steps, name=trace.name,
                         key_norms=norms, value_norms=values)
    else:
        packed = np.empty(packed_offset(steps), np.float32)
        for t in range(1, steps):
            packed[packed_offset(t):packed_offset(t + 1)] = trace.row(t)
        out = ArrayTrace(packed, steps, name=getattr(trace, "name", "trace"), key_norms=norms,
                         value_norms=values)
    try:
        keys, queries = stream_vectors(trace)  # the loaded stream's, if it has them
    except ValueError:  # a head mean over several KV heads: no one key per position
        keys = queries = None
    if keys is None or queries is None:
        keys, queries = _key(np.arange(trace.steps)), np.stack([_query(t) for t in range(trace.steps)], axis=1)
        out.meta["rope_theta"] = SYNTHETIC_ROPE_THETA  # the RoPE base a policy undoes on them
    elif "rope_theta" in (getattr(trace, "meta", None) or {}):  # its own vectors: its own RoPE base
        out.meta["rope_theta"] = trace.meta["rope_theta"]
    out.keys, out.queries = keys[:steps], queries[..., :steps, :]
    return out


@functools.lru_cache(maxsize=2)
def shipped_traces(steps: int | None) -> tuple:
    """The canonical trace and every traces/*.npz (first stored layer, head mean)."""
    from kvviz.core.paths import traces_dir

    out = [truncated(canonical(4096 if steps is None else max(int(steps), 1)), steps)]
    folder = traces_dir()
    for path in sorted(folder.glob("*.npz")) if folder else ():
        out.append(truncated(load_trace(path, name=path.name), steps))
    return tuple(out)


# -- the rules --------------------------------------------------------------------------------
CONTRACT = {
    "ascending": "victims come back ascending and unique",
    "kept": "victims are drawn from the kept set",
    "candidates": "no victim was excluded by candidates() at that step",
    "at_most": "after evict(budget) at most budget positions remain",
    "exact": "exactly len(kept) - budget are evicted when over budget",
    "under": "nothing is evicted at or under budget",
}


def check_contract(cls, steps: int = STEPS, seed: int = 0) -> list[RuleResult]:
    """Drive the policy through positive rows, letting it go 1..8 over budget before an
    evict(budget), and calling evict at and under budget too; check every call. Then two
    runs whose rows starve, then flood, the slots `candidates()` excludes, so a policy
    that overrides `choose` or `evict` and ranks those slots by its score evicts one
    whichever end of its score goes first (random rows rarely make a sink the lowest)."""
    try:
        budget = _contract_budget(cls)
    except ValueError as exc:
        return [RuleResult("contract", text, False, str(exc)) for text in CONTRACT.values()]
    policy = _make(cls, budget)
    rng = np.random.default_rng(seed)
    fails = {k: None for k in CONTRACT}
    counts = dict.fromkeys([*CONTRACT, "multi"], 0)
    pending = 0  # steps left before the next evict(budget)
    pos = 0
    try:
        for i in range(max(steps, budget + 32)):
            kept = np.array(policy.kept)
            _, row = _rows(rng, len(kept))
            policy.on_decode_step(pos, row, **_kn(policy, pos))
            pos += 1
            if pending:
                pending -= 1
                continue
            if len(policy.kept) >= budget and rng.random() < 0.1:
                pending = int(rng.integers(1, 9))  # let it grow over budget first
                continue
            for target in (budget, len(policy.kept) + 1, len(policy.kept)):
                before = np.array(policy.kept)
                excluded = _excluded(policy, before)
                victims = _victims(policy.evict(target))
                after = np.array(policy.kept)
                _judge(fails, counts, i, pos - 1, target, before, victims, after, excluded)
    except Exception as exc:
        return [RuleResult("contract", text, False, f"raised at position {pos - 1}: "
                           f"{type(exc).__name__}: {exc}") for text in CONTRACT.values()]
    for rows in ("starve", "flood"):
        _adversarial(cls, budget, steps, seed, rows, fails, counts)
    multi = counts.pop("multi")
    cover = {"ascending": f"{counts['ascending']} evictions ({multi} with more than one victim)",
             "kept": f"{counts['kept']} evictions", "at_most": f"{counts['at_most']} evict calls",
             "candidates": f"{counts['candidates']} evictions, with rows that starve and flood "
                           "the excluded slots",
             "exact": f"{counts['exact']} calls over budget", "under": f"{counts['under']} calls at or under"}
    return [RuleResult("contract", CONTRACT[k], fails[k] is None,
                       fails[k] or f"budget {budget}, {cover[k]}") for k in CONTRACT]


def _excluded(policy, kept) -> np.ndarray | str:
    """The kept positions `candidates()` excludes now, or what is wrong with its answer."""
    cand = np.asarray(policy.candidates())
    if cand.dtype != bool or cand.shape != kept.shape:
        return f"candidates() gave {cand.dtype} {cand.shape}, not one bool per kept slot"
    return kept[~cand]


def _adversarial(cls, budget: int, steps: int, seed: int, rows: str, fails, counts) -> None:
    """One run of on_decode_step + evict(budget) whose rows give the slots `candidates()`
    excludes no weight ("starve") or nearly all of it ("flood"), judging every evict; a
    raise fails the candidates rule at its position."""
    policy = _make(cls, budget)
    rng = np.random.default_rng(seed + 1)
    pos = 0
    try:
        for pos in range(max(steps, budget + 32)):
            kept = np.array(policy.kept)
            excluded = _excluded(policy, kept)
            _, row = _rows(rng, len(kept))
            if not isinstance(excluded, str):
                shut = np.isin(kept, excluded)
                row = np.where(shut, np.float32(0 if rows == "starve" else 1),
                               row if rows == "starve" else row * np.float32(1e-3))
            policy.on_decode_step(pos, row.astype(np.float32), **_kn(policy, pos))
            before = np.array(policy.kept)
            excluded = _excluded(policy, before)
            victims = _victims(policy.evict(budget))
            _judge(fails, counts, f"{pos} of the {rows} run", pos, budget, before, victims,
                   np.array(policy.kept), excluded)
    except Exception as exc:
        if fails["candidates"] is None:
            fails["candidates"] = (f"step {pos} of the {rows} run raised: "
                                   f"{type(exc).__name__}: {exc}")


def _judge(fails, counts, i, pos, target, before, victims, after, excluded=()) -> None:
    where = f"step {i} (position {pos}), evict({target}) with {len(before)} kept"

    def fail(key, text):
        if fails[key] is None:
            fails[key] = f"{where}: {text}"

    over = len(before) > target
    if len(victims):
        counts["ascending"] += 1
        counts["kept"] += 1
        counts["multi"] += len(victims) > 1
        if not (np.diff(victims) > 0).all():
            fail("ascending", f"victims {victims.tolist()}")
        stray = np.setdiff1d(victims, before)
        if len(stray):
            fail("kept", f"victims {stray.tolist()} were not kept")
        counts["candidates"] += 1
        if isinstance(excluded, str):
            fail("candidates", excluded)
        else:  # a victim that was not kept is the "kept" rule's business
            protected = np.intersect1d(victims, excluded)
            if len(protected):
                shown = np.asarray(excluded).tolist()
                shown = shown if len(shown) <= 8 else shown[:8] + ["..."]
                fail("candidates", f"victims {protected.tolist()} were excluded by candidates() "
                                   f"(excluded: {', '.join(map(str, shown))})")
    counts["at_most"] += 1
    if len(after) > target:
        fail("at_most", f"{len(after)} remain")
    if over:
        counts["exact"] += 1
        if len(victims) != len(before) - target:
            fail("exact", f"{len(victims)} evicted, expected {len(before) - target}")
    else:
        counts["under"] += 1
        if len(victims):
            fail("under", f"evicted {victims.tolist()}")


def _log(cls, trace, budget: int, rng_seed: int, params: dict) -> np.ndarray:
    replay = Replay(trace, _make(cls, budget, rng_seed, **params))
    replay.seek(trace.steps - 1)
    return replay.evicted_at


def check_determinism(cls, steps: int = STEPS) -> list[RuleResult]:
    """Two replays with the same seed must give the same eviction log, bit for bit: every
    figure kvviz prints assumes a run can be repeated."""
    trace = truncated(canonical(max(steps, 2)), steps)
    budget = _contract_budget_or(cls, 64)
    try:
        params = _fit_params(cls, budget)
        logs = [_log(cls, trace, budget, 1234, params) for _ in range(2)]
    except Exception as exc:
        return [RuleResult("determinism", "two runs with the same rng give identical logs", False,
                           f"raised: {type(exc).__name__}: {exc}")]
    differ = np.flatnonzero(logs[0] != logs[1])
    detail = f"canonical trace, {trace.steps} steps, budget {budget}, rng seed 1234"
    if len(differ):
        p = int(differ[0])
        detail = (f"position {p}: evicted at step {logs[0][p]} in run 1, {logs[1][p]} in run 2 "
                  f"(-1 = never; {len(differ)} positions differ)")
    return [RuleResult("determinism", "two runs with the same rng give identical logs",
                       not len(differ), detail)]


def _contract_budget_or(cls, default: int) -> int:
    try:
        return _contract_budget(cls)
    except ValueError:
        return default


REFUSALS = "out-of-range parameters and budget < 1 raise ValueError naming them"


def check_refusals(cls) -> list[RuleResult]:
    """Every parameter value outside its declared rule, and a budget of 0 or -1, must raise a
    ValueError that names it: a bad value is refused where it is given, not silently run."""
    problems = [_refused(cls, "budget", {}, budget) for budget in (0, -1)]
    for spec in cls.specs:
        for value in bad_values(spec):
            problems.append(_refused(cls, spec.name, {spec.name: value}, BIG_BUDGET, spec))
    failed = [p for p in problems if p is not None]
    return [RuleResult("refusals", REFUSALS, not failed,
                       "; ".join(failed) or f"{len(problems)} probes (budget 0 and -1, each "
                       "parameter outside its rule)")]


def _refused(cls, name: str, params: dict, budget: int, spec=None) -> str | None:
    """None if cls(budget, **params) raises ValueError naming `name`; else what went wrong."""
    shown = f"budget={budget}" if name == "budget" else f"{name}={params[name]!r}"
    try:
        cls(budget=budget, rng=np.random.default_rng(0), **params)
    except ValueError as exc:
        label = getattr(spec, "label", name)
        if (name in str(exc) or label in str(exc)) and "\n" not in str(exc).strip():
            return None
        if "\n" in str(exc).strip():
            return f"{shown}: refused in more than one line"
        return f"{shown}: ValueError does not name {name!r} ({exc})"
    except Exception as exc:
        return f"{shown}: raised {type(exc).__name__}, not ValueError ({exc})"
    return f"{shown}: accepted"


def check_robustness(cls, steps: int = STEPS, full: bool = False, seed: int = 0) -> list[RuleResult]:
    """Rows a real model produces (null, all-zero, one-hot) never raise, and the canonical
    trace and every shipped trace replay at budgets 16, 64 and 256 (`full`: every step)."""
    results = [_odd_rows(cls, steps, seed)]
    fails, runs = [], 0
    try:
        traces = shipped_traces(None if full else steps)
    except ValueError as exc:
        return results + [RuleResult("robustness", "replays the shipped traces", False, str(exc))]
    for budget in BUDGETS:
        try:
            params = _fit_params(cls, budget)
        except ValueError as exc:
            fails.append(f"budget {budget}: no parameters fit ({exc})")
            continue
        for trace in traces:
            replay = Replay(trace, _make(cls, budget, **params))
            try:
                replay.seek(trace.steps - 1)
                runs += 1
            except Exception as exc:
                fails.append(f"{trace.name} at budget {budget} {params or ''}: step {replay.t}: "
                             f"{type(exc).__name__}: {exc}")
    if cls.reads_key_norms:
        fails += _refuses_without_norms(cls)
    if cls.reads_value_norms:
        fails += _refuses_without_norms(cls, "value norm")
    for what in ("key", "query"):
        if getattr(cls, f"reads_{'keys' if what == 'key' else 'queries'}", False):
            fails += _refuses_without_norms(cls, what)
    names = ", ".join(tr.name for tr in traces)
    detail = "; ".join(fails) if fails else (
        f"{runs} replays: {names} x budgets {list(BUDGETS)}, "
        f"{'all' if full else f'first {steps}'} steps each")
    return results + [RuleResult("robustness", "replays the canonical and every shipped trace at "
                                 f"budgets {', '.join(map(str, BUDGETS))}", not fails, detail)]


def _refuses_without_norms(cls, what: str = "key norm") -> list[str]:
    """A policy that reads key (or value) norms must be refused (ValueError naming them) on
    a trace that has none, not replayed on made-up values."""
    bare = canonical(20)
    if what != "key norm":  # only the value norms (or the key or query vectors) missing
        full = truncated(bare, 20)
        bare = ArrayTrace(full.packed, 20, name=bare.name, key_norms=np.ones(20, np.float32),
                          value_norms=None if what == "value norm" else full.value_norms)
        bare.keys = None if what == "key" else full.keys
        bare.queries = None if what == "query" else full.queries
    named = {"key": "keys", "query": "queries"}.get(what, f"{what}s")
    try:
        Replay(bare, _make(cls, 16, **_fit_params(cls, 16))).seek(19)
    except ValueError as exc:
        return [] if named in str(exc) else [f"a trace without {named}: ValueError does "
                                             f"not name {named} ({exc})"]
    except Exception as exc:
        return [f"a trace without {named}: raised {type(exc).__name__}, not ValueError ({exc})"]
    return [f"a trace without {named} was replayed instead of refused"]


def _odd_rows(cls, steps: int, seed: int) -> RuleResult:
    """Harness steps where rows are often null, all zero or one-hot; no two nulls in a row
    (a run of nulls would leave TOVA's newcomers unobserved, a legitimate refusal)."""
    name = "null attention, all-zero and one-hot rows never raise"
    budget = _contract_budget_or(cls, 64)
    rng = np.random.default_rng(seed)
    kind, t = "", 0
    try:
        policy = _make(cls, budget, **_fit_params(cls, budget))
        kinds = ("null", "zero", "onehot", "random")
        for t in range(max(steps, budget + 64)):
            kind, row = _rows(rng, len(policy.kept), kinds if kind != "null" else kinds[1:])
            _fed_step(policy, t, row, budget)
    except Exception as exc:
        return RuleResult("robustness", name, False,
                          f"step {t} ({kind} row): {type(exc).__name__}: {exc}")
    return RuleResult("robustness", name, True, f"budget {budget}, {t + 1} steps")


RATIO = "0.25x"


def check_ratio(cls, steps: int = STEPS) -> list[RuleResult]:
    """A ratio budget (kvviz.core.budget): built at the smallest budget its defaults accept
    (the floor), stepped by the harness at 0.25x over the canonical trace's rows (synthetic
    norms where it reads them), it holds min(seen, max(floor, seen // 4)) after every step,
    and its victims are a twin's stepped at that count as a fixed budget."""
    name = (f"a ratio budget ({RATIO}): min(seen, max(floor, floor(seen / 4))) held after "
            "every step, victims the fixed budget's at that count")
    t = 0
    try:
        policy = at_ratio(lambda b: _make(cls, b), parse_budget(RATIO))
        twin, floor = copy.deepcopy(policy), policy.ratio.floor
        trace = canonical(max(steps, 8 * floor))
        for t in range(trace.steps):
            got = _fed_step(policy, t, trace.row(t)[policy.held()], policy.ratio)
            fixed = max(floor, (t + 1) // 4)  # the rule, written out
            want = _fed_step(twin, t, trace.row(t)[twin.held()], fixed)
            held = len(policy.held())
            if held != min(t + 1, fixed) or not np.array_equal(got, want):
                return [RuleResult("ratio", name, False,
                                   f"step {t}: held {held}, want {min(t + 1, fixed)} (floor {floor}); "
                                   f"victims {got.tolist()}, the fixed budget's {want.tolist()}")]
    except Exception as exc:
        return [RuleResult("ratio", name, False, f"step {t}: {type(exc).__name__}: {exc}")]
    return [RuleResult("ratio", name, True, f"floor {floor}, canonical trace, {t + 1} steps")]


def us_per_step(cls, steps: int = 1024, budget: int = 256, params=None) -> float:
    """Microseconds of CPU per replayed step on the canonical trace, the best of two runs."""
    trace = truncated(canonical(steps), steps)
    best = np.inf
    for _ in range(2):
        replay = Replay(trace, _make(cls, budget, **(params or {})))
        start = time.process_time()
        replay.seek(steps - 1)
        best = min(best, time.process_time() - start)
    return 1e6 * best / steps


@functools.lru_cache(maxsize=1)
def _tova_us() -> float:
    return us_per_step(POLICIES["tova"])


def check_speed(cls) -> list[RuleResult]:
    """The policy's cost per step beside TOVA's, measured in the same run: a figure to read
    (info), not a pass or fail, since timings on a shared machine vary."""
    try:
        params = _fit_params(cls, 256)
        mine, tova = us_per_step(cls, params=params), _tova_us()
    except Exception as exc:
        return [RuleResult("speed", "us per step", False, f"raised: {type(exc).__name__}: {exc}")]
    return [RuleResult("speed", "us per step (canonical trace, 1,024 steps, budget 256, CPU time)",
                       True, f"{mine:.1f} us/step, tova {tova:.1f} us/step ({mine / tova:.1f}x)",
                       info=True)]


def check_differential(cls, reference, examples: int = 200, shrink: bool = True) -> list[RuleResult]:
    """Hypothesis scenarios, both driven through the same calls: identical victims (or both
    refusing) at every evict and the same kept set after it. Shrinking a failure to a
    minimal scenario can take half a minute; `shrink=False` reports the first found."""
    from hypothesis import HealthCheck, Phase, given, settings

    name = "identical victims to the reference at every step"
    failure = []

    phases = [p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain)]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None, phases=phases,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(scenarios(cls))
    def run(scenario):
        compare(cls, reference, scenario, failure)

    try:
        with _scratch_storage():
            run()
    except AssertionError:
        return [RuleResult("differential", name, False, failure[-1] if failure else "mismatch")]
    except Exception as exc:
        return [RuleResult("differential", name, False, failure[-1] if failure else
                           f"raised: {type(exc).__name__}: {exc}")]
    return [RuleResult("differential", name, True, f"{examples} Hypothesis scenarios")]


@contextlib.contextmanager
def _scratch_storage():
    """Hypothesis keeps caches in ./.hypothesis even with database=None: a check run from the
    user's own folder writes there nothing, so its storage is a temporary folder (unless
    HYPOTHESIS_STORAGE_DIRECTORY says where)."""
    from hypothesis import configuration

    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    before = getattr(configuration, "__hypothesis_home_directory", None)  # a caller's own choice
    with tempfile.TemporaryDirectory(prefix="kvviz-check-") as tmp:
        configuration.set_hypothesis_home_dir(tmp)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(before)


def scenarios(cls):
    """A Hypothesis strategy of differential scenarios for the policy class `cls`: a budget up
    to 8, parameters drawn from the class's own declaration, and up to 30 steps (position
    gaps, null rows, tie-prone or arbitrary weights, evictions at, under and over the budget).
    Small budgets make every step an edge case; `compare` replays one. The test suite and
    `kvviz check --reference` draw from this one strategy."""
    from hypothesis import assume
    from hypothesis import strategies as st

    @st.composite
    def scenario(draw):
        budget = draw(st.integers(1, 8))
        params = {s.name: draw(_values(s, budget)) for s in cls.specs}
        try:
            _make(cls, budget, **params)
        except ValueError:
            assume(False)
        steps, pos = [], -1
        for _ in range(draw(st.integers(1, 30))):
            pos += draw(st.integers(1, 3))
            null = draw(st.integers(0, 6)) == 0
            evict = draw(st.one_of(st.just(budget), st.integers(0, budget + 2), st.none()))
            steps.append((pos, null, evict, draw(st.integers(0, 2**32 - 1)), draw(st.booleans())))
        return budget, params, steps, draw(st.integers(0, 2**32 - 1))

    return scenario()


def _values(spec, budget: int):
    from hypothesis import strategies as st

    choices = getattr(spec, "choices", None)
    if choices:
        return st.sampled_from(list(choices))
    if not getattr(spec, "numeric", True):  # a string, a switch or a value: its default
        return st.just(spec.default)
    high = spec.max if spec.max is not None else getattr(spec, "high", None)  # no max: the control's end
    if getattr(spec, "kind", "int") == "float" or isinstance(spec.default, float):
        return st.floats(spec.min, high, allow_nan=False)
    step = max(int(getattr(spec, "step", 1) or 1), 1)
    top = min(high, max(spec.min, budget + 2))  # small values: near the budget is interesting
    return st.integers(0, (top - spec.min) // step).map(lambda k: spec.min + k * step)


def compare(cls, reference, scenario, failure: list | None = None) -> None:
    """Replay one scenario through a fresh `cls` and `reference(budget, rng, **params)` with the
    same calls; raise AssertionError naming the budget, parameters, step, row and both kept
    sets at the first step where the victims, a refusal or the kept set differ (the message
    is also appended to `failure`)."""
    failure = [] if failure is None else failure
    budget, params, steps, seed = scenario
    fast = _make(cls, budget, seed, **params)
    try:
        ref = _synthetic_rope(reference(budget, np.random.default_rng(seed), **params))
    except Exception as exc:
        failure.append(f"budget {budget}, params {params}: the policy accepts them, the reference "
                       f"raised {type(exc).__name__}: {exc}")
        raise AssertionError(failure[-1]) from None
    for i, (pos, null, evict, seed_w, ties) in enumerate(steps):
        w = np.random.default_rng(seed_w)
        n = len(fast.kept)
        attn = None if null else (w.choice(np.array([0.0, *TIE_WEIGHTS], np.float32), size=n)
                                  if ties else w.random(n, dtype=np.float32))
        outcome = []
        for policy in (fast, ref):
            try:
                policy.on_decode_step(pos, None if attn is None else attn.copy(), **_kn(policy, pos))
                outcome.append(None if evict is None else _victims(policy.evict(evict)).tolist())
            except ValueError:
                outcome.append("refused")
        kept = [np.asarray(fast.kept).tolist(), np.asarray(ref.kept).tolist()]
        if outcome[0] != outcome[1] or kept[0] != kept[1]:
            failure.append(f"budget {budget}, params {params}, step {i} (position {pos}, "
                           f"attn {None if attn is None else attn.tolist()}, evict({evict})): "
                           f"policy {outcome[0]} kept {kept[0]}, reference {outcome[1]} kept {kept[1]}")
            raise AssertionError(failure[-1])
        if outcome[0] == "refused":
            return


def check_policy(cls, *, steps: int = STEPS, full: bool = False, reference=None,
                 examples: int = 200, shrink: bool = True, speed: bool = True) -> list[RuleResult]:
    """Every rule for one Policy subclass; `reference(budget, rng, **params)` adds the
    differential check."""
    results = check_contract(cls, steps) + check_determinism(cls, steps) + check_refusals(cls)
    results += check_robustness(cls, steps, full) + check_ratio(cls, steps)
    if reference is not None:
        results += check_differential(cls, reference, examples, shrink)
    if speed:
        results += check_speed(cls)
    return results


def check_allocator_class(cls, seeds=(0, 1, 2), reference=None,
                          scenarios: int = 60) -> list[RuleResult]:
    """The allocator contract (kvviz.core.check_alloc) for an Allocator subclass, with its
    scorer's defaults and its own, any it refuses at the contract's budget shrunk to fit
    (as for a policy); `reference(budget, rng, **params)` adds the differential check over
    `scenarios` random scenarios."""
    try:
        params = _fit_params(cls, ALLOC_BUDGET)
    except ValueError as exc:
        return [RuleResult("contract", "its defaults construct", False, str(exc))]
    return check_allocator(lambda b: _make(cls, b, **params), cls, seeds, reference, scenarios)


DECLARED = "declared"  # a bare --reference: each target's own (its class's `reference`)


def declared_reference(cls):
    """The reference `cls` declares (a class, or "module:Class" imported here); ValueError
    naming the class when it declares none."""
    ref = getattr(cls, "reference", None)
    if ref is None:
        raise ValueError(f"{cls.__name__} declares no reference: give one as "
                         "--reference PATH.py:FUNC or MODULE:FUNC")
    if isinstance(ref, str):
        return load_function(ref)
    return ref


def passed(results) -> bool:
    """Whether every rule passed (info lines always pass): the command's exit status."""
    return all(r.passed for r in results)


# -- the command ----------------------------------------------------------------------------
def parser(sub=None) -> argparse.ArgumentParser:
    """`kvviz check`'s options: its own parser, or (given `sub`) its node in kvviz's tree."""
    kw = dict(prog="kvviz check", description="Check a policy against the "
                                  "harness contract, determinism, refusals and robustness, "
                                  "or an allocator against the allocator contract.")
    p = (sub.add_parser("check", help="conformance run for a policy or an allocator: kvviz check PATH.py[:CLASS] "
                        "| NAME | --all-builtins", **kw)
         if sub is not None else argparse.ArgumentParser(**kw))
    p.error = one_line_error
    p.add_argument("target", nargs="*", help="a built-in name (tova, adakv), PATH.py[:CLASS] or "
                   "MODULE[:CLASS]")
    p.add_argument("--all-builtins", action="store_true",
                   help="check every built-in policy and allocator")
    p.add_argument("--reference", nargs="?", const=DECLARED,
                   help="PATH.py:FUNC or MODULE:FUNC, FUNC(budget, rng, **params) -> a slow "
                   "reference policy or allocator: adds the differential check; bare, each "
                   "target's declared reference")
    p.add_argument("--examples", type=int, default=None, help="Hypothesis scenarios for --reference "
                   "(a policy), random scenarios (an allocator); default 200 for a policy, 60 for an allocator")
    p.add_argument("--steps", type=int, default=STEPS, help="rows per replay (default %(default)s)")
    p.add_argument("--full", action="store_true", help="replay every row of every trace")
    from kvviz.core.plugins import add_argument as add_plugin_argument

    add_plugin_argument(p)  # --plugin: its policies and allocators are then checked by name
    p.set_defaults(func=run, parser=p)
    return p


def main(argv=None) -> int:
    """`kvviz check ...` from a list of arguments; returns the exit status."""
    return run(parser().parse_args(argv))


def _need_hypothesis() -> None:
    """Only the differential check imports Hypothesis (the `check` extra): missing, say what
    to install before any rule runs, not a traceback after them."""
    from kvviz.core.extras import MissingExtra, require

    try:
        require("--reference", "check", "hypothesis")
    except MissingExtra as exc:
        raise ValueError(f"{exc} (it draws its scenarios with Hypothesis)") from None


def run(args) -> int:
    """Run the parsed command: load plugins, check each target, print every rule's line, and
    return 0 only if all passed (1 if one failed, 2 for a bad argument)."""
    from kvviz.core.plugins import cli_load
    from kvviz.core.policies import BUILTIN_ALLOCATORS, BUILTINS

    if cli_load(getattr(args, "plugin", []), "kvviz check"):
        return 2
    try:
        targets = [load_target(t) for t in args.target]
        if args.all_builtins:
            targets += [(cls.name, cls) for cls in BUILTINS]
            targets += [(cls.name, cls) for cls in BUILTIN_ALLOCATORS]
        if not targets:
            raise ValueError("name a policy to check, or pass --all-builtins")
        if args.steps < 2 or (args.examples is not None and args.examples < 1):
            raise ValueError("--steps must be >= 2 and --examples >= 1")
        references = {}
        for label, cls in targets:
            if args.reference == DECLARED:
                references[label] = declared_reference(cls)
            elif args.reference:
                references[label] = load_function(args.reference)
        if any(not issubclass(cls, Allocator) for label, cls in targets if label in references):
            _need_hypothesis()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ok = True
    for label, cls in targets:
        reference = references.get(label)
        if issubclass(cls, Allocator):
            results = check_allocator_class(cls, reference=reference, scenarios=args.examples or 60)
        else:
            results = check_policy(cls, steps=args.steps, full=args.full, reference=reference,
                                   examples=args.examples or 200)
        good = passed(results)
        ok &= good
        print(f"{label} ({cls.__module__}.{cls.__name__}): {'PASS' if good else 'FAIL'}")
        for r in results:
            print("  " + r.line())
    return 0 if ok else 1


__all__ = ["RuleResult", "check_allocator_class", "check_policy", "load_target", "load_function", "passed", "main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
