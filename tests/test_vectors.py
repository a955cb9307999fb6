"""Replay the language-neutral conformance vectors in tests/vectors/*.json.

Format (see tests/vectors/README.md): each file is either a scenario

    {"name", "description", "policy", "params", "budget",
     "steps": [{"pos", "attn": [..] | null, "evict": int | null, "victims": [..], "kept": [..]}
               | {"pos", "attn", "expect_error": "keyword", "kept": [..]}]}

or a construction refusal {"name", "description", "policy", "params", "budget", "expect_error": "keyword"}.

Every expected list was derived by hand from the policy cards; the derivation is in "description".
Non-finite weights are spelled as the strings "NaN", "Infinity", "-Infinity" (JSON has no literal for them).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

VECTOR_DIR = Path(__file__).resolve().parent / "vectors"
VECTOR_FILES = sorted(VECTOR_DIR.glob("*.json"))
MIN_VECTORS = 15

_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _attn(raw):
    if raw is None:
        return None
    vals = [_SPECIAL[x] if isinstance(x, str) else float(x) for x in raw]
    return np.asarray(vals, dtype=np.float32)


def _norm(step: dict) -> dict:
    """A step's "key_norm" (vectors of policies that read key norms), passed only when given."""
    return {"key_norm": step["key_norm"]} if "key_norm" in step else {}


def _ints(xs) -> list[int]:
    return [int(x) for x in np.asarray(xs).ravel()]


def _check_error(excinfo, keyword: str, where: str) -> None:
    msg = str(excinfo.value)
    assert keyword.lower() in msg.lower(), (
        f"{where}: ValueError message should name the rule (contain {keyword!r}), got {msg!r}")


def test_enough_vectors():
    assert len(VECTOR_FILES) >= MIN_VECTORS, (
        f"expected at least {MIN_VECTORS} vector files in {VECTOR_DIR}, found {len(VECTOR_FILES)}")


@pytest.mark.parametrize("path", VECTOR_FILES, ids=[p.stem for p in VECTOR_FILES])
def test_vector_well_formed(path: Path):
    """Bookkeeping checks on the vector itself (no policy code involved): attn lengths match the kept
    set, kept lists follow from the previous kept list, the admitted position and the victims."""
    v = _load(path)
    for key in ("name", "description", "policy", "params", "budget"):
        assert key in v, f"{path.name}: missing {key!r}"
    assert v["name"] == path.stem
    assert isinstance(v["params"], dict) and isinstance(v["budget"], int)
    if "steps" not in v:
        assert isinstance(v.get("expect_error"), str) and v["expect_error"]
        return
    assert "expect_error" not in v
    kept: list[int] = []
    for i, st in enumerate(v["steps"]):
        where = f"{path.name} step {i}"
        pos, attn = st["pos"], st["attn"]
        assert isinstance(pos, int) and pos >= 0, where
        if "expect_error" in st:
            assert isinstance(st["expect_error"], str) and st["expect_error"], where
            assert st["kept"] == kept, f"{where}: a refused step must leave kept unchanged"
            continue
        assert not kept or pos > max(kept), where
        if attn is not None:
            assert len(attn) == len(kept), f"{where}: attn must align with kept {kept}"
            assert all(isinstance(x, (int, float)) and x >= 0 and math.isfinite(x) for x in attn), where
        after = kept + [pos]
        if st["evict"] is None:
            assert "victims" not in st, where
        else:
            victims = st["victims"]
            assert victims == sorted(victims) and len(set(victims)) == len(victims), where
            assert set(victims) <= set(after), where
            assert len(victims) == max(0, len(after) - st["evict"]), where
            after = [p for p in after if p not in victims]
        assert st["kept"] == after, f"{where}: kept should be {after}"
        kept = after


@pytest.mark.parametrize("path", VECTOR_FILES, ids=[p.stem for p in VECTOR_FILES])
def test_vector(path: Path):
    from kvviz.core.policies import make_policy

    v = _load(path)
    name, params, budget = v["policy"], dict(v["params"]), v["budget"]

    if "steps" not in v:
        with pytest.raises(ValueError) as excinfo:
            make_policy(name, budget=budget, **params)
        _check_error(excinfo, v["expect_error"], f"{path.name} construction")
        return

    p = make_policy(name, budget=budget, **params)
    for i, st in enumerate(v["steps"]):
        where = f"{path.name} step {i} (pos {st['pos']})"
        attn = _attn(st["attn"])
        if "expect_error" in st:
            with pytest.raises(ValueError) as excinfo:
                p.on_decode_step(st["pos"], attn, **_norm(st))
            _check_error(excinfo, st["expect_error"], where)
            if "kept" in st:
                assert _ints(p.kept) == st["kept"], f"{where}: refused step changed kept"
            continue
        p.on_decode_step(st["pos"], attn, **_norm(st))
        if st["evict"] is not None:
            victims = p.evict(st["evict"])
            assert _ints(victims) == st["victims"], f"{where}: victims"
        assert _ints(p.kept) == st["kept"], f"{where}: kept"
