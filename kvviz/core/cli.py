"""What every kvviz command's parser shares."""
from __future__ import annotations

import sys


def one_line_error(message):
    """argparse's `error` for kvviz's commands: one clear line and exit 2. argparse's own
    prints the whole usage first, which buries the one thing that was wrong; set it with
    `parser.error = one_line_error`."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def as_options(message, names) -> str:
    """A library refusal said in a command's own terms: a message that starts with one of
    the parameter `names` ("rows_layers: ...") starts with its option instead
    ("--rows-layers: ..."). Only the leading name is changed, never a word in the sentence."""
    text = str(message)
    for name in names:
        if text.startswith(f"{name}:"):
            return "--" + name.replace("_", "-") + text[len(name):]
    return text
