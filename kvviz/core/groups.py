"""One protocol for everything that evicts: a `StreamGroup` steps a configuration's streams.

A configuration of a model evicts in S = L x G streams (G per layer: 1 at layer
granularity, one per KV head otherwise); stream s is layer s // G, head s % G. Whatever
decides its victims (one policy object per stream, a policy's vectorised form over all
streams at once (kvviz.core.streams.Streams), an allocator sharing each layer's slots
across its heads, or nothing: the full cache) is one `StreamGroup`; so is a single
trace's replay (kvviz.core.replay.Replay steps `OnePolicy`, one stream):

- `step(t, inputs)`: every stream observes step t's inputs on its kept positions, admits
  position t, and evicts; returns the victims as two int64 arrays (streams, positions).
  The harness's checks hold on every path (kvviz.core.harness.step and step_layer: the
  held count, an allocator's caps and each layer's total).
- `kept(s)`: stream s's kept positions, ascending; `size`: S.
- the inputs it reads, declared: `uses_attention`, `reads_key_norms`, `reads_value_norms`,
  `reads_query_rows`; `calibration_rows` (an allocator that reads the prompt's first rows
  with the full cache before evicting); `capacity` (the most one stream holds after an
  eviction; None when it never evicts) and `bytes_per_slot` (its memory per kept slot).
- what a freed cache sizes its slots by: `layer_budgets(L)` (each layer's per-stream
  budget) and `shares_slots` (a layer's streams may hold unequal counts: they draw on one
  pool of the layer's slots, kvviz.model.loop.cache.SlotPlan).
- a prompt read in one pass: `stream_policy(s)` (the per-stream policy stream s's prompt
  rows feed, kvviz.core.harness.PromptRows) and `prefill(prompt)` (the one-shot eviction
  at the prompt's last row, kvviz.core.harness.prefill).

`inputs` offers a step's values by stream: `weights(s, held)` (the raw weights on the
positions `held`), `gather(keys)` ((S, n) weights at keys = a stream's offset + position,
for a vectorised group built over the caller's layout), `key_norm(s)`, `value_norm(s)`,
`query_rows(s, held)` and, for a policy that reads key or query vectors, `keys(s, positions)`
((len(positions), head_dim): the cache's keys of stream s there) and `query(s)` ((group,
head_dim): step t's query vectors of stream s's query heads); an `inputs` without them
leaves such a policy refused by name. `prompt` offers a prompt's: `length`, `rows(s)` (a PromptRows),
`key_norms(s)`, `value_norms(s)` (or None) and `calibration(s)` (the first rows).
"""
from __future__ import annotations

import numpy as np

from kvviz.core import harness
from kvviz.core.policies.base import BudgetError

__all__ = ["AllocatedLayers", "OnePolicy", "PolicyLayers", "StreamGroup", "Unevicted", "no_victims"]


def no_victims() -> tuple[np.ndarray, np.ndarray]:
    """(streams, positions) of a step that evicted nothing."""
    return np.empty(0, np.int64), np.empty(0, np.int64)


def victims_of(found: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(streams, positions) from (stream, positions) pairs."""
    found = [(s, v) for s, v in found if len(v)]
    if not found:
        return no_victims()
    return (np.concatenate([np.full(len(v), s, np.int64) for s, v in found]),
            np.concatenate([np.asarray(v, np.int64) for _, v in found]))


class StreamGroup:
    """The protocol (see the module docstring), with the defaults every group shares."""

    uses_attention = True
    reads_key_norms = reads_value_norms = reads_query_rows = False
    reads_keys = reads_queries = False
    calibration_rows = 0
    capacity: int | None = None
    bytes_per_slot = 0
    size = 0  # S, its streams
    shares_slots = False  # a layer's streams draw on one pool of its slots (an allocator moving them)
    calibrates_in_decode = False  # takes its calibration rows token by token (the first it sees)

    def layer_budgets(self, layers: int) -> list:
        """Each of the `layers` layers' per-stream budget (what a freed cache sizes its
        slots by): `capacity` everywhere by default."""
        return [self.capacity] * int(layers)

    def step(self, t: int, inputs) -> tuple[np.ndarray, np.ndarray]:
        """Every stream observes step t's `inputs` on its kept positions, admits position t
        and evicts under the harness's checks: the victims as (streams, positions), int64."""
        raise NotImplementedError

    def kept(self, s: int) -> np.ndarray:
        """Stream s's kept positions, ascending (int64)."""
        raise NotImplementedError

    def stream_policy(self, s: int):
        """The per-stream policy stream s's prompt rows feed; None when none reads them."""
        raise NotImplementedError

    def prefill(self, prompt) -> tuple[np.ndarray, np.ndarray]:
        """The prompt read in one pass, then the one-shot eviction at its last row
        (kvviz.core.harness.prefill): the victims as (streams, positions), int64."""
        raise NotImplementedError


class Unevicted(StreamGroup):
    """The full cache: S streams that keep every position and read nothing."""

    uses_attention = False

    def __init__(self, size: int):
        self.size, self.seen = int(size), 0

    def step(self, t, inputs):
        self.seen = t + 1
        return no_victims()

    def kept(self, s):
        return np.arange(self.seen, dtype=np.int64)

    def stream_policy(self, s):
        return None

    def prefill(self, prompt):
        self.seen = prompt.length
        return no_victims()


def _declare_inputs(group, policy) -> None:
    """The group reads what its per-stream policies read (one class for every stream)."""
    group.uses_attention = policy.uses_attention
    group.reads_key_norms, group.reads_value_norms = policy.reads_key_norms, policy.reads_value_norms
    group.reads_query_rows = policy.reads_query_rows
    group.reads_keys = getattr(policy, "reads_keys", False)
    group.reads_queries = getattr(policy, "reads_queries", False)
    group.bytes_per_slot = policy.bytes_per_slot


def _feed_args(p, s: int, inputs) -> tuple:
    """(raw weights, key norm, value norm, query rows) of stream s for its policy `p`."""
    held = p.held()
    return (inputs.weights(s, held) if p.uses_attention else None,
            inputs.key_norm(s) if p.reads_key_norms else None,
            inputs.value_norm(s) if p.reads_value_norms else None,
            inputs.query_rows(s, held) if p.reads_query_rows else None)


def _vectors(p, s: int, t: int, inputs) -> dict:
    """The key and query vectors of stream s at step t for its policy `p`, as keywords of
    harness.feed and step: `keys` at its held positions and t (harness.keys_at) if it reads
    keys, `query` if it reads queries; None where `inputs` cannot give them (the policy then
    refuses, naming what it lacks)."""
    out = {}
    if getattr(p, "reads_keys", False):
        get = getattr(inputs, "keys", None)
        out["keys"] = None if get is None else get(s, harness.keys_at(p.held(), t))
    if getattr(p, "reads_queries", False):
        get = getattr(inputs, "query", None)
        out["query"] = None if get is None else get(s)
    return out


def _in_layer(layer: int, exc: BudgetError, place=None) -> BudgetError:
    """The refusal naming the layer, unless the group's `place` has named it already."""
    if place is not None and place.layer is not None:
        return exc
    return type(exc)(f"layer {layer}: {exc}")  # a VictimError stays one


class OnePolicy(StreamGroup):
    """One stream, one policy object stepped by harness.step to its own budget: a single
    trace's replay. `stream` names it in a refusal."""

    size = 1

    def __init__(self, policy, stream: str = ""):
        self.policy, self.stream = policy, stream
        self.capacity = policy.budget
        _declare_inputs(self, policy)

    def feed(self, t: int, inputs) -> None:
        """The first half of `step`: observe step t's inputs and admit t (harness.feed); no
        eviction."""
        raw, norm, vnorm, qrows = _feed_args(self.policy, 0, inputs)
        harness.feed(self.policy, t, raw, norm, vnorm, qrows, **_vectors(self.policy, 0, t, inputs))

    def step(self, t, inputs):
        raw, norm, vnorm, qrows = _feed_args(self.policy, 0, inputs)
        victims = harness.step(self.policy, t, raw, self.capacity, norm, self.stream, vnorm, qrows,
                               **_vectors(self.policy, 0, t, inputs))
        return np.zeros(len(victims), np.int64), victims

    def kept(self, s):
        return self.policy.kept

    def stream_policy(self, s):
        return self.policy

    def prefill(self, prompt):
        victims = harness.prefill(self.policy, prompt.rows(0), prompt.length, self.capacity,
                                  prompt.key_norms(0), prompt.value_norms(0), self.stream)
        return np.zeros(len(victims), np.int64), victims


class PolicyLayers(StreamGroup):
    """One policy object per stream: `policies[layer][g]`, each stepped by harness.step to
    the configuration's `budget`."""

    def __init__(self, policies: list, budget: int):
        self.policies, self.budget = [list(per) for per in policies], int(budget)
        self.per_layer = len(self.policies[0])
        self.size = len(self.policies) * self.per_layer
        self.capacity = self.budget
        _declare_inputs(self, self.policies[0][0])

    def _policy(self, s: int):
        return self.policies[s // self.per_layer][s % self.per_layer]

    def step(self, t, inputs):
        found, G = [], self.per_layer
        for layer, per in enumerate(self.policies):
            try:
                for g, p in enumerate(per):
                    raw, norm, vnorm, qrows = _feed_args(p, layer * G + g, inputs)
                    victims = harness.step(p, t, raw, self.budget, norm, f"head {g}" if G > 1 else "",
                                           vnorm, qrows, **_vectors(p, layer * G + g, t, inputs))
                    found.append((layer * G + g, victims))
            except BudgetError as exc:
                raise _in_layer(layer, exc) from None
        return victims_of(found)

    def kept(self, s):
        return self._policy(s).kept

    def stream_policy(self, s):
        return self._policy(s)

    def prefill(self, prompt):
        found, G = [], self.per_layer
        for layer, per in enumerate(self.policies):
            try:
                for g, p in enumerate(per):
                    s = layer * G + g
                    victims = harness.prefill(p, prompt.rows(s), prompt.length, self.budget,
                                              prompt.key_norms(s), prompt.value_norms(s),
                                              f"head {g}" if G > 1 else "")
                    found.append((s, victims))
            except BudgetError as exc:
                raise _in_layer(layer, exc) from None
        return victims_of(found)


class AllocatedLayers(StreamGroup):
    """An allocator's configuration: one kvviz.core.policies.alloc.LayerGroup per layer,
    whose G heads share the layer's slots; each step is harness.step_layer (each head
    fed, the group evicts across them, every head's cap and the layer's total enforced).

    An allocator that reads calibration rows (`Allocator.calibration_rows`) gets them for
    every layer at once (`calibrate`): first its layers' budgets (`Allocator.plan_layers`,
    when it plans them), then each layer's state (`Allocator.calibrate`). A prompt read in
    one pass gives them before its eviction (`prefill`); read token by token (`step`), the
    first rows it sees are kept, not fed, until it has its rows or a layer would have to
    evict (the step where a head first holds more than its layer's budget), then it
    calibrates and its heads are fed the kept rows before that step goes on."""

    def __init__(self, groups: list):
        self.groups = list(groups)
        self.per_layer = self.groups[0].heads
        self.size = len(self.groups) * self.per_layer
        self.allocator = self.groups[0].allocator
        self._declare()
        self.calibration_rows = int(self.allocator.calibration_rows())
        self.plans_layers = self.allocator.plans_layers
        self.calibrated = not self.calibration_rows
        self.calibrates_in_decode = True
        self._kept = []  # token by token, before calibrating: each step's inputs, per stream
        _declare_inputs(self, self.groups[0].policies[0])

    def _declare(self) -> None:
        self.capacity = max(group.cap for group in self.groups)
        self.shares_slots = self.per_layer > 1 and any(group.cap > group.b for group in self.groups)

    def layer_budgets(self, layers):
        return [group.b for group in self.groups]

    # -- calibration ---------------------------------------------------------------------
    def calibrate(self, rows_by_layer: list) -> None:
        """`rows_by_layer[layer][g][t]`: head g's row t (positions 0..t-1) read with the full
        cache, before any head observes a step. The allocator plans its layers' budgets from
        them (if it plans them: the groups are rebuilt at those budgets), then each layer
        calibrates."""
        if self.plans_layers:
            budgets = self.allocator.planned_budgets(rows_by_layer, len(self.groups))
            self.groups = [group.allocator.group(group.place.layer, group.place.layers, group.heads, budget=b)
                           for group, b in zip(self.groups, budgets)]
            self._declare()
        for layer, group in enumerate(self.groups):
            try:
                group.calibrate(rows_by_layer[layer])
            except BudgetError as exc:
                raise _in_layer(layer, exc) from None
        self.calibrated = True

    def _keep(self, t: int, inputs) -> None:
        """Token by token, before calibrating: step t's inputs on positions 0..t-1 (nothing
        has been evicted), per stream, for the heads to be fed later."""
        held = np.arange(t, dtype=np.int64)
        p = self.groups[0].policies[0]
        self._kept.append([(inputs.weights(s, held),
                            inputs.key_norm(s) if p.reads_key_norms else None,
                            inputs.value_norm(s) if p.reads_value_norms else None,
                            inputs.query_rows(s, held) if p.reads_query_rows else None)
                           for s in range(self.size)])

    def _calibrate_by(self) -> int:
        """Token by token: the step at which it calibrates (its rows in, or a layer full)."""
        return min(self.calibration_rows - 1, min(group.b for group in self.groups))

    def _calibrate_kept(self, t: int) -> None:
        """Token by token, at step t: calibrate on the kept rows 0..t (read before any
        eviction), then feed every head steps 0..t-1; step t is then an ordinary step. A
        head whose policy reads an input its scorer does not (so it was not kept) is
        refused, naming the allocator and what it lacks."""
        kept, G = self._kept, self.per_layer
        n = min(t + 1, self.calibration_rows)
        self.calibrate([[[kept[i][layer * G + g][0] for i in range(n)] for g in range(G)]
                        for layer in range(len(self.groups))])
        self._kept = []
        first = kept[0]
        for layer, group in enumerate(self.groups):
            for g, p in enumerate(group.policies):
                s = layer * G + g
                lacks = [what for what, reads, have in (("key norms", p.reads_key_norms, first[s][1]),
                                                       ("value norms", p.reads_value_norms, first[s][2]),
                                                       ("query rows", p.reads_query_rows, first[s][3]))
                         if reads and have is None]
                if lacks:
                    raise ValueError(f"{group.name}: layer {layer}, head {g}'s policy {p.name} reads "
                                     f"{' and '.join(lacks)}, which its scorer does not, so the rows kept "
                                     "before calibrating lack them: read the prompt in one pass")
                for i in range(t):
                    raw, norm, vnorm, qrows = kept[i][s]
                    harness.feed(p, i, raw if p.uses_attention else None, norm if p.reads_key_norms else None,
                                 vnorm if p.reads_value_norms else None, qrows if p.reads_query_rows else None)

    # -- stepping --------------------------------------------------------------------------
    def step(self, t, inputs):
        if not self.calibrated:
            self._keep(t, inputs)
            if t < self._calibrate_by():
                return no_victims()
            self._calibrate_kept(t)
        found, G = [], self.per_layer
        for layer, group in enumerate(self.groups):
            heads = group.policies
            args = [_feed_args(p, layer * G + g, inputs) for g, p in enumerate(heads)]
            try:
                victims = harness.step_layer(group, t, *(list(column) for column in zip(*args)))
            except BudgetError as exc:
                raise _in_layer(layer, exc, group.place) from None
            found += [(layer * G + g, v) for g, v in enumerate(victims)]
        return victims_of(found)

    def kept(self, s):
        return self.groups[s // self.per_layer].policies[s % self.per_layer].kept

    def stream_policy(self, s):
        return self.groups[s // self.per_layer].policies[s % self.per_layer]

    def prefill(self, prompt):
        """The allocator calibrates on the prompt's first rows of every layer (if it asks:
        its layers' budgets first, if it plans them), then each layer's heads observe the
        prompt without evicting and the group evicts once."""
        found, G, T0 = [], self.per_layer, prompt.length
        last = T0 - 1
        if self.calibration_rows:
            n = min(self.calibration_rows, T0)
            self.calibrate([[prompt.calibration(layer * G + g)[:n] for g in range(G)]
                            for layer in range(len(self.groups))])
        for layer, group in enumerate(self.groups):
            try:
                for g, p in enumerate(group.policies):
                    s = layer * G + g
                    found.append((s, harness.prefill(p, prompt.rows(s), T0, T0, prompt.key_norms(s),
                                                     prompt.value_norms(s))))
                found += [(layer * G + g, v) for g, v in enumerate(harness.evict_layer(group, last))]
            except BudgetError as exc:
                raise _in_layer(layer, exc, group.place) from None
        return victims_of(found)
