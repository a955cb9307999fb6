"""Kept for plugins written against it: `Policy`, `Rank`, `param` and the shared rule checks.

The documented path is `kvviz.policies` (`from kvviz.policies import Policy, Allocator, ...`);
the code lives in `kvviz.core.policies.base`."""
from kvviz.core.policies.base import *  # noqa: F403
from kvviz.core.policies.base import __all__  # noqa: F401
