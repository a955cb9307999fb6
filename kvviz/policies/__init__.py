"""The documented home of a plugin policy's base class: `from kvviz.policies.base import Policy`.

The registry and the built-in policies live in `kvviz.core.policies`."""
