"""Allocators: policies that share a budget across the KV heads and layers of a model.

A budget stays the mean number of slots per stream (one stream = one KV head of one
layer). An allocator decides each stream's share, the layer holding at most its total
(heads x the layer's per-head budget; it may leave room unused); which slots go
inside a stream is decided by a per-stream policy, its `scorer` (any registered policy,
built-in or plugin, with its own parameters): the scorer's `candidates()` say which slots
may go and its `priority()` ranks them, exactly as for that policy alone.

An allocator is declared like a policy (a dataclass with `param(...)` fields, `name`,
`label`) and registered beside them (`register_allocator`, `--plugin`, entry points; the
built-ins are found from their files), so `make_policy`,
`parse_params`, `name:k=v` and sweep specs read it the same way: `adakv:scorer=tova`,
`pyramidkv:scorer=snapkv,poolKernel=3` (a key the allocator does not declare is the
scorer's). A subclass says only how a layer's slots are shared:

- `layer_budget(depth, depths)`: the per-head mean budget of the layer at `depth` (0 the
  first) of the `depths` layers that share the budget; their mean is `budget`;
- `floor(b)`: no eviction takes a head below this (the rest of its slots may go);
- `cap(b, heads)`: the most one head may hold (the layer's total is heads x b);
- `choose_layer(policies, b)`: the victims' slot indices per head (default: each head
  evicts down to b on its own, by its scorer);
- `calibration_rows()` and `calibrate(rows, group)`: an allocator that decides something
  per layer before eviction starts (headroles: each head's role) asks for the first N rows
  of every head's stream read with the full cache, and returns the layer's state
  (`LayerGroup.state`); `choose_group(group)` then chooses with it;
- `plan_layers(rows_by_layer)` (optional; asks for calibration rows): every layer's
  per-head budget from every layer's calibration rows, seen at once before any layer
  evicts (CAKE-style budgets across layers from the prompt's attention). `rows_by_layer`
  is [layer][head][t]: row t (positions 0..t-1) of each head's stream read with the full
  cache, the first `calibration_rows()` of them (fewer when the prompt, or the steps before
  a layer must first evict, are fewer). It returns one positive integer per layer,
  summing to layers x budget (checked: `planned_budgets`), or None to keep
  `layer_budgets`. It is called once, before `calibrate`: after a prompt read in one pass
  and before its eviction; token by token, at the step where the rows are in or a layer
  must first evict (kvviz.core.groups.AllocatedLayers). A freed cache read token by token
  is sized before any row is read, so it refuses an allocator that plans its layers.

Calibration rows come in decode mode too: token by token, the allocator calibrates on the
first rows it sees (its heads observe them afterwards, in order, before they evict).

An allocator built on a scorer declares the order its victims keep (`victim_order`), which
`kvviz check` holds it to: "per_head" (the default: each head's victims are its own
lowest-priority candidates, however many each head loses), "shared" (each victim is the
lowest-priority candidate across the layer's heads that may still go, one head's priority
compared with another's as is; a head at its floor may not), or None (no order by the
scorer's priority: the rule is not applied). Ties may go either way. `reference` names its
slow reference ("module:Class", see kvviz.core.reference_alloc), as a policy's does.

The harness (kvviz.core.harness.step_layer) feeds every head of a layer, lets the group
evict, and after every step enforces each head's cap and the layer's total (at most heads x
b) and checks that each head's reported victims are exactly the positions that left it.
docs/policies.md ("What an allocator must hold") states the whole contract.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import ClassVar

import numpy as np

from kvviz.core.budget import smallest_budget
from kvviz.core.policies.base import DeclaredSpecs, Place, enforce, need_candidates, param, parse_declared


class _AllocSpecs(DeclaredSpecs):
    """`specs` for an allocator: the declared parameters. Read through an allocator built with
    `scorers` (make_policy passes every registered policy, plugins included), `scorer`'s
    choices are those names; built by hand without them, any name is taken and its scorer
    factory refuses an unknown one when it builds the streams. (The registry's `param_specs`
    lists the registered policies as the choices.)"""

    def __get__(self, obj, cls):
        specs = super().__get__(obj, cls)
        if obj is None:
            return specs
        names = obj.scorers if obj.scorers is not None else (
            (obj.scorer.strip(),) if isinstance(obj.scorer, str) else ())
        return tuple(replace(s, choices=tuple(names)) if s.name == "scorer" else s for s in specs)


@dataclass
class Allocator:
    budget: int = 512
    rng: object = field(default=None, repr=False, compare=False)  # a numpy Generator or None
    scorer: str = param("tova", label="scorer", choices=("tova", "snapkv"),
                        help="the per-stream policy whose candidates and priority choose victims",
                        source="any registered policy (kvpress composes a press with a scorer "
                               "press the same way)")
    # Handed in at construction by make_policy: the scorer factory (make_policy itself:
    # `factory(name, budget=, rng=, place=, **params)` -> a per-stream policy), the names a
    # scorer may be (the registered policies), and the scorer's own parameters.
    factory: object = field(default=None, repr=False, compare=False, kw_only=True)  # a callable or None
    scorers: tuple | None = field(default=None, repr=False, compare=False, kw_only=True)
    scorer_params: dict = field(default_factory=dict, repr=False, compare=False, kw_only=True)

    name: ClassVar[str] = "allocator"
    label: ClassVar[str] = ""
    allocator: ClassVar[bool] = True  # what the registry and the harnesses tell it apart by
    specs: ClassVar = _AllocSpecs()
    victim_order: ClassVar[str | None] = "per_head"  # or "shared", or None (see above)
    reference: ClassVar = None  # the slow reference class, or "module:Class"

    def __post_init__(self):
        parse_declared(self)
        self.scorer_params = dict(self.scorer_params)
        self.check_params()

    # -- what a subclass provides -------------------------------------------------
    def check_params(self) -> None:
        """Raise ValueError naming the parameter and the rule it breaks."""

    @classmethod
    def scorer_settings(cls, own: dict, scorer: str, params: dict) -> dict:
        """The scorer's parameters as the allocator sets them, from its own parameters `own`
        (as given) and the scorer's `params` (as given), before make_policy builds the scorer:
        by default `params`. (headkv and cake set SnapKV's windows to their `window`.)"""
        return params

    def layer_budget(self, depth: int, depths: int) -> int:
        """The per-head mean budget of layer `depth` of `depths`: by default the budget."""
        return self.budget

    def layer_budgets(self, depths: int) -> list[int]:
        """Every layer's per-head budget; their sum is depths x budget."""
        return [self.layer_budget(d, depths) for d in range(depths)]

    def floor(self, b: int) -> int:
        """No eviction takes a head of a layer with per-head budget `b` below this."""
        return b

    def cap(self, b: int, heads: int) -> int:
        """The most slots one head may hold after an eviction."""
        return b

    def choose_layer(self, policies, b: int) -> list:
        """Victims' slot indices (ascending) per head, the layer's heads over heads x b.
        Default: each head down to `b` by its scorer's own choice."""
        out = []
        for p in policies:
            excess = len(p.held()) - b
            out.append(p.choose(excess) if excess > 0 else np.empty(0, np.int64))
        return out

    def calibration_rows(self) -> int:
        """How many rows of each head's stream, read with the full cache (row t over
        positions 0..t-1), `calibrate` needs before the first step: 0 (the default) none."""
        return 0

    def calibrate(self, rows: list, group: "LayerGroup"):
        """The layer's state from `rows[g][t]` (head g's row t, full cache): what
        `choose_group` reads as `group.state`. Called once, before the first step."""
        return None

    def plan_layers(self, rows_by_layer: list) -> list | None:
        """Optional: every layer's per-head budget from every layer's calibration rows
        (`rows_by_layer[layer][g][t]`), summing to layers x budget; None keeps
        `layer_budgets`. See the module docstring; an allocator that plans its layers
        overrides this and asks for calibration rows."""
        return None

    @property
    def plans_layers(self) -> bool:
        """Whether it overrides `plan_layers` (it sets its layers' budgets from rows)."""
        return type(self).plan_layers is not Allocator.plan_layers

    def planned_budgets(self, rows_by_layer: list, layers: int) -> list[int]:
        """`plan_layers(rows_by_layer)` checked: one positive integer per layer summing to
        layers x budget (ValueError naming the allocator and the rule); `layer_budgets`
        when it returns None."""
        plan = self.plan_layers(rows_by_layer)
        if plan is None:
            return self.layer_budgets(layers)
        plan = list(plan)
        if len(plan) != layers:
            raise ValueError(f"{self.title}: plan_layers must give one budget per layer: {len(plan)} for "
                             f"{layers} layers")
        if any(isinstance(b, bool) or int(b) != b or b < 1 for b in plan):
            raise ValueError(f"{self.title}: plan_layers must give positive integer budgets, got {plan}")
        if sum(int(b) for b in plan) != layers * self.budget:
            raise ValueError(f"{self.title}: plan_layers' budgets must sum to layers x budget = "
                             f"{layers} x {self.budget} = {layers * self.budget}, got {sum(int(b) for b in plan)}")
        return [int(b) for b in plan]

    def choose_group(self, group: "LayerGroup") -> list:
        """Victims' slot indices per head for one layer: `choose_layer` by default; an
        allocator with per-layer state (`group.state`) overrides this."""
        return self.choose_layer(group.policies, group.b)

    # -- shared mechanics ------------------------------------------------------------
    @property
    def params(self) -> dict:
        """The allocator's parameters, then its scorer's (every one, defaults included)."""
        own = {s.name: getattr(self, s.name) for s in self.specs}
        return {**own, **self.scorer_params}

    @property
    def title(self) -> str:
        """How a refusal names it: 'adakv (scorer tova)'."""
        return f"{self.name} (scorer {self.scorer})"

    def make_scorer(self, budget: int, place: Place):
        """One stream's scorer at per-head budget `budget`, told its `place`."""
        return self.build_policy(self.scorer, budget, place, **self.scorer_params)

    def build_policy(self, name: str, budget: int, place: Place, **params):
        """A per-stream policy `name` from the scorer factory (headroles builds its streaming
        heads' StreamingLLM this way), sharing the allocator's rng."""
        if self.factory is None:
            raise ValueError(f"{self.name} was built without a scorer factory: build it with "
                             f"make_policy({self.name!r}, ...) (or pass factory=make_policy)")
        return self.factory(name, budget=budget, rng=self.rng, place=place, **params)

    def group(self, layer: int | None, layers: int | None, heads: int, *, depth: int | None = None,
              depths: int | None = None, budget: int | None = None) -> "LayerGroup":
        """The `heads` KV heads of one layer, one scorer each, told
        Place(layer, layers, head, heads). `depth`/`depths` place the layer among those
        that share the budget (default: `layer`/`layers`; a trace replay passes the rank of
        each stored layer among the stored ones). `budget`: the layer's per-head budget
        when it is planned (`plan_layers`), instead of `layer_budget`."""
        depth = layer if depth is None else depth
        depths = layers if depths is None else depths
        if depth is None or depths is None:
            depth, depths = 0, 1
        if isinstance(heads, bool) or int(heads) != heads or heads < 1:
            raise ValueError(f"heads must be a positive integer, got {heads!r}")
        ratio = getattr(self, "ratio", None)  # a ratio budget (kvviz.core.budget): per step
        if ratio is not None and budget is None:
            ratio = ratio.with_floor(smallest_budget(
                lambda m: _layer_budget_at(self, m, int(depth), int(depths)) is not None))
            budget = _layer_budget_at(self, ratio.floor, int(depth), int(depths))
        b = self.layer_budget(int(depth), int(depths)) if budget is None else int(budget)
        policies = [self.make_scorer(b, Place(layer, layers, g, int(heads))) for g in range(int(heads))]
        group = LayerGroup(self, policies, b, Place(layer, layers, None, int(heads)))
        if ratio is not None:
            group.ratio, group.depth, group.depths = ratio, int(depth), int(depths)
        return group


def _layer_budget_at(allocator: Allocator, mean: int, depth: int, depths: int) -> int | None:
    """The per-head budget of layer `depth` of `depths` were the allocator's budget `mean`
    (None where its layers' rule refuses that mean: a pyramid with a layer under 1 slot)."""
    at = copy.copy(allocator)
    at.budget = int(mean)
    try:
        return int(at.layer_budget(depth, depths))
    except ValueError:
        return None


class LayerGroup:
    """The KV heads of one layer under an allocator: `policies[g]` is head g's scorer.
    Stepped by kvviz.core.harness.step_layer."""

    def __init__(self, allocator: Allocator, policies: list, b: int, place: Place):
        self.allocator, self.policies, self.b, self.place = allocator, policies, b, place
        self.heads = len(policies)
        self.total = self.heads * b
        self.floor = allocator.floor(b)
        self.cap = allocator.cap(b, self.heads)
        self.state = None  # what `calibrate` made of the calibration rows, if it asks for any
        self.calibrated = False
        # the inputs its heads read, declared as a Policy declares them (every head's scorer
        # is one class)
        scorer = policies[0]
        self.uses_attention = scorer.uses_attention
        self.reads_key_norms, self.reads_value_norms = scorer.reads_key_norms, scorer.reads_value_norms
        self.reads_query_rows = scorer.reads_query_rows

    ratio = None  # a ratio budget (kvviz.core.budget.Ratio): `resolve` sets b at every step

    def resolve(self, seen: int) -> None:
        """Under a ratio budget: this step's per-head budget, the allocator's layer rule at
        the mean budget the ratio resolves to over `seen` positions (never below the smallest
        mean the rule accepts for this layer), with the total, floor and cap that follow."""
        b = _layer_budget_at(self.allocator, self.ratio.resolve(seen), self.depth, self.depths)
        if b is None:
            raise ValueError(f"{self.name}: its layer rule refuses the budget {self.ratio} resolves to "
                             f"over {seen} positions ({self.ratio.resolve(seen)})")
        self.b, self.total = b, self.heads * b
        self.floor, self.cap = self.allocator.floor(b), self.allocator.cap(b, self.heads)

    def calibrate(self, rows: list) -> None:
        """Give the allocator the calibration rows (`rows[g][t]`: head g's row t read with
        the full cache) before the first step; it keeps what it makes of them as `state`."""
        if len(rows) != self.heads:
            raise ValueError(f"calibration rows must come for every head: {len(rows)} for "
                             f"{self.heads} heads")
        self.state = self.allocator.calibrate(rows, self)
        self.calibrated = True

    @property
    def name(self) -> str:
        """How a refusal names the allocator: 'adakv (scorer tova)'."""
        return self.allocator.title

    def held_counts(self) -> np.ndarray:
        """int64 (heads,): slots each head holds now."""
        return np.array([len(p.held()) for p in self.policies], np.int64)

    def evict(self) -> list:
        """Let the allocator choose, drop the victims; their positions per head (one array
        per head, each exactly the positions that head stopped holding: the harness checks
        it, kvviz.core.harness.evict_layer)."""
        chosen = self.allocator.choose_group(self)
        return [p.drop(idx) for p, idx in zip(self.policies, chosen)]

    def enforce(self, pos: int) -> None:
        """BudgetError when a head is over its cap or the layer over its total. The total is
        a ceiling, not a target: a layer holding less (an allocator that leaves room unused)
        passes, and its held counts are what the harness records."""
        counts = self.held_counts()
        where = self.place.describe()
        for g, n in enumerate(counts):
            enforce(self.name, int(n), self.cap, pos, ", ".join(filter(None, [where, f"head {g}"])))
        enforce(self.name, int(counts.sum()), self.total, pos,
                ", ".join(filter(None, [where, "all heads (the layer's total)"])))


def alpha_floor(alpha: float, b: int) -> int:
    """floor(alpha x b), exact on alpha's decimal spelling (0.29 x 100 is 29, not 28)."""
    return int(Fraction(repr(float(alpha))) * b)


def shared_victims(policies, total: int, floor: int) -> list:
    """The victims' slot indices per head when the heads share `total` slots: while they
    hold more, the lowest-priority candidate across heads goes (ties: the lower head, then
    the lower position), skipping a head already at `floor`. Each head's priority is
    computed once per step, before any victim goes (as Policy.choose does for its count)."""
    counts = [len(p.held()) for p in policies]
    excess = sum(counts) - total
    empty = [np.empty(0, np.int64) for _ in policies]
    if excess <= 0:
        return empty
    prio, head, slot = [], [], []
    for g, p in enumerate(policies):
        idx = np.flatnonzero(p.candidates())
        prio.append(np.asarray(p.priority(), np.float64)[idx])
        head.append(np.full(len(idx), g, np.int64))
        slot.append(idx)
    prio, head, slot = np.concatenate(prio), np.concatenate(head), np.concatenate(slot)
    order = np.lexsort((slot, head, prio))  # priority, then head, then position
    head_o = head[order]
    # the k-th candidate (in this order) of head g may go iff k < its room above the floor
    room = np.maximum(np.asarray(counts) - floor, 0)
    rank = np.empty(len(order), np.int64)
    for g in range(len(policies)):
        mine = head_o == g
        rank[mine] = np.arange(int(mine.sum()))
    eligible = np.flatnonzero(rank < room[head_o])
    need_candidates(len(eligible), excess)
    taken = order[eligible[:excess]]
    return [np.sort(slot[taken[head[taken] == g]]) for g in range(len(policies))]
