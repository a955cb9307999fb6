"""What every kvviz command's parser shares."""
from __future__ import annotations

import sys


def one_line_error(message):
    """argparse's `error` for kvviz's commands: one clear line and exit 2. argparse's own
    prints the whole usage first, which buries the one thing that was wrong; set it with
    `parser.error = one_line_error`."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
