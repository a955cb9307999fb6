"""What one closed-loop run is: a policy, its parameters and a budget. No torch here."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvviz.core.budget import as_given, is_ratio, parse_budget
from kvviz.core.policies import ALLOCATORS, FULL, POLICIES, is_allocator, make_policy, parse_params

GRANULARITIES = ("layer", "kv-head")
EVICTIONS = ("masked", "freed")  # what an eviction does to the cache: mask the key, or free its memory
PREFILL_CHUNK = 256  # prompt queries per attention block in a prefill: memory ~ chunk x prompt length


def check_eviction(eviction) -> None:
    """`eviction` is one of EVICTIONS; ValueError naming the parameter otherwise."""
    if eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {list(EVICTIONS)}, got {eviction!r}")


@dataclass
class LoopConfig:
    """One configuration of the batch. `policy` is a registry name (a policy, or an allocator
    such as adakv whose parameters include its scorer's) or "full" (no eviction, budget
    ignored). `params` may omit defaults; `full_params()` lists them all.

    A saved result stores `record()` (name, every parameter, budget, and where the policy
    came from: kvviz.core.plugins.provenance); `from_record` reads it back as it was, whether
    or not the policy's code is loaded in this process, so a result outlives its plugin.
    Only `make()` needs the code."""

    policy: str
    params: dict = field(default_factory=dict)
    budget: int | None = None  # or a ratio of the tokens seen ("0.25x", kvviz.core.budget)
    source: dict | None = field(default=None, compare=False, repr=False)  # as recorded; None: ask the registry
    _recorded: bool = field(default=False, init=False, compare=False, repr=False)

    @classmethod
    def from_record(cls, d: dict) -> "LoopConfig":
        """A config as a result recorded it (`record()`, or the older {policy, params, budget}):
        the parameters exactly as saved, not re-checked against the registry (the policy may
        not be registered here, or its code may have changed since)."""
        if not isinstance(d, dict) or not isinstance(d.get("policy"), str):
            raise ValueError(f"a recorded config is a dict with a str 'policy', got {d!r}")
        cfg = cls.__new__(cls)
        cfg.policy = d["policy"]
        full = cfg.policy == FULL
        cfg.params = {} if full else dict(d.get("params") or {})
        budget = d.get("budget")
        cfg.budget = None if full or budget is None else parse_budget(budget)
        cfg.source = d.get("source") if isinstance(d.get("source"), dict) else None
        cfg._recorded = True
        cfg._bytes = d.get("bytes_per_slot")
        return cfg

    def record(self) -> dict:
        """What a saved result stores: to_dict() plus `source` ({origin, where, sha256}: built-in,
        entry point, file or module; None for full) and the policy's `bytes_per_slot`."""
        from kvviz.core.plugins import provenance

        out = self.to_dict()
        if self.is_full:
            return {**out, "source": None}
        if self._recorded and (self.source is not None or not self.available):
            return {**out, "source": self.source, "bytes_per_slot": getattr(self, "_bytes", None)}
        held = getattr(self.make(), "bytes_per_slot", None)  # an allocator counts its streams' own
        return {**out, "source": provenance(self.policy), "bytes_per_slot": None if held is None else int(held)}

    @property
    def available(self) -> bool:
        """Whether this process can run the policy (full, or a registered name)."""
        return self.is_full or self.policy in POLICIES or is_allocator(self.policy)

    @property
    def bytes_per_slot(self) -> int:
        """The policy's bytes per held slot (0 for full); a recorded config whose code is not
        loaded gives the recorded value (0 if the file predates it)."""
        if self.is_full:
            return 0
        if self._recorded and not self.available:
            return int(getattr(self, "_bytes", None) or 0)
        return int(getattr(self.make(), "bytes_per_slot", 0))

    def __post_init__(self):
        if self.policy == FULL:
            self.params, self.budget = {}, None
            return
        if self.policy not in POLICIES and not is_allocator(self.policy):
            raise ValueError(f"policy must be one of {sorted(POLICIES) + sorted(ALLOCATORS) + [FULL]}, "
                             f"got {self.policy!r}")
        self.params = parse_params(self.policy, dict(self.params or {}))  # names or labels
        if self.budget is not None:
            self.budget = parse_budget(self.budget)
        self.make(0)  # the registry's own checks: unknown parameter, even poolKernel, ...

    @property
    def is_full(self) -> bool:
        return self.policy == FULL

    @property
    def is_allocator(self) -> bool:
        """Whether the policy is an allocator (it shares a budget across a layer's streams)."""
        return is_allocator(self.policy)

    def make(self, layer: int = 0, head: int = 0, seed: int = 0, place=None):
        """A fresh policy object (None for full); rng seeded per (seed, layer, head); `place`
        (kvviz.core.policies.Place) tells it where its stream sits."""
        if self.is_full:
            return None
        if not self.available:
            where = self.source or {}
            raise ValueError(f"policy {self.policy!r} is not registered in this process; this config was "
                             f"recorded from {where.get('origin', 'an unknown origin')} "
                             f"{where.get('where', '')}".rstrip() + ": load it (--plugin PATH.py|MODULE) to run it")
        return make_policy(self.policy, budget=self.budget, rng=np.random.default_rng([seed, layer, head]),
                           place=place, **self.params)

    def full_params(self) -> dict:
        if self.is_full:
            return {}
        if self._recorded:
            return dict(self.params)  # saved as full_params() already
        return dict(self.make().params)

    @property
    def label(self) -> str:
        if self.is_full:
            return FULL
        inner = ",".join(f"{k}={v}" for k, v in self.full_params().items())
        return f"{self.policy}{'(' + inner + ')' if inner else ''}@{self.budget}"

    def to_dict(self) -> dict:
        return {"policy": self.policy, "params": self.full_params(),
                "budget": None if self.budget is None else as_given(self.budget)}


def check_chunk(chunk, name: str = "prefill_chunk") -> None:
    """A prefill's block of queries is an integer >= 1; ValueError naming `name` otherwise."""
    if isinstance(chunk, (bool, np.bool_)) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {chunk!r}")


def check_fits(positions: int, budgets, eviction: str = "masked", context: int | None = None,
               what: str = "the run", option: str = "--budget") -> None:
    """A run of `positions` positions refused before the model loads, naming the option:
    longer than the model's `context`; a budget (the command's `option`) in freed mode that
    evicts nothing (it holds every position, so nothing is freed)."""
    if context is not None and positions > context:
        raise ValueError(f"{what} needs {positions} positions, more than the model's context of {context}")
    if eviction == "freed":
        refuse_ratio_freed(budgets, option)
        for b in budgets:
            if b is not None and b >= positions:
                raise ValueError(f"{option} {b} with --eviction freed: {what} reads {positions} positions, so "
                                 f"nothing would be evicted or freed; use a budget below {positions}, "
                                 "or --eviction masked")


def refuse_ratio_freed(budgets, what: str = "budget") -> None:
    """A freed cache sizes its slots by a fixed budget before any row is read; a ratio of the
    tokens seen grows with them: refused (ValueError naming `what`) in freed mode."""
    for b in budgets:
        b = getattr(b, "budget", b)  # a LoopConfig's
        if b is not None and is_ratio(parse_budget(b)):
            raise ValueError(f"{what} {b} with eviction freed: a ratio of the tokens seen grows with them, "
                             "and a freed cache sizes its slots by a fixed budget before any row is read; "
                             "evict masked (--eviction masked) or give a count")


def parse_policy(spec: str) -> tuple[str, dict]:
    """'snapkv:poolKernel=5,obsWindow=16' -> ("snapkv", {"pool_kernel": 5, "obs_window": 16})."""
    name, _, rest = str(spec).partition(":")
    name = name.strip()
    if name != FULL and name not in POLICIES and not is_allocator(name):
        raise ValueError(f"--policy: unknown policy {name!r}; known: "
                         f"{', '.join(sorted(POLICIES) + sorted(ALLOCATORS) + [FULL])}")
    params = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--policy {spec!r}: parameters are k=v, got {item!r}")
        params[key.strip()] = value
    if name == FULL:
        if params:
            raise ValueError(f"--policy full takes no parameters, got {sorted(params)}")
        return name, {}
    return name, parse_params(name, params, where=f"--policy {spec!r}: ")


def check_configs(configs) -> list[LoopConfig]:
    """Every config valid (LoopConfig checks itself), a `full` row first, no duplicates."""
    configs = list(configs)
    for c in configs:
        if not isinstance(c, LoopConfig):
            raise ValueError(f"configs must be LoopConfig objects, got {type(c).__name__}")
    if not any(c.is_full for c in configs):
        configs.insert(0, LoopConfig(FULL))
    labels = [c.label for c in configs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"configs must be distinct; repeated: {dupes}")
    return configs
