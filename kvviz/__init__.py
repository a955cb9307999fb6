"""kvviz: replay attention traces through KV-cache eviction policies, measure and draw them.

Importing kvviz loads numpy only; the capture stack (torch, transformers) is imported
lazily by `python -m kvviz capture`.
"""
from .paths import version as _version

__version__ = _version()  # pyproject.toml's, from the checkout or the package metadata


def register_policy(cls):
    """Add a policy class (a kvviz.policies.base.Policy dataclass) to the registry, so every
    surface shows it; see kvviz.policies.register_policy and README "Write your own policy"."""
    from .policies import register_policy as register

    return register(cls)
