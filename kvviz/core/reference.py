"""The cards' pseudocode as plain Python loops: slow, obviously right, the oracle.

Same interface as the fast policies (kept, on_decode_step, evict) and the same
refusals, because the differential tests and `python -m kvviz perf` drive both through
the one harness. Weights are Python floats (exact copies of the float32 inputs).
"""
from __future__ import annotations

import math
import sys
from decimal import Decimal

import numpy as np

from kvviz.core.policies import POLICIES, make_policy, reference_class


def _beside(ref_cls, name):
    """The Policy class named `name` in the module that defines `ref_cls`."""
    from kvviz.core.policies.base import Policy

    module = sys.modules.get(ref_cls.__module__)
    for v in vars(module).values() if module else ():
        if isinstance(v, type) and issubclass(v, Policy) and v.__dict__.get("name") == name:
            return v
    raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")


class RefPolicy:
    """Owns the kept list and the eviction rule; subclasses score one slot at a time."""

    protect_recent = 0
    # The inputs it reads, declared as a Policy declares them (each instance copies its fast
    # policy's); it never reads per-query-head rows, which no trace stores.
    uses_attention = True
    reads_key_norms = reads_value_norms = reads_query_rows = False
    reads_keys = reads_queries = False  # key and query vectors: kvviz.core.reference_vectors

    def __init__(self, budget, rng=None, **params):
        if self.name in POLICIES:
            self.fast = make_policy(self.name, budget=budget, rng=rng, **params)  # same refusals
        else:  # a plugin's reference beside its unregistered class (kvviz check PATH.py)
            self.fast = _beside(type(self), self.name)(budget=budget, rng=rng, **params)
        self.budget = budget
        self.params = self.fast.params
        self.bytes_per_slot = self.fast.bytes_per_slot
        self.uses_attention = self.fast.uses_attention
        self.reads_key_norms = self.fast.reads_key_norms
        self.reads_value_norms = self.fast.reads_value_norms
        self.keep = []  # positions, ascending
        self.state = []  # one record per kept position

    @property
    def kept(self):
        """The kept positions, ascending, as the fast policy's `kept` (so one harness drives both)."""
        return np.array(self.keep, dtype=np.int64)

    def held(self):
        """The positions the next query attends over: here, all kept ones."""
        return self.kept

    def advance(self, pos, attn, key_norm=None, value_norm=None):
        """The harness's name for one decode step; the same as `on_decode_step`."""
        self.on_decode_step(pos, attn, key_norm, value_norm)

    def on_decode_step(self, pos, attn, key_norm=None, value_norm=None):
        """Observe step `pos`'s weights over the kept slots (or None: no attention), then
        admit `pos`. The input checks are written out again, loop by loop, so the fast
        policy's refusals are tested against an independent statement of the rule."""
        if self.keep and pos <= self.keep[-1]:
            raise ValueError("pos must be above every kept position")
        if attn is not None:
            weights = [float(np.float32(w)) for w in attn]
            if len(weights) != len(self.keep):
                raise ValueError("attn length must equal the number of kept positions")
            for w in weights:
                if math.isnan(w) or math.isinf(w):
                    raise ValueError("attn weights must be finite")
                if w < 0:
                    raise ValueError("attn weights must be non-negative")
            self.observe(weights)
        self.keep.append(int(pos))
        if self.reads_value_norms:
            self.state.append(self.new_record(value_norm))
        else:
            self.state.append(self.new_record(key_norm) if self.reads_key_norms else self.new_record())

    def evict(self, budget):
        """Drop down to `budget`: rank every candidate slot by (`rank`, position) and take the
        lowest; the victims come back ascending. Fewer candidates than victims due is refused."""
        excess = len(self.keep) - budget
        if excess <= 0:
            return np.empty(0, np.int64)
        self.prepare()
        ranked = []
        for i in range(len(self.keep)):
            if self.is_candidate(i):
                ranked.append((self.rank(i), self.keep[i], i))
        if len(ranked) < excess:
            raise ValueError(f"evict needs {excess} victims but only {len(ranked)} slots are candidates")
        ranked.sort()  # lowest rank first, then lower position
        return self.drop(sorted(i for _, _, i in ranked[:excess]))

    def drop(self, chosen):
        """Remove the slots at the ascending indices `chosen`; return their positions."""
        victims = [self.keep[i] for i in chosen]
        for i in reversed(chosen):
            del self.keep[i]
            del self.state[i]
        return np.array(victims, dtype=np.int64)

    def prepare(self):
        """Work out what `rank` reads at this step (SnapKV's window sums); by default nothing."""

    def is_candidate(self, i):
        """Whether slot `i` may be evicted now: by default, every slot outside the
        `protect_recent` newest."""
        return i < len(self.keep) - self.protect_recent

    def observe(self, weights):
        """Take one step's weights (Python floats, aligned with the kept slots) into the records."""
        raise NotImplementedError

    def new_record(self):
        """The record a newly admitted position starts with."""
        raise NotImplementedError

    def rank(self, i):
        """Slot `i`'s rank: the lowest goes first, ties to the lower position."""
        raise NotImplementedError


class RefTova(RefPolicy):
    """TOVA: each slot's record is its weight on the latest observed step (assigned, not
    summed); an unobserved newcomer is no candidate."""

    name = "tova"

    def observe(self, weights):
        for i, w in enumerate(weights):
            self.state[i] = w  # assignment, not accumulation

    def new_record(self):
        return None  # unobserved

    def is_candidate(self, i):
        return self.state[i] is not None

    def rank(self, i):
        return self.state[i]


class RefH2O(RefPolicy):
    """H2O: each slot's record is its attention summed since admission; the
    `recent_window` newest are protected."""

    name = "h2o"

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.protect_recent = self.params["recent_window"]

    def observe(self, weights):
        for i, w in enumerate(weights):
            self.state[i] += w

    def new_record(self):
        return 0.0

    def rank(self, i):
        return self.state[i]


class RefSnapKV(RefPolicy):
    """SnapKV: a ring of the last `obs_window` weights per slot, summed slot 0 upward at
    eviction, then pooled (max or average) over the kept neighbours within the kernel's radius."""

    name = "snapkv"

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.window = self.params["obs_window"]
        self.radius = (self.params["pool_kernel"] - 1) // 2
        self.protect_recent = self.params["recent_window"]
        self.slot = 0

    def observe(self, weights):
        for i, w in enumerate(weights):
            self.state[i][self.slot] = w
        self.slot = (self.slot + 1) % self.window

    def new_record(self):
        return [0.0] * self.window

    def prepare(self):
        self.sums = []
        for ring in self.state:
            total = 0.0
            for w in ring:  # ring slot 0 upward
                total += w
            self.sums.append(total)

    def rank(self, i):
        lo = max(0, i - self.radius)
        hi = min(len(self.sums) - 1, i + self.radius)
        if self.params["pooling"] == "max":
            return max(self.sums[lo:hi + 1])
        total = 0.0
        for j in range(lo, hi + 1):  # the kept neighbours, lowest first
            total += self.sums[j]
        return total / (hi - lo + 1)


class RefScissorhands(RefPolicy):
    """Scissorhands: a ring of `history_window` flags per slot (weight below 1/len(kept));
    the slot flagged most often goes first; among equal counts, with tie_break "attention",
    the lower attention summed over every observed step since admission, then (both rules)
    the lower position."""

    name = "scissorhands"

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.window = self.params["history_window"]
        self.protect_recent = self.params["recent_window"]
        self.slot = 0

    def observe(self, weights):
        threshold = float(np.float32(1.0 / len(weights))) if weights else 0.0
        for i, w in enumerate(weights):
            self.state[i][0][self.slot] = w < threshold
            self.state[i][1] += w
        self.slot = (self.slot + 1) % self.window

    def new_record(self):
        return [[False] * self.window, 0.0]  # the flags, the attention summed since admission

    def rank(self, i):
        flags, total = self.state[i]
        if self.params["tie_break"] == "attention":
            return (-sum(flags), total)  # unimportant most often first, then the least attended
        return (-sum(flags),)  # unimportant most often goes first


class RefStreamingLLM(RefPolicy):
    """StreamingLLM: the first `sinks` slots stay; of the rest, the oldest goes."""

    name = "streaming-llm"

    def observe(self, weights):
        pass

    def new_record(self):
        return None

    def is_candidate(self, i):
        return i >= self.params["sinks"]

    def rank(self, i):
        return 0  # ties: oldest non-sink goes


class RefKnorm(RefPolicy):
    """The key with the highest L2 norm goes; ties to the lower position; nothing protected."""

    name = "knorm"

    def observe(self, weights):
        pass  # reads no attention

    def new_record(self, key_norm):
        if key_norm is None:
            raise ValueError("knorm reads key norms, and none was given")
        return float(np.float32(key_norm))  # stored as float32, like the cache's keys

    def rank(self, i):
        return -self.state[i]


class RefVATP(RefPolicy):
    """VATP: each slot's record is [attention summed since admission, its value's norm]; the
    rank is their product; the first `sinks` admitted and the `recent_window` newest are
    protected."""

    name = "vatp"

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.protect_recent = self.params["recent_window"]
        self.sinks = self.params["sinks"]

    def observe(self, weights):
        for i, w in enumerate(weights):
            self.state[i][0] += w

    def new_record(self, value_norm):
        if value_norm is None:
            raise ValueError("vatp reads value norms, and none was given")
        return [0.0, float(np.float32(value_norm))]  # the norm stored as float32

    def is_candidate(self, i):
        return self.sinks <= i < len(self.keep) - self.protect_recent

    def rank(self, i):
        return self.state[i][0] * self.state[i][1]


class RefRaaS(RefPolicy):
    """RaaS: each slot's record is its timestamp, the step it was admitted at, set again to
    the current step whenever that step's weight on it is at least alpha x the step's top
    weight; the oldest timestamp goes (ties: the lower position); the first `sinks` stay."""

    name = "raas"

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.alpha = self.params["alpha"]
        self.sinks = self.params["sinks"]
        self.step = None

    def on_decode_step(self, pos, attn, key_norm=None, value_norm=None):
        self.step = int(pos)  # the step the weights belong to, for `observe` and `new_record`
        super().on_decode_step(pos, attn, key_norm, value_norm)

    def observe(self, weights):
        top = 0.0
        for w in weights:
            if w > top:
                top = w
        for i, w in enumerate(weights):
            if w >= self.alpha * top:
                self.state[i] = self.step  # in use at this step: fresh again

    def new_record(self):
        return self.step

    def is_candidate(self, i):
        return i >= self.sinks

    def rank(self, i):
        return self.state[i]


class RefRandom(RefPolicy):
    """Uniform choice without replacement among all kept slots, from the given rng."""

    name = "random"

    def __init__(self, budget, rng=None, **params):
        super().__init__(budget, rng, **params)
        self.rng = self.fast.rng

    def observe(self, weights):
        pass

    def new_record(self):
        return None

    def evict(self, budget):
        excess = len(self.keep) - budget
        if excess <= 0:
            return np.empty(0, np.int64)
        if budget < 0:
            raise ValueError("evict budget must be a non-negative integer")
        standing = list(range(len(self.keep)))
        chosen = []
        for _ in range(excess):
            chosen.append(standing.pop(int(self.rng.integers(len(standing)))))
        return self.drop(sorted(chosen))


class RefAdaKV:
    """AdaKV from its rule, over one reference scorer per KV head of a layer: each step every
    head has admitted its position; while the heads hold more than heads x budget, the
    candidate with the lowest rank across all heads goes (ties: the lower head, then the
    lower position), skipping a head that holds floor(alpha x budget) or fewer. Ranks are
    read once per step, before any victim goes."""

    def __init__(self, budget, heads, scorer="tova", alpha=0.2, **scorer_params):
        self.heads = [make_reference(scorer, budget, **scorer_params) for _ in range(heads)]
        self.budget = budget
        self.floor = math.floor(Decimal(repr(float(alpha))) * budget)

    def evict(self):
        """One list of victims' positions per head (ascending)."""
        chosen = shared_choice(self.heads, len(self.heads) * self.budget, self.floor)
        return [ref.drop(sorted(c)) for ref, c in zip(self.heads, chosen)]


def shared_choice(heads, total: int, floor: int) -> list:
    """AdaKV's choice by hand, over reference scorers `heads` sharing `total` slots: while
    they hold more, the candidate of lowest rank across the heads goes (ties: the lower head,
    then the lower position), skipping a head at `floor` or fewer; ranks are read once,
    before any victim goes. The victims' slot indices per head."""
    held = [len(ref.keep) for ref in heads]
    ranked = []
    for g, ref in enumerate(heads):
        ref.prepare()
        for i in range(len(ref.keep)):
            if ref.is_candidate(i):
                ranked.append((ref.rank(i), g, ref.keep[i], i))
    ranked.sort()  # lowest rank, then lower head, then lower position
    chosen = [[] for _ in heads]
    for _, g, _, i in ranked:
        if sum(held) <= total:
            break
        if held[g] > floor:
            chosen[g].append(i)
            held[g] -= 1
    if sum(held) > total:
        raise ValueError("evict needs more victims than the heads have candidates above their floors")
    return chosen


def make_reference(name, budget=512, rng=None, **params):
    """The reference a policy class names (its `reference`), built like `make_policy`."""
    ref = reference_class(name)  # refuses an unknown name as make_policy does
    if ref is None:
        have = sorted(n for n in POLICIES if POLICIES[n].reference is not None)
        raise ValueError(f"no reference for policy {name!r}; have {have}")
    return ref(budget, rng, **params)

