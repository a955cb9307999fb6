"""Write the study haystacks: prose paragraphs of the Python language reference, as CPython
ships it in `pydoc_data.topics` (PSF licence), one topic a file in traces/haystacks/.

Kept: paragraphs at the left margin that read as sentences (end with a full stop, no grammar
`::=`, no code). Dropped: indented blocks (grammar, examples, tables, notes' bodies), headings,
rule lines, "Added in version" lines. The text is copied into the repository, so every prompt
is the same on every Python version; this script documents how the files were made (re-running
it on another Python may give other text: the files are the reference, not the script).

    python -m lab.make_haystacks            # lists the topics it would write
    python -m lab.make_haystacks --write    # writes traces/haystacks/*.txt
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "traces" / "haystacks"
LEAST, MOST = 1000, 3200  # characters of prose a haystack holds (about 200-650 tokens)
COUNT = 24
SKIP = ("operator-summary", "debugger", "formatstrings", "specialnames", "string-methods")  # tables, lists


def paragraphs(text: str) -> list[str]:
    out, block = [], []
    for line in text.splitlines() + [""]:
        if not line.strip():
            if block:
                out.append(" ".join(block))
            block = []
        elif line[0].isspace() or set(line.strip()) <= set("*=-~^"):
            if block:
                out.append(" ".join(block))
            block = []
            out.append("")  # an indented or rule line breaks the paragraph and is dropped
        else:
            block.append(line.strip())
    return [p for p in out if p]


def prose(p: str) -> bool:
    return (p.endswith(".") and p.count(". ") + 1 >= 2 and "::=" not in p and ">>>" not in p
            and not p.startswith(("Added in version", "Changed in version", "Deprecated", "See also", "Note:"))
            and re.match(r"[A-Z]", p) is not None and "|" not in p)


def clean(p: str) -> str:
    p = re.sub(r"\s+", " ", p.replace("*", ""))
    p = p.replace("“", '"').replace("”", '"').replace("‘", "'").replace("’", "'")
    return p.encode("ascii", "ignore").decode()


def haystack(text: str) -> str:
    out = ""
    for p in (clean(p) for p in paragraphs(text) if prose(p)):
        if len(out) >= LEAST and len(out) + len(p) > MOST:
            break
        out = f"{out} {p}".strip()
    return out


def choose() -> dict[str, str]:
    from pydoc_data.topics import topics

    texts = {k: haystack(v) for k, v in sorted(topics.items()) if k not in SKIP}
    return dict(sorted((k, v) for k, v in texts.items() if len(v) >= LEAST)[:COUNT])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = choose()
    for k, v in chosen.items():
        print(f"{k}: {len(v)} characters")
    if "--write" in argv:
        OUT.mkdir(parents=True, exist_ok=True)
        for k, v in chosen.items():
            (OUT / f"{k}.txt").write_text(v + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
