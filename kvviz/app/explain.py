"""The facts behind every sentence the page generates, read from a policy's own state.

Each explanation is two steps: a facts function reads ranks, sums and pooled scores out of
the policy's `scores()` at one step (and its eviction log), and a text function renders
sentences from those facts alone. Comparisons are computed, never assumed by a template:
"higher" only when strictly higher, equal values said as a tie and the tie-break named
(every ranking policy here evicts the lower position among equals, the cards' rule).
No Streamlit here: the tests check the facts against kvviz.core.reference and the text
against the facts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvviz.core.policies import POLICIES, defaults, param_specs, rank_of
from kvviz.core.replay import NEVER, held_mask

TIE_RULE = "equal scores evict the lower position"


def relation(a: float, b: float) -> str:
    """'higher than', 'equal to' or 'lower than': a compared with b, exactly."""
    return "higher than" if a > b else "lower than" if a < b else "equal to"


def number_format(values):
    """A formatter with 4 significant digits, more where needed so that values that differ
    print differently (equal values print the same, so a tie reads as one)."""
    vals = sorted({float(v) for v in values if v is not None})
    p = 4
    while p < 17 and len({f"{v:.{p}g}" for v in vals}) < len(vals):
        p += 1
    return lambda v: f"{float(v):.{p}g}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _positions(ps, limit: int = 4) -> str:
    ps = [int(p) for p in ps]
    shown = ", ".join(map(str, ps[:limit]))
    return shown + (f" and {len(ps) - limit} more" if len(ps) > limit else "")


def _same(vals: np.ndarray, v: float) -> np.ndarray:
    """Where `vals` is exactly `v` (NaN counts as equal to NaN: both unobserved)."""
    return (vals == v) | (np.isnan(vals) & np.isnan(v))


# --- ranks ----------------------------------------------------------------------------
def ranked(kept, values, candidate) -> np.ndarray:
    """Indices into `kept` of the candidates, lowest value first, ties to the lower position."""
    kept = np.asarray(kept)
    idx = np.flatnonzero(np.asarray(candidate, bool))
    vals = np.asarray(values, np.float64)[idx]
    return idx[np.lexsort((kept[idx], vals))]


@dataclass(frozen=True)
class Rank:
    rank: int          # 1 = first to go among the candidates; 0 = not a candidate
    of: int            # number of candidates
    ties: tuple        # other candidates' positions with exactly the same value


def rank_in(kept, values, candidate, i: int) -> Rank:
    order = ranked(kept, values, candidate)
    where = np.flatnonzero(order == i)
    if not len(where):
        return Rank(0, len(order), ())
    vals = np.asarray(values, np.float64)
    same = [int(np.asarray(kept)[j]) for j in order if j != i and vals[j] == vals[i]]
    return Rank(int(where[0]) + 1, len(order), tuple(same))


# --- SnapKV's pooling -------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """One held slot at one step, as SnapKV scored it."""

    position: int
    own: float               # its window sum
    pooled: float            # its pooled score
    source: int | None       # the position whose window sum is the pooled score (max pooling)
    source_sum: float | None
    distance: int            # held slots from it to `source` (0: itself)
    between: tuple           # positions held between it and `source`
    by_sum: Rank
    by_pooled: Rank
    evicted: bool


def pooling_source(kept, sums, pooled, i: int, radius: int):
    """(index, distance) of the slot within `radius` held slots of slot i whose window sum
    is i's max-pooled score: the nearest such slot, ties to the lower position; None if
    none in reach holds that sum (not max pooling)."""
    lo, hi = max(0, i - radius), min(len(sums) - 1, i + radius)
    js = [j for j in range(lo, hi + 1) if sums[j] == pooled[i]]
    if not js:
        return None
    j = min(js, key=lambda j: (abs(j - i), int(kept[j])))
    return j, abs(j - i)


def slot_facts(kept, scores, victims, position: int, radius: int) -> Slot:
    kept = np.asarray(kept)
    sums = np.asarray(scores["sums"], np.float64)
    pooled = np.asarray(scores["pooled"], np.float64)
    cand = np.asarray(scores["candidate"], bool)
    i = int(np.flatnonzero(kept == position)[0])
    src = pooling_source(kept, sums, pooled, i, radius)
    j, d = src if src else (None, 0)
    between = tuple(int(p) for p in kept[min(i, j) + 1:max(i, j)]) if j is not None else ()
    return Slot(position=int(position), own=float(sums[i]), pooled=float(pooled[i]),
                source=None if j is None else int(kept[j]),
                source_sum=None if j is None else float(sums[j]), distance=int(d),
                between=between, by_sum=rank_in(kept, sums, cand, i),
                by_pooled=rank_in(kept, pooled, cand, i),
                evicted=bool(np.isin(position, np.asarray(victims))))


def defended(kept, scores, victims) -> np.ndarray:
    """SnapKV's slots kept only because pooling lifted them: with k victims this step, the
    candidates whose own window sum ranks among the k lowest (ties to the lower position)
    that were not evicted. Empty without victims or without pooled scores."""
    victims = np.asarray(victims, np.int64)
    if "sums" not in scores or "pooled" not in scores or not len(victims):
        return np.empty(0, np.int64)
    kept = np.asarray(kept)
    order = ranked(kept, scores["sums"], scores["candidate"])[:len(victims)]
    return np.setdiff1d(kept[order], victims).astype(np.int64)


@dataclass(frozen=True)
class Pooling:
    step: int
    kernel: int
    radius: int
    kind: str                # "max" or "avg"
    victims: int             # how many slots were evicted at this step
    defended: Slot
    victim: Slot | None      # the first victim (lowest position)
    victim_ties: tuple = ()  # kept candidates with exactly the victim's pooled score


def snapkv_pooling(config) -> tuple[int, int, str]:
    """SnapKV's pooling as the policy declares it: (kernel, radius, kind). `config` is a
    SnapKV policy object (its own `pool_radius`) or a dict of its parameters, those not
    given at their declared defaults."""
    cls = POLICIES["snapkv"]
    if isinstance(config, cls):
        return int(config.pool_kernel), int(config.pool_radius), str(config.pooling)
    full = {**defaults("snapkv"), **dict(config or {})}
    return int(full["pool_kernel"]), cls.radius_of(full["pool_kernel"]), str(full["pooling"])


def kernel_label() -> str:
    """SnapKV's pool width as its control and the link name it (its declared label)."""
    return next(s.label for s in param_specs("snapkv") if s.name == "pool_kernel")


def pooling_facts(kept, scores, victims, position: int, config, step: int):
    """Why pooling kept `position` at `step`, in the policy's own numbers; None unless it
    is a defended slot. `config`: the SnapKV policy or its parameters (`snapkv_pooling`)."""
    kept = np.asarray(kept)
    if int(position) not in set(defended(kept, scores, victims).tolist()):
        return None
    kernel, radius, kind = snapkv_pooling(config)
    held = [int(v) for v in np.sort(np.asarray(victims)) if v in set(kept.tolist())]
    ties = ()
    if held:
        pooled = np.asarray(scores["pooled"], np.float64)
        cand = np.asarray(scores["candidate"], bool) & ~np.isin(kept, np.asarray(victims))
        x = pooled[int(np.flatnonzero(kept == held[0])[0])]
        ties = tuple(int(p) for p in kept[cand & _same(pooled, x)])
    return Pooling(step=int(step), kernel=kernel, radius=radius, kind=kind,
                   victims=len(np.asarray(victims)),
                   defended=slot_facts(kept, scores, victims, position, radius),
                   victim=slot_facts(kept, scores, victims, held[0], radius) if held else None,
                   victim_ties=ties)


def _pool_numbers(f: Pooling):
    d, v = f.defended, f.victim
    vals = [d.own, d.pooled, d.source_sum]
    if v is not None:
        vals += [v.own, v.pooled, v.source_sum]
    return number_format(vals)


def _away(slot: Slot) -> str:
    if slot.distance == 1:
        return "the next held slot in the cache"
    between = (f"position {slot.between[0]} is" if len(slot.between) == 1 else
               f"positions {_positions(slot.between)} are")
    return f"{slot.distance} held slots away in the cache ({between} held between them)"


def _rank_words(r: Rank, what: str, fmt_value: str) -> str:
    words = f"rank {r.rank} of the {r.of} candidates by {what}, lowest first"
    if r.ties:
        words += (f"; {_plural(len(r.ties), 'other candidate')} "
                  f"({_positions(r.ties)}) {'has' if len(r.ties) == 1 else 'have'} exactly "
                  f"{fmt_value} too, and {TIE_RULE} first")
    return words


def pooling_text(f: Pooling) -> str:
    """The defended slot's explanation, every number and comparison from `f`."""
    n = _pool_numbers(f)
    d, v = f.defended, f.victim
    go = ("it would be the one evicted" if f.victims == 1 else
          f"it would be among the {f.victims} evicted")
    text = ""
    if v is not None and f.victim_ties:
        text = (f"A tie decides this: the victim, position {v.position}, has the pooled score "
                f"{n(v.pooled)}, exactly as {_plural(len(f.victim_ties), 'candidate')} kept "
                f"({_positions(f.victim_ties)}); its score did not choose it, the tie-break did. ")
    text += (f"At step {f.step}, position {d.position}'s own window sum is {n(d.own)} "
            f"({_rank_words(d.by_sum, 'own window sum', n(d.own))}): without pooling {go}. ")
    if f.kind == "max" and d.source is not None:
        text += (f"Position {d.source}, {_away(d)}, has the window sum {n(d.source_sum)}, "
                 f"the largest within the {kernel_label()} of {f.kernel} "
                 f"({_plural(f.radius, 'held slot')} each side), so the max-pool gives {d.position} "
                 f"the pooled score {n(d.pooled)} "
                 "and it stays.")
    else:
        text += (f"Averaging over its {kernel_label()} of {f.kernel} "
                 f"({_plural(f.radius, 'held slot')} each side) gives it the pooled score {n(d.pooled)}, and it stays.")
    if v is None:
        return text
    text += (f" Position {v.position} is evicted instead: its own sum {n(v.own)} is "
             f"{relation(v.own, d.own)} {d.position}'s, ")
    if f.kind == "max" and v.source == v.position:
        text += f"and no held slot within reach has a larger one, so its pooled score is its own, {n(v.pooled)}"
    elif f.kind == "max" and v.source is not None:
        text += (f"and position {v.source}, {_away(v)}, lifts its pooled score to "
                 f"{n(v.pooled)}")
    else:
        text += f"and its pooled score is {n(v.pooled)}"
    r = v.by_pooled
    if r.rank == 1 and not r.ties:
        text += f", the lowest of the {r.of} candidates."
    else:
        text += f": {_rank_words(r, 'pooled score', n(v.pooled))}"
        text += "." if f.victims == 1 else f", within the {f.victims} that go."
    if d.pooled == v.pooled:
        text += (f" Position {d.position}'s pooled score is equal to it, and {TIE_RULE}, "
                 f"{v.position} < {d.position}.")
    return text


# --- why two policies diverged --------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """What one policy did with one position at one step."""

    who: str                 # "A" / "B"
    label: str               # the policy's label as the page shows it
    policy: str
    held: bool               # held before this step's eviction
    candidate: bool
    score_label: str | None
    score: float | None
    rank: Rank | None        # in the policy's documented eviction order; None without scores
    victims: int
    evicted: bool
    order_matches: bool      # the first `victims` of the documented order are the victims


def unpooled(config) -> bool:
    """SnapKV's settings whose pooling reaches no neighbour (poolKernel 1): its "pooled"
    score is the window sum itself. `config`: a SnapKV policy or a configuration's
    parameters (False for another policy's)."""
    if isinstance(config, POLICIES["snapkv"]) or (isinstance(config, dict) and "pool_kernel" in config):
        return snapkv_pooling(config)[1] == 0
    return False


def score_name(label: str | None, key: str | None, params=None) -> str | None:
    """The rank score's label as the page says it for these settings: a pooled score with
    poolKernel 1 is said to be the window sum, which it is."""
    if key == "pooled" and unpooled(params):
        return f"window sum ({kernel_label()} 1: nothing pooled)"
    return label


def eviction_order(policy: str, kept, scores) -> np.ndarray:
    """Indices into `kept` of the eviction candidates in the documented order (first to go
    first, ties to the lower position); candidates in position order without a score."""
    kept = np.asarray(kept)
    cand = np.asarray(scores.get("candidate", np.ones(len(kept), bool)), bool)
    r = rank_of(policy)
    if r is None or r.key not in scores:
        return np.flatnonzero(cand)
    vals = np.asarray(scores[r.key], np.float64)
    return ranked(kept, -vals if r.descending else vals, cand)


# --- ties that decide a victim -------------------------------------------------------------
@dataclass(frozen=True)
class Tie:
    """A victim chosen by the tie-break, not by its score: a candidate the policy keeps at
    this step has exactly the same score (in its documented eviction order)."""

    who: str                 # "A" / "B"
    position: int            # the victim
    score_label: str
    score: float | None      # None: no observed weight (NaN)
    kept: tuple              # candidates kept at this step with exactly that score


def tie_facts(who: str, panel: dict) -> list[Tie]:
    """The victims of `panel`'s step that a tie decided (empty when every victim's score
    alone put it among the victims, or the policy ranks by no score)."""
    kept = np.asarray(panel["kept"])
    scores, victims = panel["scores"], np.asarray(panel["victims"], np.int64)
    r = rank_of(panel["policy"])
    if r is None or r.key not in scores or not len(victims):
        return []
    vals = np.asarray(scores[r.key], np.float64)
    cand = np.asarray(scores.get("candidate", np.ones(len(kept), bool)), bool)
    stays = cand & ~np.isin(kept, victims)
    out = []
    for v in victims:
        hit = np.flatnonzero(kept == v)
        if not len(hit):
            continue
        x = vals[hit[0]]
        same = kept[stays & _same(vals, x)]
        if len(same):
            out.append(Tie(who=who, position=int(v),
                           score_label=score_name(r.label, r.key, panel.get("params")),
                           score=None if np.isnan(x) else float(x),
                           kept=tuple(int(p) for p in same)))
    return out


def tie_text(ties: list[Tie]) -> str:
    """One plain sentence per tie-decided victim, to be said before anything else about the
    step: the score did not choose it, the tie-break did. '' without ties."""
    out = []
    for t in ties:
        score = "no observed weight" if t.score is None else f"the {t.score_label} {t.score:.4g}"
        lower = all(t.position < p for p in t.kept)
        rule = (f"the tie-break ({TIE_RULE}) picked {t.position}" if lower else
                f"the tie-break picked {t.position}")
        out.append(f"A tie decides this: {t.who}'s victim, position {t.position}, has {score}, "
                   f"exactly as {_plural(len(t.kept), 'candidate')} {t.who} keeps "
                   f"({_positions(t.kept)}); its score did not choose it, {rule}.")
    return " ".join(out)


def decision(who: str, panel: dict, position: int) -> Decision:
    kept = np.asarray(panel["kept"])
    scores, victims = panel["scores"], np.asarray(panel["victims"], np.int64)
    policy = panel["policy"]
    r = rank_of(policy)
    order = eviction_order(policy, kept, scores)
    matches = set(kept[order[:len(victims)]].tolist()) == set(victims.tolist())
    hit = np.flatnonzero(kept == position)
    base = dict(who=who, label=panel["label"], policy=policy, victims=len(victims),
                evicted=bool(np.isin(position, victims)), order_matches=bool(matches))
    if not len(hit):
        return Decision(held=False, candidate=False, score_label=None, score=None, rank=None,
                        **base)
    i = int(hit[0])
    cand = bool(np.asarray(scores.get("candidate", np.ones(len(kept), bool)), bool)[i])
    has = r is not None and r.key in scores
    score = float(np.asarray(scores[r.key], np.float64)[i]) if has else None
    rank = None
    if has:
        vals = np.asarray(scores[r.key], np.float64)
        c = np.asarray(scores.get("candidate", np.ones(len(kept), bool)), bool)
        rank = rank_in(kept, -vals if r.descending else vals, c, i)
    elif cand:
        where = np.flatnonzero(order == i)
        rank = Rank(int(where[0]) + 1, len(order), ())
    return Decision(held=True, candidate=cand,
                    score_label=score_name(r.label, r.key, panel.get("params")) if has else None,
                    score=None if score is None or np.isnan(score) else score, rank=rank, **base)


def when(step: int) -> str:
    return "never (held to the end)" if step == NEVER else f"at step {step}"


def why_text(position: int, ev_a, ev_b, decisions, step: int, steps: int | None = None,
             ties=()) -> str:
    """The divergence view's explanation of `position`: when each policy evicted it and,
    at the first of those steps, how each one ranked it (from `decision` facts). `ties`
    (`tie_facts` of both panels at that step): a tie that chose `position` is said first."""
    ea, eb = int(ev_a[position]), int(ev_b[position])
    first = "A" if ea == step else "B"
    said = tie_text([t for t in ties if t.position == int(position)])
    text = (f"{said + ' ' if said else ''}Position {position}: A evicted it {when(ea)}, "
            f"B {when(eb)}. {first} evicted it first, at step {step}.")
    n = number_format([d.score for d in decisions])
    for d in decisions:
        text += " " + _decision_words(d, position, n)
    return text


def _decision_words(d: Decision, position: int, n) -> str:
    name = f"{d.who}, {d.label.split(': ', 1)[-1]},"
    if not d.held:
        return f"{name} no longer held it."
    if not d.candidate:
        return (f"{name} held it but could not evict it (protected, or not yet observed), "
                "so it stays.")
    r = d.rank
    if d.score_label is None:
        core = f"{name} has no score to rank by (its own rule picks the victims)"
    else:
        score = "no observed weight" if d.score is None else n(d.score)
        core = (f"{name} ranks it {r.rank} of {r.of} candidates on its {d.score_label} "
                f"{score}")
        if r.ties:
            core += (f" (tied with {_plural(len(r.ties), 'other candidate')}; {TIE_RULE} "
                     "first)")
    goes = "it goes" if d.evicted else "it stays"
    if d.order_matches and d.score_label is not None:
        return f"{core}, and evicts the first {d.victims}: {goes}."
    return f"{core}; it evicts {d.victims} at this step: {goes}."


def divergence_text(position: int, step: int, share: float, share_step: int,
                    threshold: float, ev_a, ev_b, panels) -> str:
    """Why the next-divergence jump stopped at `step`: which position one policy evicted
    while the other kept it, the attention share that makes it count (the jump's
    definition: over `threshold` of a step's attention while only one holds it, from
    `kvviz.app.jumps.divergence_share`), and each policy's score for it at the step (its
    panels A and B there: `decision` facts; a pooled score with the window sum under it)."""
    decisions = [decision(w, p, position) for w, p in zip("AB", panels)]
    ties = [t for w, p in zip("AB", panels) for t in tie_facts(w, p)]
    ea, eb = int(ev_a[position]), int(ev_b[position])
    who, other, other_end = ("A", "B", eb) if ea == step else ("B", "A", ea)
    keeps = ("keeps it to the end" if other_end == NEVER else
             f"keeps it until step {other_end}")
    said = tie_text([t for t in ties if t.position == int(position)])
    text = (f"{said + ' ' if said else ''}**Next divergence, step {step}:** {who} evicts "
            f"position {position}; {other} {keeps}. It counts because while only {other} "
            f"held it, step {share_step}'s query gave it {share:.2%} of its attention, "
            f"{relation(share, threshold)} the {threshold:.1%} the jump looks for.")
    sums = {}
    for d, p in zip(decisions, panels):
        kept = np.asarray(p["kept"])
        if d.held and "sums" in p["scores"] and "pooled" in p["scores"]:
            i = int(np.flatnonzero(kept == position)[0])
            sums[d.who] = (float(np.asarray(p["scores"]["sums"], np.float64)[i]),
                           float(np.asarray(p["scores"]["pooled"], np.float64)[i]))
    n = number_format([d.score for d in decisions] + [v for pair in sums.values() for v in pair])
    for d in decisions:
        text += " " + _decision_words(d, position, n)
        if d.who in sums and sums[d.who][1] != sums[d.who][0]:
            own, pooled = sums[d.who]
            text += (f" ({d.who}'s pooled score {n(pooled)} comes from pooling over its "
                     f"neighbours; its own window sum is {n(own)}.)")
    return text


# --- sinks and recent positions -------------------------------------------------------
@dataclass(frozen=True)
class Survival:
    who: str
    label: str
    sinks_held: int
    sinks: int               # sink positions that exist at this step
    recent_held: int
    recent: int              # newest positions that exist at this step


def survival_facts(who: str, label: str, evicted_at, step: int, sinks: int = 4,
                   recent: int = 64) -> Survival:
    held = held_mask(evicted_at, step)
    ns = min(sinks, step + 1)
    lo = max(0, step - recent + 1)
    return Survival(who=who, label=label, sinks_held=int(held[:ns].sum()), sinks=ns,
                    recent_held=int(held[lo:step + 1].sum()), recent=step + 1 - lo)


def survival_text(facts, step: int) -> str:
    parts = []
    for f in facts:
        part = (f"{f.who} ({f.label}) holds {f.sinks_held} of the {f.sinks} sinks and "
                f"{f.recent_held} of the {f.recent} newest positions")
        parts.append(part)
    return f"After step {step}: " + "; ".join(parts) + "."


# --- the policies themselves ------------------------------------------------------------
def policy_entries() -> dict[str, str]:
    """Glossary entries for every registered policy, from its class: label, eviction order,
    parameters with their defaults and the first two paragraphs of its module's docstring."""
    import inspect

    out = {}
    for name, cls in POLICIES.items():
        doc = (inspect.getmodule(cls).__doc__ or "").strip()
        first = " ".join(" ".join(doc.split("\n\n")[:2]).split())
        r = cls.rank
        order = r.order if r is not None else "no attention score: its own rule picks the victim"
        params = ", ".join(f"{s.label} (default {s.default})" for s in cls.specs) or "none"
        out[f"{cls.label} ({name})"] = (f"{first} Eviction: {order}. Parameters: {params}."
                                        .replace("..", "."))
    return out


# --- the tracked position ----------------------------------------------------------------
def track_state(evicted_at, position: int, step: int) -> str:
    """'not yet generated', 'held' or 'evicted at step N' for one policy after `step`."""
    if position > step:
        return "not yet generated"
    e = int(evicted_at[position])
    return "held" if e == NEVER or e > step else f"evicted at step {e}"


def visible_token(tok: str) -> str:
    """A token with its whitespace made visible: space as a middle dot, newline, tab."""
    return (str(tok).replace("\r", "␍").replace("\n", "⏎").replace("\t", "⇥").replace(" ", "·"))


def track_text(position: int, tokens, ev_a, ev_b, step: int, solo: bool = False) -> str:
    """The status line's note on the tracked position after `step`."""
    tok = ""
    if tokens is not None:  # markdown-escaped: a token may be "*" or "<b>"
        tok = " “" + re.sub(r"([\\`*_{}\[\]()#+\-.!<>|~])", r"\\\1",
                             visible_token(tokens[position])) + "”"
    a = track_state(ev_a, position, step)
    if solo:
        return f"tracked position **{position}**{tok}: {a}"
    return (f"tracked position **{position}**{tok}: A {a} · B {track_state(ev_b, position, step)}")


def tracked_score_text(d: Decision, position: int, step: int, n) -> str:
    """One policy's score for the tracked position at this step (Scores view)."""
    if position > step:
        return f"{d.who}: not yet generated."
    return _decision_words(d, position, n)


def evictions_text(who: str, panel: dict) -> str:
    """What one policy evicted at a step and how it ranked each victim (its own scores)."""
    victims = [int(v) for v in np.asarray(panel["victims"])]
    if not victims:
        return f"{who}, {panel['label'].split(': ', 1)[-1]}, evicts nothing at this step."
    ds = [decision(who, panel, v) for v in victims]
    n = number_format([d.score for d in ds])
    ties = tie_text(tie_facts(who, panel))
    return (ties + " " if ties else "") + " ".join(
        f"Position {v}: " + _decision_words(d, v, n) for v, d in zip(victims, ds))


# --- a class's guesses, after the reveal --------------------------------------------------
def _slots(n: int) -> str:
    return "1 slot" if n == 1 else f"{n} slots"


def guess_text(panel: dict, position: int, tokens=None) -> str:
    """Why a guessed position was, or was not, evicted at the question's step: one sentence
    from `decision` facts (the policy's own scores and eviction log), with the position's
    token; the number of victims said as a count of slots, never as a bare number."""
    d = decision(panel["label"].split(":")[0], panel, int(position))
    tok = ""
    if tokens is not None and 0 <= int(position) < len(tokens):
        tok = f" (“{visible_token(tokens[int(position)])}”)"
    name = f"{d.who} ({d.label.split(': ', 1)[-1]})"
    head = f"Position {int(position)}{tok}: "
    if not d.held:
        return head + f"{name} did not hold it at this step, so it could not be evicted."
    if not d.candidate:
        return (head + f"{name} held it but could not evict it (protected, or not yet "
                       "observed), so it stayed.")
    goes = "so it was evicted." if d.evicted else "so it stayed."
    if d.score_label is None or d.rank is None:
        return (head + f"{name} has no score to rank by; its own rule picked {_slots(d.victims)}"
                       f" at this step, and this was{'' if d.evicted else ' not'} one of them, "
                + goes)
    n = number_format([d.score])
    score = "no observed weight" if d.score is None else n(d.score)
    text = (head + f"{name} ranks it {d.rank.rank} of {d.rank.of} candidates (first to go "
                   f"first) on its {d.score_label}, {score}")
    if d.rank.ties:
        text += (f", tied with {_plural(len(d.rank.ties), 'other candidate')} "
                 f"({_positions(d.rank.ties)}; {TIE_RULE})")
    if d.order_matches:
        text += (f"; it evicts {_slots(d.victims)} at this step, the "
                 f"{'lowest-ranked one' if d.victims == 1 else f'{d.victims} lowest-ranked'}, ")
    else:
        text += f"; it evicts {_slots(d.victims)} at this step, "
    return text + goes
