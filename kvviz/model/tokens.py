"""One string per token, such that the strings join to the decoded text exactly.

Byte-level BPE vocabularies (GPT-2's table, SmolLM2's) split a character over several
tokens; decoding each id alone would show replacement characters. These helpers give each
character to the token in which its last byte arrives. No torch here: only the tokenizer's
`convert_ids_to_tokens` and `decode` are called.
"""
from __future__ import annotations


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table, used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def byte_token_strings(tok, ids: list[int]) -> list[str]:
    """One string per token such that "".join(result) is the decoded text, exactly.

    Decoding each id on its own would turn a character split over two tokens into two
    replacement characters. Instead each token's bytes are collected and a character is
    given to the token in which its last byte arrives; a token holding only the first
    bytes of a character is therefore "" (kept, so positions stay aligned).
    """
    table = _byte_decoder()
    pieces = tok.convert_ids_to_tokens(ids)
    out, pending = [], b""
    for i, piece in zip(ids, pieces):
        if piece and all(ch in table for ch in piece):
            pending += bytes(table[ch] for ch in piece)
        else:  # special or non-byte-level token: trust the tokenizer
            pending += tok.decode([i]).encode("utf-8")
        text, pending = _complete_prefix(pending)
        out.append(text)
    return out


def _complete_prefix(data: bytes) -> tuple[str, bytes]:
    """Split bytes into (decoded complete characters, trailing incomplete UTF-8 bytes)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace"), b""
