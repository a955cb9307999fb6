"""`kvviz.hf.evicting`: a kvviz policy inside a plain Hugging Face `generate` or forward call.

The code lives in `kvviz.model.hf` with the rest of the model layer; this short path is the
one users import, so it stays stable when the package's folders move."""
from kvviz.model.hf import evicting

__all__ = ["evicting"]
