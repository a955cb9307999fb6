"""The mechanics every policy shares: the kept positions, input checks, victim choice.

A subclass owns only its scoring rule: what it records per slot (`observe`, `admit`),
which slots may go (`candidates`) and their rank (`priority`, lowest evicted first).
"""
from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import numpy as np

__all__ = ["DEFAULT_SEED", "BudgetError", "ParamSpec", "Place", "Policy", "Rank", "VictimError",
           "check_key_norm", "check_keys", "check_query", "check_value_norm", "norm_inputs",
           "check_recent", "enforce", "need_candidates", "param"]

DEFAULT_SEED = 0


KINDS = ("int", "float", "choice", "str", "bool", "value")


def _rule_of(validate) -> str:
    """A validator's rule in words: the first line of its docstring, else its name."""
    doc = (getattr(validate, "__doc__", None) or "").strip()
    if doc:
        return doc.splitlines()[0].strip().rstrip(".")
    return getattr(validate, "__name__", "valid").strip("_").replace("_", " ")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: what the constructor enforces, what a control shows, where the default
    comes from. Declared with `param(...)` on a dataclass field, so the default is written
    once (the field's); `name` and `default` are filled in from the field.

    `min`/`max` are the rule (None: unbounded; rules relative to the budget live in
    `check_params`); `ui_max` only bounds a slider when the rule has no upper end.

    `kind` comes from the default's type: int, float, choice (a str with `choices`), str
    (a free string: a path, a name), bool, or value (anything else a dataclass can hold,
    a tuple say). `validate`, a function the declaration names, is the rule beyond the
    type: it takes the typed value and returns it (or what it stands for: a path made
    absolute, a text parsed into a tuple), raising ValueError saying what is wrong; its
    docstring's first line is the rule in words ("a path to an existing JSON file").
    """

    name: str = ""
    label: str = ""
    default: object = None
    min: float | None = None
    max: float | None = None
    choices: tuple = ()
    step: float | None = None
    odd_only: bool = False
    help: str = ""
    source: str = ""
    kind: str = ""  # int | float | choice, from the default's type
    ui_max: float | None = None
    validate: object = None  # a callable(value) -> value, raising ValueError; or None

    @property
    def numeric(self) -> bool:
        """Whether the parameter is a number with a range (int or float)."""
        return self.kind in ("int", "float")

    @property
    def low(self):
        """The control's lower end."""
        return self.min if self.min is not None else 0

    @property
    def high(self):
        """The control's upper end: the rule's max, else `ui_max`."""
        return self.max if self.max is not None else self.ui_max

    def _range(self) -> str:
        if self.min is not None and self.max is not None:
            return f"in {self.min}..{self.max}"
        return f">= {self.min}" if self.min is not None else ""

    def rule(self) -> str:
        """The rule in words, as refusals and `--help` print it."""
        if self.kind == "choice":
            return "one of " + ", ".join(map(repr, self.choices))
        if not self.numeric:
            what = {"str": "a string", "bool": "true or false", "value": "a value"}[self.kind]
            return _rule_of(self.validate) if self.validate is not None else what
        what = "a number" if self.kind == "float" else "an odd integer" if self.odd_only else "an integer"
        return f"{what} {self._range()}".strip()

    def coerce(self, value):
        """`value` (a number, or the text of a CLI flag, URL or form) as this parameter's
        type, without the range rule; ValueError naming the parameter and the type."""
        if self.kind == "choice":
            if not isinstance(value, str) or value.strip() not in self.choices:
                raise ValueError(f"{self.name} must be {self.rule()}, got {value!r}")
            return value.strip()
        if self.kind == "str":
            if not isinstance(value, str):
                raise ValueError(f"{self.name} must be a string, got {value!r}")
            return value.strip()
        if self.kind == "bool":
            text = str(value).strip().lower() if isinstance(value, str) else None
            if isinstance(value, (bool, np.bool_)) or text in _BOOLS:
                return bool(value) if text is None else _BOOLS[text]
            raise ValueError(f"{self.name} must be true or false, got {value!r}")
        if self.kind == "value":
            return value  # its validator says what it takes (text from a CLI flag too)
        typed = ValueError(f"{self.name} must be {'a number' if self.kind == 'float' else 'an integer'}, "
                           f"got {value!r}")
        if isinstance(value, str):
            try:
                value = int(value.strip()) if self.kind == "int" else float(value.strip())
            except ValueError:
                raise typed from None
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise typed
        if not math.isfinite(float(value)) or (self.kind == "int" and int(value) != value):
            raise typed
        return int(value) if self.kind == "int" else float(value)

    def parse(self, value):
        """`coerce`, then the rule: ValueError naming the parameter and the rule it breaks."""
        value = self.coerce(value)
        if not self.numeric:
            return self._validated(value)
        outside = ((self.min is not None and value < self.min)
                   or (self.max is not None and value > self.max))
        if self.odd_only and (outside or value % 2 == 0):
            raise ValueError(f"{self.name} must be odd and {self._range()}, got {value}")
        if outside:
            raise ValueError(f"{self.name} must be {self._range()}, got {value}")
        return self._validated(value)

    def _validated(self, value):
        """The declared validator's value; its ValueError (or any error it raises) as one
        ValueError naming the parameter and the rule."""
        if self.validate is None:
            return value
        try:
            out = self.validate(value)
        except Exception as exc:  # the author's function: any failure is a refusal of the value
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"{self.name} must be {_rule_of(self.validate)}: {reason} "
                             f"(got {value!r})") from None
        return value if out is None else out


_BOOLS = {"true": True, "1": True, "yes": True, "on": True,
          "false": False, "0": False, "no": False, "off": False}


def param(default, *, label: str, help: str, source: str, min=None, max=None, choices=(),
          step=None, odd_only: bool = False, ui_max=None, validate=None):
    """A policy parameter: a dataclass field whose default is written here, once.

    Its kind is its default's type (see ParamSpec): an int or a float takes min/max; a str
    with `choices` is a choice, without them a free string; a bool is a switch; anything
    else (a tuple) is a value. `validate(value) -> value` is any further rule, for any kind
    (a path that must exist, a float in a range that depends on nothing else): it raises
    ValueError saying what is wrong, and the refusal names the parameter and the rule (its
    docstring's first line)."""
    kind = ("choice" if isinstance(default, str) and choices else "str" if isinstance(default, str)
            else "bool" if isinstance(default, bool) else "float" if isinstance(default, float)
            else "int" if isinstance(default, int) else "value")
    if validate is not None and not callable(validate):
        raise ValueError(f"param {label}: validate must be a function (value -> value), "
                         f"got {validate!r}")
    spec = ParamSpec(label=label, min=min, max=max, choices=tuple(choices), step=step,
                     odd_only=odd_only, help=help, source=source, kind=kind, ui_max=ui_max,
                     validate=validate)
    return field(default=default, metadata={"kvviz": spec})


@dataclass(frozen=True)
class Place:
    """Where a stream sits in the model: its layer and the number of layers, its KV head and
    the number of KV heads. A field is None where the harness does not have it: a replay of
    one stored stream knows its model layer number (`layer`) but not the model's layer count,
    and a synthetic trace knows nothing (every field None).

    Every harness sets it on the policy before the first step, as `policy.place`, so
    `advance`, `observe`, `priority` and `candidates` can read it; the class default is
    `Place()`, all None. The loop engine builds its per-(layer, KV head) policies with
    `make_policy(name, budget, place=Place(layer, L, g, G))`.
    """

    layer: int | None = None   # model layer number (0 = the first layer)
    layers: int | None = None  # how many layers the model has
    head: int | None = None    # KV-head index within the layer
    heads: int | None = None   # how many KV heads the layer has

    def __post_init__(self):
        for name in ("layer", "layers", "head", "heads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                      or value < (1 if name in ("layers", "heads") else 0)):
                raise ValueError(f"place.{name} must be None or an integer "
                                 f"{'>= 1' if name in ('layers', 'heads') else '>= 0'}, got {value!r}")
            if value is not None:
                object.__setattr__(self, name, int(value))
        for index, count in (("layer", "layers"), ("head", "heads")):
            i, n = getattr(self, index), getattr(self, count)
            if i is not None and n is not None and i >= n:
                raise ValueError(f"place.{index} must be below place.{count}: got {index}={i}, "
                                 f"{count}={n}")

    def describe(self) -> str:
        """'layer 14, head 2', or '' when nothing is known: how refusals name a stream."""
        parts = [f"{w} {v}" for w, v in (("layer", self.layer), ("head", self.head)) if v is not None]
        return ", ".join(parts)


NOWHERE = Place()


@dataclass(frozen=True)
class Rank:
    """The score a policy evicts by, for the Scores view and the explanations (display
    only: the policy's `priority` decides). `key` names an entry of `scores()`."""

    key: str
    label: str            # e.g. "current-step weight"
    order: str            # which end goes first, in words: "lowest ... goes first"
    descending: bool = False  # True when the highest score goes first
    count: bool = False       # an integer count: drawn on a linear axis


class DeclaredSpecs:
    """`cls.specs`: the ParamSpecs of the dataclass fields declared with `param`."""

    def __get__(self, obj, cls):
        if "__dataclass_fields__" not in cls.__dict__:
            return ()  # @dataclass looking at the class before it is one (not cached)
        if "_specs_cache" not in cls.__dict__:
            cls._specs_cache = tuple(
                replace(f.metadata["kvviz"], name=f.name, default=f.default)
                for f in fields(cls) if "kvviz" in f.metadata)
        return cls._specs_cache


@dataclass
class Policy:
    budget: int = 512
    rng: np.random.Generator | None = field(default=None, repr=False, compare=False)

    name: ClassVar[str] = "policy"
    label: ClassVar[str] = ""          # how the page and tables name it
    rank: ClassVar[Rank | None] = None  # None: ranks without a score (drawn as "held")
    score_labels: ClassVar[dict] = {}   # labels of its other scores() entries
    colour: ClassVar[str | None] = None  # "#RRGGBB"; None takes one from the palette
    reference: ClassVar = None  # the slow reference class, or "module:Class"
    # The policy's rule over S streams at once (a kvviz.core.policies.vectorised.StreamState
    # subclass, declared in the policy's own file), which kvviz.core.streams.Streams steps;
    # None: the streams are replayed one policy object each. Declared per class: a subclass
    # inherits none (it may change the rule), and one that keeps its parent's rule says so
    # (`vectorised = Tova.vectorised`). Only a policy that reads attention alone may declare one.
    vectorised: ClassVar[type | None] = None
    uses_attention: ClassVar[bool] = True
    reads_key_norms: ClassVar[bool] = False  # True: advance() needs the admitted key's L2 norm
    reads_value_norms: ClassVar[bool] = False  # True: advance() needs the admitted value's L2 norm
    # True: advance() also gets `query_rows`, (query heads, kept): each query head of the
    # stream's KV group (every head of the layer at layer granularity) on the kept slots,
    # each row renormalised; `attn` stays their mean. Only the model supplies them.
    reads_query_rows: ClassVar[bool] = False
    # True: advance() also gets `keys`, float32 (kept + 1, head_dim): the cache's keys (after
    # RoPE, as the cache holds them) at the kept positions and at the admitted one, in slot
    # order (keys[-1] is the admitted position's). They are the cache's, read at every step,
    # so a policy that only reads them keeps no copy and pays nothing per slot for them.
    reads_keys: ClassVar[bool] = False
    # True: advance() also gets `query`, float32 (group, head_dim): the step's query vector of
    # each query head of the stream's KV group (after RoPE), the query whose row `attn` is.
    reads_queries: ClassVar[bool] = False
    summable: ClassVar[bool] = False  # True: observing rows one by one = observing their float64 sum once
    specs: ClassVar = DeclaredSpecs()
    place: ClassVar[Place] = NOWHERE  # where the stream sits; a harness sets it per instance

    def __init_subclass__(cls, **kwargs):
        """Make a subclass that declares no new fields a dataclass, so it needs no decorator.

        `class Mine(Tova): name = "mine"; label = "..."` has exactly its parent's fields, and
        without this it would be no dataclass of its own: `specs` would be empty (its
        parameters neither checked nor shown) and registration refused. A subclass that
        declares fields still needs `@dataclass` (which re-applies harmlessly when used on
        a field-less one), so an undecorated one is refused by name at registration rather
        than silently losing them.
        """
        super().__init_subclass__(**kwargs)
        if "vectorised" not in cls.__dict__:
            cls.vectorised = None  # a parent's form need not follow this class's rule
        if not _declares_fields(cls):
            dataclass(cls)

    def __post_init__(self):
        parse_declared(self)
        if self.rng is None:
            self.rng = np.random.default_rng(DEFAULT_SEED)
        self.check_params()
        self.reset_state()

    # -- what a subclass provides -------------------------------------------------
    def check_params(self) -> None:
        """Raise ValueError naming the parameter and the rule it breaks."""

    def columns(self) -> dict:
        """Per-slot state: name -> (dtype, leading shape, value for a new slot).

        Stored slot-axis-last, so `col(name)[k]` is one contiguous row per ring slot.
        """
        return {}

    def observe(self, attn: np.ndarray) -> None:
        """Record one step's weights, index-aligned with `kept`."""

    def prefill_rows(self, prompt_len: int) -> int:
        """How many of a prompt's last rows this policy's state after a prefill depends on.

        A prefill (kvviz.core.harness.prefill) observes a prompt's rows without evicting,
        then evicts once at its last row. Rows before the last `prefill_rows` are not
        observed: their positions are admitted as they come (`advance(pos, None)`), and
        `skip_rows` hears how many were passed over. The default reads every row; a policy
        whose state is overwritten by later rows (TOVA's last row, SnapKV's ring) says
        how many it keeps, and a test shows the shortcut equals streaming every row.
        """
        return prompt_len

    def skip_rows(self, count: int) -> None:
        """`count` prompt rows were passed over unobserved (see `prefill_rows`): a policy that
        counts observed steps (a ring's write index) advances that count here."""

    def protected_tail(self) -> int:
        """How many of the newest slots are never victims (a recent window)."""
        return 0

    def candidates(self) -> np.ndarray:
        """Which slots may be evicted now, one bool per slot: all but the protected tail.

        The one place a policy protects slots (sinks, an unobserved newcomer): `choose`
        never takes a slot excluded here while a candidate is left, and `kvviz check`
        fails a policy whose victims include one, so the score need not repeat the rule.
        """
        cand = np.ones(self._n, bool)
        cand[max(self._n - self.protected_tail(), 0):] = False
        return cand

    def priority(self) -> np.ndarray:
        """Per slot, lowest is evicted first; ties go to the lower position.

        Only candidates are ranked (`choose` masks the rest with `candidates()`), so a
        score says nothing about which slots are protected; it may give them any value.
        """
        raise NotImplementedError

    def scores(self) -> dict:
        """What the Scores view and the explanations read at one step: score name -> one
        value per kept slot, plus "candidate" (the `candidates()` mask).

        By default the declared `rank`'s own column (a copy, when `rank.key` names a
        one-value-per-slot column of `columns()`), so a policy that stores the score it
        ranks by needs only `columns`, `observe` and `priority` to be drawn and explained.
        Override it when the score shown is derived (SnapKV's pooled sums) or stored in
        another form (TOVA's +inf for an unobserved slot, shown as no value).
        """
        out = {}
        r = self.rank
        if r is not None and r.key in self._spec and self._spec[r.key][1] == ():
            out[r.key] = self.col(r.key).copy()
        out["candidate"] = self.candidates()
        return out

    # -- shared mechanics ------------------------------------------------------------
    def reset_state(self) -> None:
        """Start empty: no slots, the columns `columns()` declares allocated small. A subclass
        with state outside the columns (a ring's write index) extends this and calls super()."""
        self._n = 0
        self._spec = self.columns()
        self._pos = np.empty(16, np.int64)
        self._bufs = {k: np.full(shape + (16,), init, dtype)
                      for k, (dtype, shape, init) in self._spec.items()}

    def col(self, name: str) -> np.ndarray:
        """The live view of column `name` over the kept slots (slot axis last): writing into it
        updates the policy's state, which is how `observe` is meant to work, without copies."""
        return self._bufs[name][..., : self._n]

    @property
    def params(self) -> dict:
        """The declared parameters and their values: what labels, links, sweeps and logs record."""
        return {s.name: getattr(self, s.name) for s in self.specs}

    @property
    def kept(self) -> np.ndarray:
        """The kept positions, ascending, read-only: slot k of every column belongs to kept[k]."""
        view = self._pos[: self._n]
        view.flags.writeable = False
        return view

    @property
    def bytes_per_slot(self) -> int:
        """Memory per kept slot in the cards' layout: a 4-byte position, each column's
        bytes, one byte of eviction scratch. A default, so a minimal policy still reports
        memory (bench, sweeps); override it when the policy holds more per slot than its
        columns (SnapKV's sums) or needs no scratch (StreamingLLM)."""
        return 4 + sum(np.dtype(dtype).itemsize * math.prod(shape)
                       for dtype, shape, _ in self._spec.values()) + 1

    def on_decode_step(self, pos, attn, key_norm=None, value_norm=None, query_rows=None,
                       keys=None, query=None) -> None:
        """One step of the harness: check and `observe` the weights over the kept slots (`None`
        for a step with no attention), then admit position `pos` as a new slot. The checks live
        here, once, so no subclass can accept a wrong-length, negative or non-finite row."""
        pos = _as_position(pos)
        n = self._n
        if n and pos <= self._pos[n - 1]:
            raise ValueError(f"pos must be above every kept position: got {pos}, "
                             f"highest kept is {int(self._pos[n - 1])}")
        attn = None if attn is None else _check_attn(attn, n)
        self.advance(pos, attn, **norm_inputs(self, key_norm, value_norm, query_rows, n, keys, query))

    def advance(self, pos: int, attn: np.ndarray | None, key_norm: float | None = None,
                value_norm: float | None = None, query_rows: np.ndarray | None = None,
                keys: np.ndarray | None = None, query: np.ndarray | None = None) -> None:
        """on_decode_step without the checks: observe `attn`, admit `pos`. For the harness
        (kvviz.core.harness.step), whose rows are already validated and renormalised. `key_norm`
        (the admitted key's L2 norm) is passed only to a policy that `reads_key_norms`,
        `value_norm` (the admitted value's L2 norm) only to one that `reads_value_norms`,
        `query_rows` only to one that `reads_query_rows` (which overrides this to read them),
        `keys` only to one that `reads_keys`, `query` only to one that `reads_queries`."""
        n = self._n
        if attn is not None:
            self.observe(attn)
        if n == len(self._pos):
            self._grow()
        self._pos[n] = pos
        for k, (_, _, init) in self._spec.items():
            self._bufs[k][..., n] = init
        self._n = n + 1

    def _grow(self) -> None:
        cap = 2 * len(self._pos)
        self._pos = np.resize(self._pos, cap)
        for k, buf in self._bufs.items():
            grown = np.empty(buf.shape[:-1] + (cap,), buf.dtype)
            grown[..., : self._n] = buf[..., : self._n]
            self._bufs[k] = grown

    def evict(self, budget) -> np.ndarray:
        """Drop down to `budget` slots and return the victims' positions, ascending (empty when
        at or under it). The victims are `choose`'s, so a subclass changes what goes by its
        score, never by rewriting this."""
        if isinstance(budget, bool) or int(budget) != budget or budget < 0:
            raise ValueError(f"evict budget must be a non-negative integer, got {budget!r}")
        excess = self._n - int(budget)
        if excess <= 0:
            return np.empty(0, np.int64)
        idx = self.choose(excess)
        victims = self._pos[idx]
        self._remove(idx)
        return victims

    def drop(self, idx) -> np.ndarray:
        """Remove the slots at indices `idx` (ascending, distinct) and return their positions:
        the mechanics of `evict` for an allocator, which chooses victims across streams from
        each stream's `candidates()` and `priority()` instead of calling `choose`."""
        idx = np.asarray(idx, np.int64)
        if len(idx) == 0:
            return np.empty(0, np.int64)
        victims = self._pos[idx].copy()
        self._remove(idx)
        return victims

    def _remove(self, idx: np.ndarray) -> None:
        n = self._n
        arrays = [self._pos, *self._bufs.values()]
        if len(idx) == 1:
            i = int(idx[0])
            for a in arrays:
                a[..., i:n - 1] = a[..., i + 1:n]
        else:
            keep = np.ones(n, bool)
            keep[idx] = False
            for a in arrays:
                a[..., : n - len(idx)] = a[..., :n][..., keep]
        self._n = n - len(idx)

    def choose(self, count: int) -> np.ndarray:
        """Indices of the `count` lowest-priority candidates, ascending.

        The ranking is masked with `candidates()`: a slot it excludes is never chosen while
        a candidate is left, whatever `priority()` says of it. So a policy says once which
        slots may go, and a score that forgets the exclusion (a finite score on a sink)
        cannot evict them. When fewer slots are candidates than victims are due, no
        excluded slot is taken instead: ValueError (`need_candidates`), as the protected
        tail has always been refused; the caller raises the budget.

        Slots are in ascending position order, so a stable sort on priority breaks
        ties toward the lower position.
        """
        prio = self.priority()
        if count == 1:
            limit = self._n - self.protected_tail()
            if limit > 0:
                ranked = prio[:limit]
                i = int(np.argmin(ranked))
                if type(self).candidates is not Policy.candidates:  # else: exactly the tail rule
                    cand = self.candidates()[:limit]
                    if not cand[i]:  # the lowest score is protected: rank the candidates only
                        ranked = np.where(cand, ranked, np.inf)
                        i = int(np.argmin(ranked))
                if ranked[i] != np.inf:
                    return np.array([i])
        cand = self.candidates()
        idx = np.flatnonzero(cand)  # also the path where every candidate scored +inf
        need_candidates(len(idx), count)
        order = np.argsort(prio[idx], kind="stable")[:count]
        return np.sort(idx[order])

    def held(self) -> np.ndarray:
        """`kept` without the read-only wrapper: the harness's per-step fast path."""
        return self._pos[: self._n]


_CLASSVAR = re.compile(r"\s*(?:\w+\.)?ClassVar\b")  # "ClassVar[str]", "typing.ClassVar"


def _declares_fields(cls) -> bool:
    """Whether the class body annotates a name that is not a ClassVar: a dataclass field of
    its own, which only an explicit @dataclass may turn into one."""
    for ann in cls.__dict__.get("__annotations__", {}).values():
        if isinstance(ann, str):
            if not _CLASSVAR.match(ann):
                return True
        elif ann is not ClassVar and typing.get_origin(ann) is not ClassVar:
            return True
    return False


class BudgetError(ValueError):
    """A policy or allocator held more than its budget after an eviction: the run stops."""


class VictimError(BudgetError):
    """A policy or allocator reported victims that are not exactly the positions that left
    its held set at that step (kvviz.core.harness.check_victims): the run stops. A
    BudgetError, so every harness that names the layer or the configuration of a refused
    budget names them here too."""


def enforce(name: str, held: int, limit: int, pos: int, stream: str = "") -> None:
    """BudgetError when `held` slots are over `limit` after step `pos`: the one check every
    harness makes (kvviz.core.harness.step and step_layer, so Replay, run_streams and the
    layer replay; the loop engine calls it after its own evictions). `stream` names the
    stream ('layer 14, head 2', a trace name); '' for none."""
    if held > limit:
        where = f" in stream {stream}" if stream else ""
        raise BudgetError(f"{name} held {held} slots{where} after step {pos}, over its budget of "
                          f"{limit}: a policy must evict down to its budget")


def parse_declared(obj) -> None:
    """The budget (a positive integer) and each declared parameter (`specs`) checked and
    coerced in place: the first half of a policy's or an allocator's construction."""
    if isinstance(obj.budget, bool) or int(obj.budget) != obj.budget or obj.budget < 1:
        raise ValueError(f"budget must be a positive integer, got {obj.budget!r}")
    obj.budget = int(obj.budget)
    for spec in obj.specs:
        setattr(obj, spec.name, spec.parse(getattr(obj, spec.name)))


def need_candidates(available: int, count: int) -> None:
    """Refuse an eviction that would have to take a protected or unobserved slot: too small a
    budget is the caller's error, said as one, not a silent break of the policy's rule."""
    if available < count:
        raise ValueError(f"evict needs {count} victims but only {available} slots are "
                         "candidates (the rest are protected or unobserved): raise the budget")


def check_recent(policy, spec_name: str = "recent_window") -> None:
    """The rule every protected recent window shares: at least 0 and below the budget, since a
    window as large as the budget leaves nothing to evict. For a policy's `check_params`."""
    value = getattr(policy, spec_name)
    if value < 0:
        raise ValueError(f"{spec_name} must be >= 0, got {value}")
    if value >= policy.budget:
        raise ValueError(f"{spec_name} must be smaller than budget: "
                         f"{spec_name}={value} >= budget={policy.budget} leaves no room to evict")


def check_value_norm(value, name: str) -> float:
    """The admitted value's L2 norm, for a policy that reads value norms: finite and >= 0."""
    if value is None:
        raise ValueError(f"{name} reads value norms, and none was given for this position: "
                         "replay a trace captured with value norms (format version 4)")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"value_norm must be a finite non-negative L2 norm, got {value!r}")
    return v


def norm_inputs(policy, key_norm=None, value_norm=None, query_rows=None, n=None, keys=None,
                query=None) -> dict:
    """The checked inputs beyond attention `policy.advance` takes as keywords: key_norm if it
    reads key norms, value_norm if it reads value norms, query_rows ((heads, n): one row per
    query head on its `n` kept slots) if it reads them, keys ((n + 1, head_dim): the kept
    slots' keys and the admitted one's) if it reads keys, query ((group, head_dim)) if it
    reads queries, nothing otherwise (so a policy reading none keeps the two-argument
    `advance`)."""
    out = {}
    if getattr(policy, "reads_keys", False):
        out["keys"] = check_keys(keys, policy.name, (len(policy.held()) if n is None else n) + 1)
    if getattr(policy, "reads_queries", False):
        out["query"] = check_query(query, policy.name)
        if "keys" in out and out["keys"].shape[1] != out["query"].shape[1]:
            raise ValueError(f"query and keys must share one head_dim: query has "
                             f"{out['query'].shape[1]}, keys {out['keys'].shape[1]}")
    if policy.reads_key_norms:
        out["key_norm"] = check_key_norm(key_norm, policy.name)
    if policy.reads_value_norms:
        out["value_norm"] = check_value_norm(value_norm, policy.name)
    if policy.reads_query_rows:
        out["query_rows"] = check_query_rows(query_rows, policy.name,
                                             len(policy.held()) if n is None else n)
    return out


def check_query_rows(rows, name: str, n: int) -> np.ndarray:
    """Each query head's weights on the `n` kept slots, for a policy that reads them:
    float32 (heads, n), at least one head, finite and >= 0."""
    if rows is None:
        raise ValueError(f"{name} reads per-query-head rows, and none were given: traces store "
                         "one row per stream, so run it in the model loop (kvviz loop, "
                         "generate, needle, kvviz.hf)")
    a = np.asarray(rows, dtype=np.float32)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] != n:
        raise ValueError(f"query_rows must be (query heads, kept positions) = (h, {n}) with "
                         f"h >= 1, got shape {a.shape}")
    if a.size and not (np.isfinite(a).all() and a.min() >= 0):
        raise ValueError("query_rows weights must be finite and non-negative")
    return a


def check_keys(keys, name: str, rows: int) -> np.ndarray:
    """The cache's keys at the kept slots and the admitted position, for a policy that reads
    keys: float32 (rows, head_dim) with head_dim >= 1, all finite."""
    if keys is None:
        raise ValueError(f"{name} reads key vectors, and none were given: replay a trace captured "
                         "with keys or run it in the model loop (kvviz loop, generate, needle, "
                         "kvviz.hf)")
    a = np.asarray(keys, dtype=np.float32)
    if a.ndim != 2 or a.shape[0] != rows or a.shape[1] < 1:
        raise ValueError(f"keys must be (kept positions + the admitted one, head_dim) = ({rows}, d) "
                         f"with d >= 1, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("keys must be finite (found NaN or inf)")
    return a


def check_query(query, name: str) -> np.ndarray:
    """The step's query vectors, one per query head of the stream's group, for a policy that
    reads queries: float32 (group, head_dim), both >= 1, all finite."""
    if query is None:
        raise ValueError(f"{name} reads query vectors, and none were given: replay a trace "
                         "captured with queries or run it in the model loop (kvviz loop, "
                         "generate, needle, kvviz.hf)")
    a = np.asarray(query, dtype=np.float32)
    if a.ndim == 1:
        a = a[None, :]  # one query head
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"query must be (query heads, head_dim) with both >= 1, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("query must be finite (found NaN or inf)")
    return a


def check_key_norm(value, name: str) -> float:
    """The admitted key's L2 norm, for a policy that reads key norms: finite and >= 0."""
    if value is None:
        raise ValueError(f"{name} reads key norms, and none was given for this position: "
                         "replay a trace captured with key norms (format version 3) or run it "
                         "in the model loop")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"key_norm must be a finite non-negative L2 norm, got {value!r}")
    return v


def _as_position(pos) -> int:
    if isinstance(pos, bool) or int(pos) != pos or pos < 0:
        raise ValueError(f"pos must be a non-negative integer position, got {pos!r}")
    return int(pos)


def _check_attn(attn, n: int) -> np.ndarray:
    a = np.asarray(attn, dtype=np.float32)
    if a.ndim != 1 or len(a) != n:
        raise ValueError(f"attn length must equal the number of kept positions ({n}), "
                         f"got shape {a.shape}")
    if n:
        low, high = float(a.min()), float(a.max())
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError("attn weights must be finite (found NaN or inf)")
        if low < 0:
            raise ValueError(f"attn weights must be non-negative (found {low})")
    return a
