"""kvviz: replay attention traces through KV-cache eviction policies, measure and draw them.

Importing kvviz loads numpy only; the capture stack (torch, transformers) is imported
lazily by `python -m kvviz capture`.
"""
__version__ = "0.1.0"
