"""The contract for allocators (kvviz.core.policies.alloc), as `kvviz check` states it for policies.

`check_allocator(make)` runs an allocator built by `make(budget)` over layers of random
KV-head rows (random weights, ties, and one head given one-hot rows so the others' slots
are pitted against its; an allocator that asks for calibration rows gets rows of the same
kind first) and returns one RuleResult per rule:

- total: after every step no head is over its cap and the layer holds at most its
  total (heads x the layer's per-head budget): room may be left unused, never exceeded;
- victims: the victims reported for each head are exactly the positions that left its held
  set, each once (the harness's check, kvviz.core.harness.evict_layer);
- floor: no eviction takes a head below its floor (a head at or under it loses nothing);
- candidates: every victim was one of its own head's candidates at that step;
- determinism: two runs give identical victims at every step;
- refusals: every parameter outside its rule, and a budget of 0 or -1, raise ValueError
  naming it, in one line;
- order: each victim is the lowest-priority candidate (its scorer's `priority()`, read
  before the step's eviction) the allocator may take, by the order it declares
  (`victim_order`): "per_head", within the victim's own head; "shared", across the layer's
  heads too, except a head left at its floor. Ties may go either way. An allocator that
  declares None, or a head whose policy has no priority, is not held to it;
- differential (given a reference, `check_reference`): identical victims and held sets per
  head to a slow reference allocator at every step of random scenarios (budgets, heads,
  layers, parameters and scorers drawn at random).

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
    order = getattr(alloc, "victim_order", None)
    groups = [alloc.group(d, layers, HEADS) for d in range(layers)]
    rng = np.random.default_rng(seed)
    calibration = min(int(alloc.calibration_rows()), CALIBRATION)
    if calibration:  # rows of the same kind, read with the full cache
        rows = [[[_rows(rng, kind, g, t) for t in range(calibration)] for g in range(HEADS)]
                for _ in groups]
        if alloc.plans_layers:  # its layers' budgets from every layer's rows, as a run does
            try:
                budgets = alloc.planned_budgets(rows, layers)
            except ValueError as exc:
                return [], {"total": f"its layer plan: {exc}"}
            groups = [alloc.group(d, layers, HEADS, budget=b) for d, b in enumerate(budgets)]
        for group, layer_rows in zip(groups, rows):
            group.calibrate(layer_rows)
    log, fails = [], {}
    for t in range(STEPS):
        for d, group in enumerate(groups):
            before = None
            for g, p in enumerate(group.policies):
                raw = _rows(rng, kind, g, len(p.held())) if p.uses_attention else None
                harness.feed(p, t, raw, 1.0 if p.reads_key_norms else None,
                             1.0 if p.reads_value_norms else None)
            before = [(p.held().copy(), p.candidates().copy()) for p in group.policies]
            prios = [_priority(p) for p in group.policies] if order else None
            try:  # the harness's own step: caps, the total and the reported victims checked
                victims = harness.evict_layer(group, t)
            except harness.VictimError as exc:
                fails.setdefault("victims", f"step {t}, layer {d}: {exc}")
                return log, fails
            except ValueError as exc:
                fails.setdefault("total", f"step {t}, layer {d}: {exc}")
                return log, fails
            counts = group.held_counts()  # at most the total (enforced above): room may stay unused
            for g, ((kept, cand), v) in enumerate(zip(before, victims)):
                if len(kept) > group.floor and counts[g] < group.floor or \
                        len(kept) <= group.floor and len(v):
                    fails.setdefault("floor", f"step {t}, layer {d}, head {g}: held {len(kept)}, "
                                     f"left {int(counts[g])}, floor {group.floor}")
                if not np.isin(v, kept[cand]).all():
                    fails.setdefault("candidates", f"step {t}, layer {d}, head {g}: victims "
                                     f"{sorted(set(v.tolist()) - set(kept[cand].tolist()))} were "
                                     "not candidates")
            if order and "order" not in fails:
                wrong = order_broken(order, before, prios, victims, counts, group.floor)
                if wrong:
                    fails["order"] = f"step {t}, layer {d}, {wrong}"
            log.append([v.tolist() for v in victims])
    return log, fails


def _priority(policy):
    """The scorer's priority per held slot now (float64), or None where it has none."""
    try:
        return np.asarray(policy.priority(), np.float64).copy()
    except NotImplementedError:
        return None


def order_broken(order: str, before, prios, victims, counts, floor: int) -> str:
    """What breaks the declared victim order at one step ('' if nothing): `before[g]` is head
    g's (held positions, candidates mask) before the eviction, `prios[g]` its scorer's
    priority then (None: no order to keep), `victims[g]` the positions it lost, `counts[g]`
    what it holds after."""
    lowest = []  # per head: (priority, position) of its lowest candidate left, or None
    for g, ((kept, cand), prio, v) in enumerate(zip(before, prios, victims)):
        if prio is None:
            lowest.append(None)
            continue
        gone = np.isin(kept, v)
        left = np.flatnonzero(cand & ~gone)
        low = (float(prio[left].min()), int(kept[left[np.argmin(prio[left])]])) if len(left) else None
        lowest.append(low)
        for i in np.flatnonzero(gone):
            if low is not None and prio[i] > low[0]:
                return (f"head {g}: the victim at position {int(kept[i])} (priority {prio[i]:.6g}) went "
                        f"while its own candidate at position {low[1]} (priority {low[0]:.6g}) stayed "
                        "(a head's victims are its lowest-priority candidates)")
    if order != "shared":
        return ""
    open_heads = [h for h, low in enumerate(lowest) if low is not None and counts[h] > floor]
    if not open_heads:
        return ""
    h = min(open_heads, key=lambda k: lowest[k])
    for g, ((kept, _), prio, v) in enumerate(zip(before, prios, victims)):
        if prio is None:
            continue
        for i in np.flatnonzero(np.isin(kept, v)):
            if prio[i] > lowest[h][0]:
                return (f"head {g}: the victim at position {int(kept[i])} (priority {prio[i]:.6g}) "
                        f"went while head {h}'s candidate at position {lowest[h][1]} (priority "
                        f"{lowest[h][0]:.6g}) stayed, head {h} holding {int(counts[h])}, above its "
                        f"floor {floor} (shared: the lowest priority across the heads goes)")
    return ""


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
        except Exception as exc:
            problems.append(f"budget={budget} raised {type(exc).__name__}, not ValueError ({exc})")
    for spec in make_cls.specs:
        for value in bad_values(spec):
            try:
                make_cls(budget=BIG_BUDGET, **registry, **{spec.name: value})
                problems.append(f"{spec.name}={value!r} was accepted")
            except ValueError as exc:
                text = str(exc).strip()
                if spec.name not in text and spec.label not in text:
                    problems.append(f"{spec.name}={value!r} refused without naming it: {text}")
                elif "\n" in text:
                    problems.append(f"{spec.name}={value!r} refused in more than one line")
            except Exception as exc:
                problems.append(f"{spec.name}={value!r} raised {type(exc).__name__}, not ValueError "
                                f"({' '.join(str(exc).split())})")
    return problems


ORDER = "each victim is the lowest-priority candidate it may take"


def check_allocator(make, cls=None, seeds=(0, 1, 2), reference=None,
                    scenarios: int = 60) -> list[RuleResult]:
    """Every rule above, for the allocator `make(budget)` builds (`cls`: its class, for the
    refusal probes and the differential; default the class of what `make` returns);
    `reference(budget, rng, **params)` adds the differential check."""
    cls = cls or type(make(BUDGET))
    fails: dict = {}
    for seed in seeds:
        for kind in ("random", "ties", "onehot"):
            log, found = _run(make, seed, kind)
            for k, v in found.items():
                fails.setdefault(k, f"{kind} rows, seed {seed}: {v}")
            if not {"total", "victims"} & set(found) and _run(make, seed, kind)[0] != log:
                fails.setdefault("determinism", f"{kind} rows, seed {seed}: two runs differ")
    out = [RuleResult("contract", rule, rule not in fails, fails.get(rule, ""))
           for rule in ("total", "victims", "floor", "candidates")]
    out.append(RuleResult("determinism", "two runs, identical victims", "determinism" not in fails,
                          fails.get("determinism", "")))
    refused = _refusals(cls)
    out.append(RuleResult("refusals", "bad parameters and budgets raise ValueError naming them",
                          not refused, "; ".join(refused)))
    order = getattr(cls, "victim_order", None)
    if order is None:
        out.append(RuleResult("order", ORDER, True, "it declares no victim order "
                              "(victim_order = None)", info=True))
    else:
        out.append(RuleResult("order", f"{ORDER} ({order.replace('_', ' ')})", "order" not in fails,
                              fails.get("order", "")))
    if reference is not None:
        out.append(check_reference(cls, reference, scenarios))
    return out


# -- the differential check -------------------------------------------------------------------
SCORERS = (("tova", {}), ("h2o", {"recent_window": 1}),
           ("snapkv", {"recent_window": 1, "pool_kernel": 3, "obs_window": 3}))
DIFFERENTIAL = "identical victims and held sets per head to the reference at every step"


def _draw(spec, rng, budget: int):
    """A value inside a numeric parameter's rule, small near the budget; others keep their default."""
    if not getattr(spec, "numeric", False):
        return spec.default
    high = spec.max if spec.max is not None else spec.high
    if spec.kind == "float":
        return float(rng.choice([spec.min, high, round(float(rng.uniform(spec.min, high)), 2)]))
    top = int(min(high, max(spec.min, budget + 2)))
    step = int(spec.step or 1)
    value = int(spec.min) + step * int(rng.integers(0, (top - int(spec.min)) // step + 1))
    return value + (1 - value % 2) if spec.odd_only else value


def _scenario(cls, rng):
    """(allocator, heads, layers, row kind, steps), or None when the class refuses what was
    drawn."""
    budget = int(rng.integers(2, 13))
    scorer, scorer_params = SCORERS[int(rng.integers(len(SCORERS)))]
    own = {s.name: _draw(s, rng, budget) for s in cls.specs if s.name != "scorer"}
    layers = int(rng.integers(1, 4))
    try:
        probe = make_policy(scorer, budget=budget, **scorer_params)
        alloc = cls(budget=budget, rng=np.random.default_rng(0), factory=make_policy,
                    scorers=scorer_names(), scorer=scorer, scorer_params=dict(probe.params), **own)
        alloc.layer_budgets(layers)
    except ValueError:
        return None
    kind = ("random", "ties", "onehot")[int(rng.integers(3))]
    return alloc, int(rng.integers(1, 5)), layers, kind, int(rng.integers(8, 40))


def check_reference(cls, reference, scenarios: int = 60, seed: int = 0) -> RuleResult:
    """The allocator class `cls` and `reference(budget, rng, **params)` (see
    kvviz.core.reference_alloc) stepped through the same random scenarios: after every
    step of every layer, the victims and the held positions of each head must be equal, and
    a refusal must be both's."""
    rng = np.random.default_rng(seed)
    done = tries = 0
    while done < scenarios and tries < 20 * scenarios:
        tries += 1
        drawn = _scenario(cls, rng)
        if drawn is None:
            continue
        done += 1
        wrong = _compare(drawn, reference, int(rng.integers(2 ** 32)))
        if wrong:
            return RuleResult("differential", DIFFERENTIAL, False, f"scenario {done}: {wrong}")
    if not done:
        return RuleResult("differential", DIFFERENTIAL, False, f"none of {tries} scenarios drawn "
                          "was accepted by the allocator")
    return RuleResult("differential", DIFFERENTIAL, True, f"{done} random scenarios")


def _compare(drawn, reference, seed: int) -> str:
    """'' when the allocator and its reference agree over one scenario; else where not."""
    alloc, heads, layers, kind, steps = drawn
    params = {"scorer": alloc.scorer, **alloc.params}
    what = f"budget {alloc.budget}, {heads} heads, {layers} layers, {kind} rows, params {params}"
    try:
        groups = [alloc.group(d, layers, heads) for d in range(layers)]
    except ValueError as exc:
        groups = f"ValueError: {exc}"
    try:
        ref = reference(alloc.budget, np.random.default_rng(0), **params)
        refs = [ref.group(d, layers, heads) for d in range(layers)]
    except Exception as exc:
        refs = f"{type(exc).__name__}: {exc}"
    if isinstance(groups, str) or isinstance(refs, str):  # refused: both, or a mismatch
        if isinstance(groups, str) and isinstance(refs, str):
            return ""
        return (f"{what}: building its layers, the allocator "
                f"{'raised ' + groups if isinstance(groups, str) else 'accepts them'}, the reference "
                f"{'raised ' + refs if isinstance(refs, str) else 'accepts them'}")
    rng = np.random.default_rng(seed)
    calibration = min(int(alloc.calibration_rows()), CALIBRATION)
    if calibration:
        rows = [[[_rows(rng, kind, g, t) for t in range(calibration)] for g in range(heads)] for _ in groups]
        if alloc.plans_layers:  # every layer's budget from every layer's rows, both ways
            try:
                budgets = alloc.planned_budgets(rows, layers)
            except ValueError as exc:
                budgets = f"ValueError: {exc}"
            try:
                want = ref.plan_layers(rows)
                want = [alloc.budget] * layers if want is None else list(want)
            except Exception as exc:
                want = f"{type(exc).__name__}: {exc}"
            if isinstance(budgets, str) or isinstance(want, str) or budgets != want:
                if isinstance(budgets, str) and isinstance(want, str):
                    return ""
                return f"{what}: planned layer budgets {budgets}, the reference's {want}"
            groups = [alloc.group(d, layers, heads, budget=b) for d, b in enumerate(budgets)]
            refs = [ref.group(d, layers, heads, budget=b) for d, b in enumerate(budgets)]
        for group, rgroup, layer_rows in zip(groups, refs, rows):
            group.calibrate(layer_rows)
            rgroup.calibrate(layer_rows)
    for t in range(steps):
        for d, (group, rgroup) in enumerate(zip(groups, refs)):
            for g, (p, r) in enumerate(zip(group.policies, rgroup.heads)):
                raw = _rows(rng, kind, g, len(p.held())) if p.uses_attention else None
                norms = (1.0 + (t * 7 + g) % 5 / 4 if p.reads_key_norms else None,
                         0.5 + (t * 3 + g) % 7 / 8 if p.reads_value_norms else None)
                for one in (p, r):
                    harness.feed(one, t, raw, *norms)
            got, want = _evict(group), _evict(rgroup)
            held = ([p.held().tolist() for p in group.policies],
                    [np.asarray(r.kept).tolist() for r in rgroup.heads])
            if got != want or (got != "refused" and held[0] != held[1]):
                return (f"{what}: step {t}, layer {d}: allocator victims {got} held {held[0]}; "
                        f"reference victims {want} held {held[1]}")
            if got == "refused":
                return ""
    return ""


def _evict(group):
    """Victims' positions per head as lists, or 'refused' for a ValueError."""
    try:
        return [np.asarray(v).tolist() for v in group.evict()]
    except ValueError:
        return "refused"
