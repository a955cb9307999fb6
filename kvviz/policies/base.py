"""The mechanics every policy shares: the kept positions, input checks, victim choice.

A subclass owns only its scoring rule: what it records per slot (`observe`, `admit`),
which slots may go (`candidates`) and their rank (`priority`, lowest evicted first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

DEFAULT_SEED = 0


@dataclass(frozen=True)
class ParamSpec:
    """What the UI needs to build a control, and where the default comes from."""

    name: str
    label: str
    default: int
    min: int
    max: int
    step: int = 1
    odd_only: bool = False
    help: str = ""
    source: str = ""


@dataclass
class Policy:
    budget: int = 512
    rng: np.random.Generator | None = field(default=None, repr=False, compare=False)

    name: ClassVar[str] = "policy"
    uses_attention: ClassVar[bool] = True
    specs: ClassVar[tuple[ParamSpec, ...]] = ()

    def __post_init__(self):
        if isinstance(self.budget, bool) or int(self.budget) != self.budget or self.budget < 1:
            raise ValueError(f"budget must be a positive integer, got {self.budget!r}")
        self.budget = int(self.budget)
        for spec in self.specs:
            value = getattr(self, spec.name)
            if isinstance(value, bool) or int(value) != value:
                raise ValueError(f"{spec.name} must be an integer, got {value!r}")
            setattr(self, spec.name, int(value))
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

    def protected_tail(self) -> int:
        """How many of the newest slots are never victims (a recent window)."""
        return 0

    def candidates(self) -> np.ndarray:
        cand = np.ones(self._n, bool)
        cand[max(self._n - self.protected_tail(), 0):] = False
        return cand

    def priority(self) -> np.ndarray:
        """Per slot, lowest is evicted first; ties go to the lower position.

        A slot outside the protected tail that is still not a candidate must score +inf
        (TOVA's unobserved newcomer), so a single eviction is one argmin.
        """
        raise NotImplementedError

    def scores(self) -> dict:
        return {"candidate": self.candidates()}

    # -- shared mechanics ------------------------------------------------------------
    def reset_state(self) -> None:
        self._n = 0
        self._spec = self.columns()
        self._pos = np.empty(16, np.int64)
        self._bufs = {k: np.full(shape + (16,), init, dtype)
                      for k, (dtype, shape, init) in self._spec.items()}

    def col(self, name: str) -> np.ndarray:
        return self._bufs[name][..., : self._n]

    @property
    def params(self) -> dict:
        return {s.name: getattr(self, s.name) for s in self.specs}

    @property
    def kept(self) -> np.ndarray:
        view = self._pos[: self._n]
        view.flags.writeable = False
        return view

    @property
    def bytes_per_slot(self) -> int:
        raise NotImplementedError

    def on_decode_step(self, pos, attn) -> None:
        pos = _as_position(pos)
        n = self._n
        if n and pos <= self._pos[n - 1]:
            raise ValueError(f"pos must be above every kept position: got {pos}, "
                             f"highest kept is {int(self._pos[n - 1])}")
        self.advance(pos, None if attn is None else _check_attn(attn, n))

    def advance(self, pos: int, attn: np.ndarray | None) -> None:
        """on_decode_step without the checks: observe `attn`, admit `pos`. For the harness
        (kvviz.harness.step), whose rows are already validated and renormalised."""
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
        if isinstance(budget, bool) or int(budget) != budget or budget < 0:
            raise ValueError(f"evict budget must be a non-negative integer, got {budget!r}")
        excess = self._n - int(budget)
        if excess <= 0:
            return np.empty(0, np.int64)
        idx = self.choose(excess)
        victims = self._pos[idx]
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

        Slots are in ascending position order, so a stable sort on priority breaks
        ties toward the lower position.
        """
        prio = self.priority()
        if count == 1:
            limit = self._n - self.protected_tail()
            if limit > 0:
                i = int(np.argmin(prio[:limit]))
                if prio[i] != np.inf:
                    return np.array([i])
        cand = self.candidates()
        idx = np.flatnonzero(cand)  # also the path where every candidate scored +inf
        need_candidates(len(idx), count)
        order = np.argsort(prio[idx], kind="stable")[:count]
        return np.sort(idx[order])

    def held(self) -> np.ndarray:
        """`kept` without the read-only wrapper: the harness's per-step fast path."""
        return self._pos[: self._n]


def need_candidates(available: int, count: int) -> None:
    if available < count:
        raise ValueError(f"evict needs {count} victims but only {available} slots are "
                         "candidates (the rest are protected or unobserved): raise the budget")


def check_recent(policy, spec_name: str = "recent_window") -> None:
    value = getattr(policy, spec_name)
    if value < 0:
        raise ValueError(f"{spec_name} must be >= 0, got {value}")
    if value >= policy.budget:
        raise ValueError(f"{spec_name} must be smaller than budget: "
                         f"{spec_name}={value} >= budget={policy.budget} leaves no room to evict")


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
