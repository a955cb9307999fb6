"""The documented import path for writing a policy or an allocator:

    from kvviz.policies import Policy, Allocator, Rank, param, register_policy, register_allocator

A per-stream policy subclasses `Policy`; an allocator (a budget shared across the KV heads
and layers of a model) subclasses `Allocator`. Both are declared the same way (a dataclass,
`name`, `label`, parameters with `param`) and reach the registry by `register_policy` /
`register_allocator`, a `--plugin` file or module, `$KVVIZ_PLUGINS`, or an entry point in
the group `kvviz.policies`. The shared rule checks (`check_recent`, `need_candidates`, ...)
and the allocators' helpers (`shared_victims`, `alpha_floor`) are here too.

The code lives in `kvviz.core.policies`; `kvviz.policies.base` and `kvviz.Policy` are kept
for plugins written against them.
"""
from kvviz.core.policies import (
    make_policy,
    register_allocator,
    register_policy,
    unregister_allocator,
    unregister_policy,
)
from kvviz.core.policies.alloc import Allocator, alpha_floor, shared_victims
from kvviz.core.policies.base import (
    DEFAULT_SEED,
    BudgetError,
    ParamSpec,
    Place,
    Policy,
    Rank,
    VictimError,
    check_key_norm,
    check_recent,
    check_value_norm,
    enforce,
    need_candidates,
    norm_inputs,
    param,
)

__all__ = ["DEFAULT_SEED", "Allocator", "BudgetError", "ParamSpec", "Place", "Policy", "Rank",
           "VictimError", "alpha_floor", "check_key_norm", "check_recent", "check_value_norm", "enforce",
           "make_policy", "need_candidates", "norm_inputs", "param", "register_allocator",
           "register_policy", "shared_victims", "unregister_allocator", "unregister_policy"]
