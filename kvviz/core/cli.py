"""What every kvviz command's parser shares."""
from __future__ import annotations

import argparse
import sys

from kvviz.core.budget import parse_budget


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


def budget_arg(text):
    """An argparse `type` for a budget: a slot count or a ratio of the tokens seen ('0.25x',
    kvviz.core.budget); a refusal names the rule. Any integer passes here, so the command
    refuses a count below 1 in its own words."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


budget_arg.__name__ = "budget"
