"""kvviz: replay attention through KV-cache eviction policies, measure what they keep, draw it.

The package has four layers, each importing only from the ones before it:

- `kvviz.core`: numpy only. The policies and their registry, traces, the harness step,
  replay, metrics, the slow reference and `kvviz check`. Everything below is re-exported here.
- `kvviz.model`: a real model in the loop (torch and transformers, imported lazily).
- `kvviz.studies`: benchmarks, reports and sweeps.
- `kvviz.app`: the Streamlit explorer, its figures and the teaching tools.

Importing kvviz loads numpy only.
"""
from kvviz.core.metrics import evaluate, hh_recall, retained_mass, summary
from kvviz.core.paths import version as _version
from kvviz.core.policies import POLICIES, make_policy, register_allocator, register_policy
from kvviz.core.policies.base import Policy, Rank, param
from kvviz.core.reference import RefPolicy
from kvviz.core.replay import Replay, Run, run_policy
from kvviz.core.trace import Trace, canonical, load_trace, save_trace

__version__ = _version()  # pyproject.toml's, from the checkout or the package metadata

__all__ = [
    "POLICIES", "Policy", "Rank", "RefPolicy", "Replay", "Run", "Trace", "__version__", "canonical",
    "evaluate", "hh_recall", "load_trace", "make_policy", "param", "register_allocator", "register_policy",
    "retained_mass", "run_policy", "save_trace", "summary",
]
