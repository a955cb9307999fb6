"""Generated explanations against the slow reference.

Each case replays a trace (canonical with random parameters, or a prefix of a shipped real
trace) with the fast policy and with kvviz.core.reference's plain loops side by side, stops at a
random step, and checks (1) the facts `kvviz.app.explain` read from the policy against the
reference's own window sums, pooled scores, ranks and victims, computed here with sorted
Python tuples, and (2) the sentence rendered from them: every number in it is one of the
facts, and every claim parsed out of it ("higher", "the next held slot", "no held slot
within reach has a larger one", "the lowest", tie counts, "it goes") holds for the
reference's numbers.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from kvviz.app import explain as X
from kvviz.core import harness
from kvviz.core.policies import defaults, make_policy
from kvviz.core.reference import make_reference
from kvviz.core.replay import NEVER, Replay, run_policy
from kvviz.core.trace import ArrayTrace, CanonicalTrace, load_trace, packed_offset

REPO = Path(__file__).resolve().parents[1]
NUM = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def prose_prefix(steps: int, layer: int = 0) -> ArrayTrace:
    t = load_trace(REPO / "traces" / "prose.npz", layer=layer)
    return ArrayTrace(t.packed[:packed_offset(steps)], steps, name="prose-prefix",
                      tokens=t.tokens[:steps])


def ref_to(trace, ref, step: int):
    """Drive the reference through steps 0..step-1, then feed `step` (no eviction)."""
    for t in range(step):
        raw = trace.row(t)[ref.kept] if ref.uses_attention else None
        harness.step(ref, t, raw, ref.budget)
    raw = trace.row(step)[ref.kept] if ref.uses_attention else None
    harness.feed(ref, step, raw)


class RefSnap:
    """The reference SnapKV at one step: its window sums, pooled scores and ranks."""

    def __init__(self, ref):
        self.keep = list(ref.keep)
        n = len(ref.keep)
        self.cand = [ref.is_candidate(i) for i in range(n)]
        self.victims = None
        ref.evict(ref.budget)  # computes ref.sums, then drops the victims
        self.sums = list(ref.sums)
        self.radius = ref.radius
        self.pooled = [max(self.sums[max(0, i - ref.radius):i + ref.radius + 1]) for i in range(n)]

    def idx(self, pos):
        return self.keep.index(pos)

    def rank(self, values, i):
        order = sorted((values[j], self.keep[j]) for j in range(len(self.keep)) if self.cand[j])
        return order.index((values[i], self.keep[i])) + 1, len(order)

    def ties(self, values, i):
        return sorted(self.keep[j] for j in range(len(self.keep))
                      if self.cand[j] and j != i and values[j] == values[i])


def check_slot(slot: X.Slot, ref: RefSnap, victims):
    i = ref.idx(slot.position)
    assert slot.own == ref.sums[i] and slot.pooled == ref.pooled[i]
    j = ref.idx(slot.source)
    # the source is in reach, carries the pooled score, and no nearer slot does
    assert abs(i - j) == slot.distance <= ref.radius and ref.sums[j] == ref.pooled[i]
    nearer = [k for k in range(len(ref.keep)) if abs(k - i) < abs(j - i)
              and ref.sums[k] == ref.pooled[i]]
    assert not nearer
    assert list(slot.between) == ref.keep[min(i, j) + 1:max(i, j)]
    assert (slot.by_sum.rank, slot.by_sum.of) == ref.rank(ref.sums, i)
    assert sorted(slot.by_sum.ties) == ref.ties(ref.sums, i)
    assert (slot.by_pooled.rank, slot.by_pooled.of) == ref.rank(ref.pooled, i)
    assert sorted(slot.by_pooled.ties) == ref.ties(ref.pooled, i)
    assert slot.evicted == (slot.position in set(victims))


def check_pool_text(text: str, f: X.Pooling, ref: RefSnap, victims):
    n = X.number_format([f.defended.own, f.defended.pooled, f.defended.source_sum]
                        + ([f.victim.own, f.victim.pooled, f.victim.source_sum] if f.victim else []))
    d, v = f.defended, f.victim
    allowed = {n(x) for x in (d.own, d.pooled, d.source_sum)}
    ints = {f.step, f.kernel, f.radius, f.victims, d.position, d.source, d.distance,
            d.by_sum.rank, d.by_sum.of, len(d.by_sum.ties), *d.between, *d.by_sum.ties[:4],
            len(d.by_sum.ties) - 4, len(d.between) - 4}
    if v is not None:
        allowed |= {n(x) for x in (v.own, v.pooled, v.source_sum)}
        ints |= {v.position, v.source, v.distance, v.by_pooled.rank, v.by_pooled.of,
                 len(v.by_pooled.ties), *v.between, *v.by_pooled.ties[:4],
                 len(v.by_pooled.ties) - 4, len(v.between) - 4}
    allowed |= {str(x) for x in ints}
    stray = [m for m in NUM.findall(text) if m not in allowed]
    assert not stray, (stray, text)

    i = ref.idx(d.position)
    m = re.search(r"position (\d+)'s own window sum is (\S+) \(rank (\d+) of the (\d+) candidates", text)
    assert m and int(m[1]) == d.position and m[2] == n(ref.sums[i])
    assert (int(m[3]), int(m[4])) == ref.rank(ref.sums, i)
    # the defended slot would have gone on its own sum: rank within the victims' count
    assert int(m[3]) <= len(victims)
    m = re.search(r"Position (\d+), (the next held slot in the cache|(\d+) held slots away in the "
                  r"cache \((?:positions? )?([\d, and more]+) (?:is|are) held between them\)), has "
                  r"the window sum (\S+),", text)
    assert m, text
    j = ref.idx(int(m[1]))
    dist = 1 if m[3] is None else int(m[3])
    assert abs(i - j) == dist <= ref.radius
    if m[4] is not None and "more" not in m[4]:
        assert [int(x) for x in re.findall(r"\d+", m[4])] == ref.keep[min(i, j) + 1:max(i, j)]
    assert m[5] == n(ref.sums[j]) and ref.sums[j] == ref.pooled[i]
    m = re.search(r"gives (\d+) the pooled score (\S+) and it stays", text)
    assert m and m[2] == n(ref.pooled[i]) and d.position not in victims
    if v is None:
        return
    k = ref.idx(v.position)
    m = re.search(r"Position (\d+) is evicted instead: its own sum (\S+) is (higher than|equal to|"
                  r"lower than) (\d+)'s", text)
    assert m and int(m[1]) in victims and m[2] == n(ref.sums[k])
    want = ("higher than" if ref.sums[k] > ref.sums[i] else "lower than"
            if ref.sums[k] < ref.sums[i] else "equal to")
    assert m[3] == want
    if "no held slot within reach has a larger one" in text:
        assert ref.pooled[k] == ref.sums[k]
    else:
        m = re.search(r"and position (\d+), .*?, lifts its pooled score to (\S+?)[:,]", text)
        q = ref.idx(int(m[1]))
        assert abs(q - k) <= ref.radius and ref.sums[q] == ref.pooled[k] > ref.sums[k]
        assert m[2] == n(ref.pooled[k])
    others = [ref.pooled[j] for j in range(len(ref.keep)) if ref.cand[j] and j != k]
    if re.search(r"the lowest of the \d+ candidates\.", text):
        assert all(ref.pooled[k] < o for o in others)
    else:
        m = re.search(r"(\d+) other candidates? \(.*?\) ha(?:s|ve) exactly (\S+) too, and equal "
                      r"scores evict the lower position first", text.split("evicted instead")[1])
        assert m and int(m[1]) == len(ref.ties(ref.pooled, k)) and m[2] == n(ref.pooled[k])


def cases(n_cases, seed):
    rng = np.random.default_rng(seed)
    out = []
    for c in range(n_cases):
        real = c % 3 == 2
        steps = int(rng.integers(90, 200))
        budget = int(rng.integers(12, 48))
        kernel = int(rng.choice([1, 3, 5, 7, 9, 15]))
        obs = int(rng.choice([1, 2, 4, 16]))
        recent = int(rng.integers(1, min(8, budget)))
        step = int(rng.integers(budget + 1, steps - 40))
        trace = (("prose", steps, int(rng.choice([0, 14, 29]))) if real else
                 ("canonical", steps, int(rng.integers(0, 1000)), int(rng.integers(16, 96))))
        out.append((trace, budget, dict(pool_kernel=kernel, obs_window=obs,
                                        recent_window=recent), step))
    return out


def make_trace(spec):
    if spec[0] == "prose":
        return prose_prefix(spec[1], spec[2])
    _, steps, seed, epoch = spec
    return CanonicalTrace(steps=steps, seed=seed, epoch=epoch, recent=16, hh_per_epoch=6)


@pytest.mark.parametrize("spec,budget,params,step", cases(36, 15),
                         ids=lambda v: None if isinstance(v, tuple) else str(v))
def test_scores_text_against_the_reference(spec, budget, params, step):
    trace = make_trace(spec)
    full = {**defaults("snapkv"), **params}
    rp = Replay(trace, make_policy("snapkv", budget=budget, **params))
    ref = make_reference("snapkv", budget=budget, **params)
    ref_to(trace, ref, step)
    rp.seek(step - 1)
    checked = 0
    for t in range(step, trace.steps):  # on to the next step with a defended slot
        kept, scores = rp.peek(t)
        victims = rp.step().tolist()
        r = RefSnap(ref)
        assert kept.tolist() == r.keep
        assert np.asarray(scores["sums"]).tolist() == r.sums
        assert sorted(victims) == sorted(set(r.keep) - set(ref.keep))
        # defended, independently: own-sum order (sum, position) among candidates, first k
        by_sum = sorted((r.sums[j], r.keep[j]) for j in range(len(r.keep)) if r.cand[j])
        want = sorted({p for _, p in by_sum[:len(victims)]} - set(victims))
        got = X.defended(kept, scores, victims).tolist()
        assert got == want
        for pos in got[:3]:
            f = X.pooling_facts(kept, scores, victims, pos, full, t)
            check_slot(f.defended, r, victims)
            assert f.victim is not None and f.victim.position == min(victims)
            check_slot(f.victim, r, victims)
            check_pool_text(X.pooling_text(f), f, r, victims)
            checked += 1
        if checked:
            break
        if t + 1 < trace.steps:
            harness.feed(ref, t + 1, trace.row(t + 1)[ref.kept])
    # no pooling defends nothing (with pooling, a case may also find none to the end: then
    # every step's empty `defended` was checked against the reference above)
    if params["pool_kernel"] == 1:
        assert checked == 0


# --- cases the explanations once got wrong ------------------------------------------------
@pytest.fixture(scope="module")
def canonical_512():
    """The default page's state at step 512 (budget 512): the reference's sums, with the
    pooled scores at kernels 5 and 15 computed here by hand."""
    from kvviz.core.trace import canonical

    trace = canonical()
    ref = make_reference("snapkv", budget=512)
    ref_to(trace, ref, 512)
    return trace, ref


@pytest.mark.parametrize("kernel", [5, 15])
def test_default_page_step_512(canonical_512, kernel):
    trace, ref0 = canonical_512
    import copy

    ref = copy.deepcopy(ref0)
    ref.radius = (kernel - 1) // 2
    ref.params = {**ref.params, "pool_kernel": kernel}
    rp = Replay(trace, make_policy("snapkv", budget=512, pool_kernel=kernel))
    rp.seek(511)
    kept, scores = rp.peek(512)
    victims = rp.step().tolist()
    r = RefSnap(ref)
    assert sorted(victims) == sorted(set(r.keep) - set(ref.keep))
    d = X.defended(kept, scores, victims).tolist()
    assert d == [7]
    f = X.pooling_facts(kept, scores, victims, 7, {"pool_kernel": kernel}, 512)
    text = X.pooling_text(f)
    check_pool_text(text, f, r, victims)
    v = f.victim.position
    # both own sums are 0.0031731679919175804: "equal to", never "higher"
    assert r.sums[r.idx(7)] == r.sums[r.idx(v)]
    assert "its own sum 0.003173 is equal to 7's" in text and "higher" not in text
    # ...and the neighbour is not "the slot beside it": position 6 is held between 5 and 7
    if kernel == 5:
        assert "Position 5, 2 held slots away in the cache (position 6 is held between them)" in text
    else:  # kernel 15 names position 3, four slots away
        assert "Position 3, 4 held slots away in the cache (positions 4, 5, 6 are held" in text
    assert "the slot beside it" not in text


def test_guided_pooling_experiment_413_406():
    from kvviz.app.ui.experiments import pooling_example

    trace = load_trace(REPO / "traces" / "prose.npz", layer=0)
    step, f = pooling_example(trace, 128, {})
    text = X.pooling_text(f)
    rp = Replay(trace, make_policy("snapkv", budget=128))
    rp.seek(step - 1)
    kept, sc = rp.peek(step)
    victims = rp.step().tolist()
    sums = np.asarray(sc["sums"])
    pooled = np.array([sums[max(0, i - 2):i + 3].max() for i in range(len(sums))])  # by hand
    k = int(np.flatnonzero(kept == f.victim.position)[0])
    assert pooled[k] > sums[k]  # a neighbour did lift the victim
    assert "no held slot within reach" not in text
    lifter = kept[max(0, k - 2) + int(np.argmax(sums[max(0, k - 2):k + 3]))]
    assert f"and position {lifter}, the next held slot in the cache, lifts its pooled score to" in text
    # the shipped prose trace at budget 128: the experiment lands on step 512, where 406 lifts 413
    assert (step, f.victim.position, lifter) == (512, 413, 406)
    assert "lifts its pooled score to 0.06671" in text
    assert f.victim.position in victims and f.defended.position not in victims


# --- the divergence "why" text ------------------------------------------------------------
PAIRS = [("tova", "h2o"), ("tova", "snapkv"), ("h2o", "scissorhands"), ("snapkv", "h2o"),
         ("scissorhands", "tova"), ("streaming-llm", "tova")]


def why_cases(n_cases, seed):
    rng = np.random.default_rng(seed)
    return [(PAIRS[c % len(PAIRS)], int(rng.integers(0, 1000)), int(rng.integers(16, 40)),
             int(rng.integers(100, 180)), int(rng.integers(0, 1 << 30))) for c in range(n_cases)]


def small_params(name, budget):
    return {"h2o": {"recent_window": 4}, "snapkv": {"recent_window": 4, "pool_kernel": 3},
            "scissorhands": {"recent_window": 4, "history_window": 8},
            "streaming-llm": {"sinks": 2}}.get(name, {})


def ref_ranked(ref):
    """The reference's documented order at this step: (rank, position) of its candidates."""
    if hasattr(ref, "radius"):  # snapkv ranks need its sums of this step
        ref.sums = [sum(ring) for ring in ref.state]
    return sorted((ref.rank(i), ref.keep[i]) for i in range(len(ref.keep)) if ref.is_candidate(i))


@pytest.mark.parametrize("pair,seed,budget,steps,pick", why_cases(18, 3))
def test_why_text_against_the_reference(pair, seed, budget, steps, pick):
    trace = CanonicalTrace(steps=steps, seed=seed, epoch=40, recent=12, hh_per_epoch=5)
    runs = [run_policy(trace, n, budget, **small_params(n, budget)) for n in pair]
    ea, eb = runs[0].evicted_at, runs[1].evicted_at
    div = np.flatnonzero(ea != eb)
    assert len(div), "the policies never diverge: choose other cases (why_cases' seed)"
    pos = int(div[pick % len(div)])
    dstep = min(e for e in (int(ea[pos]), int(eb[pos])) if e != NEVER)
    panels, refs = [], []
    for who, name in zip("AB", pair):
        params = small_params(name, budget)
        rp = Replay(trace, make_policy(name, budget=budget, **params))
        rp.seek(dstep - 1)
        kept, scores = rp.peek(dstep)
        victims = rp.step()
        panels.append(dict(label=f"{who}: {name}", policy=name, kept=kept, scores=scores,
                           victims=victims))
        ref = make_reference(name, budget=budget, **params)
        ref_to(trace, ref, dstep)
        refs.append(ref)
    facts = [X.decision(w, p, pos) for w, p in zip("AB", panels)]
    text = X.why_text(pos, ea, eb, facts, dstep)
    for who, e in (("A", int(ea[pos])), ("B", int(eb[pos]))):
        said = re.search(rf"\b{who} evicted it (at step (\d+)|never \(held to the end\))"
                         if who == "A" else r", B (at step (\d+)|never \(held to the end\))", text)
        assert said and (int(said[2]) if said[2] else NEVER) == e
    assert f"evicted it first, at step {dstep}." in text
    for d, ref, name in zip(facts, refs, pair):
        before = list(ref.keep)
        order = ref_ranked(ref)
        gone = ref.evict(budget).tolist()
        assert d.evicted == (pos in gone)
        part = text.split(f" {d.who}, {name},", 1)[1].split(". ")[0]
        if pos not in before:
            assert d.held is False and part.startswith(" no longer held it")
            continue
        if all(p != pos for _, p in order):
            assert "could not evict it" in part
            continue
        if name == "streaming-llm":
            assert "has no score to rank by" in part
        else:
            r = [p for _, p in order].index(pos) + 1
            m = re.search(r"ranks it (\d+) of (\d+) candidates on its (.+?) (\S+?)(?: \(tied with "
                          r"(\d+) other candidates?;|,|;)", part)
            assert m and (int(m[1]), int(m[2])) == (r, len(order)), (part, r, len(order))
            mine = next(k for k, p in order if p == pos)
            ties = sum(1 for k, p in order if k == mine and p != pos)
            assert int(m[5] or 0) == ties
            if "evicts the first" in part:  # the claim: the victims are the first k ranked
                k = int(re.search(r"evicts the first (\d+)", part)[1])
                assert k == len(gone) and sorted(p for _, p in order[:k]) == sorted(gone)
        assert part.rstrip(".").endswith("it goes" if pos in gone else "it stays")


# --- survival captions ------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_survival_text_counts(seed):
    rng = np.random.default_rng(seed)
    trace = CanonicalTrace(steps=150, seed=seed, epoch=50)
    ev = run_policy(trace, "h2o", int(rng.integers(8, 40)), recent_window=4).evicted_at
    step = int(rng.integers(0, 150))
    f = X.survival_facts("A", "h2o", ev, step, sinks=4, recent=64)
    held = [p for p in range(step + 1) if ev[p] == NEVER or ev[p] > step]  # the held rule
    assert f.sinks_held == len([p for p in held if p < 4]) and f.sinks == min(4, step + 1)
    assert f.recent_held == len([p for p in held if p > step - 64])
    assert f.recent == min(64, step + 1)
    text = X.survival_text([f], step)
    assert (f"holds {f.sinks_held} of the {f.sinks} sinks and {f.recent_held} of the "
            f"{f.recent} newest positions") in text


def test_relations_and_number_format():
    assert X.relation(1.0, 1.0) == "equal to" and X.relation(2.0, 1.0) == "higher than"
    n = X.number_format([0.0031731679919175804, 0.0031731679919175804, 0.00317317])
    assert n(0.0031731679919175804) != n(0.00317317)  # different values never print the same


@pytest.mark.parametrize("seed", range(3))
def test_avg_pooling_text_names_no_source(seed):
    """With pooling=avg a pooled score is a mean, not any one slot's sum: the text says so."""
    trace = CanonicalTrace(steps=160, seed=seed, epoch=40, recent=12, hh_per_epoch=5)
    params = dict(pool_kernel=5, obs_window=4, recent_window=4, pooling="avg")
    rp = Replay(trace, make_policy("snapkv", budget=24, **params))
    ref = make_reference("snapkv", budget=24, **params)
    ref_to(trace, ref, 40)
    rp.seek(39)
    for t in range(40, trace.steps):
        kept, scores = rp.peek(t)
        victims = rp.step().tolist()
        ref.sums = [sum(ring) for ring in ref.state]
        ref_pooled = [ref.rank(i) for i in range(len(ref.keep))]
        assert np.asarray(scores["pooled"]).tolist() == ref_pooled
        ref.evict(24)
        got = X.defended(kept, scores, victims).tolist()
        if got:
            f = X.pooling_facts(kept, scores, victims, got[0], {**defaults("snapkv"), **params}, t)
            text = X.pooling_text(f)
            i = kept.tolist().index(got[0])
            assert f.defended.pooled == ref_pooled[i] and "max-pool" not in text
            assert "Averaging over its poolKernel of 5 (2 held slots each side)" in text
            return
        harness.feed(ref, t + 1, trace.row(t + 1)[ref.kept]) if t + 1 < trace.steps else None
    pytest.fail("no defended slot under avg pooling")


def test_the_pooling_neighbourhood_is_the_policys_declaration():
    """The explanation's kernel, radius and kind come from SnapKV itself: a policy object's
    `pool_radius` (the reach its `pool()` uses, checked against a plain max over each slot's
    neighbours), and for a parameter dict the declared defaults of what it does not give."""
    rng = np.random.default_rng(3)
    declared = defaults("snapkv")
    for kernel in (1, 3, 5, 7, 15):
        p = make_policy("snapkv", budget=64, pool_kernel=kernel)
        r = p.pool_radius
        assert 2 * r + 1 == kernel  # an odd width: r held slots each side of the centre
        sums = rng.random(20)
        plain = [max(sums[max(0, i - r): i + r + 1]) for i in range(20)]
        assert p.pool(sums).tolist() == plain
        assert X.snapkv_pooling(p) == (kernel, r, "max")
        assert X.snapkv_pooling({"pool_kernel": kernel}) == (kernel, r, declared["pooling"])
        assert X.unpooled(p) == X.unpooled({"pool_kernel": kernel}) == (kernel == 1)
    avg = make_policy("snapkv", budget=64, pooling="avg")
    assert X.snapkv_pooling(avg) == X.snapkv_pooling({"pooling": "avg"})
    assert X.snapkv_pooling({})[:1] == (declared["pool_kernel"],)
    assert not X.unpooled({}) and not X.unpooled(make_policy("tova", budget=64))
