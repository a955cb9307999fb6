"""One line to stderr, prefixed with the command: how the model layer reports slow steps
(loading, dequantising, capturing) without a logging setup of its own."""
from __future__ import annotations

import sys


def log(msg: str, command: str = "capture") -> None:
    """Print `[kvviz COMMAND] msg` to stderr at once, so a long load shows what it is doing."""
    print(f"[kvviz {command}] {msg}", file=sys.stderr, flush=True)
