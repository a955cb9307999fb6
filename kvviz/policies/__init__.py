"""The policy registry: names to classes, and the parameters the UI builds controls from."""
from __future__ import annotations

from .base import ParamSpec, Policy
from .h2o import H2O
from .random_policy import RandomPolicy
from .scissorhands import Scissorhands
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM
from .tova import Tova

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Tova, SnapKV, H2O, StreamingLLM, Scissorhands, RandomPolicy)
}


def _policy_class(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]


def make_policy(name: str, budget: int = 512, rng=None, **params) -> Policy:
    cls = _policy_class(name)
    allowed = {s.name for s in cls.specs}
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(f"{name} has no parameter {sorted(unknown)}; "
                         f"its parameters are {sorted(allowed) or 'none'}")
    return cls(budget=budget, rng=rng, **params)


def param_specs(name: str) -> list[ParamSpec]:
    return list(_policy_class(name).specs)


__all__ = ["POLICIES", "ParamSpec", "Policy", "make_policy", "param_specs"]
