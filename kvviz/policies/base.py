"""What a plugin policy subclasses: `Policy`, `Rank`, `param` and the shared rule checks.

Plugins written against this path keep working; the code lives in `kvviz.core.policies.base`."""
from kvviz.core.policies.base import *  # noqa: F403
from kvviz.core.policies.base import __all__  # noqa: F401
