"""`kvviz.hf.evicting`: a kvviz policy inside a plain Hugging Face `generate` or forward call.

The code lives in `kvviz.model.hf` with the rest of the model layer; this short path is the
one users import, so it stays stable when the package's folders move. It needs the `model`
extra: without torch or transformers the import fails in one line naming it."""
from kvviz.core.extras import require

require("kvviz.hf", "model", "torch", "transformers")

from kvviz.model.hf import evicting  # noqa: E402

__all__ = ["evicting"]
