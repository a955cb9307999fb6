"""Tidy tables of eviction logs: what `to_frame()` returns on a replay Run, a loop result, a
generation and a needle run, and what `kvviz export` writes.

One stream is one configuration at one layer and head, with its eviction log `evicted_at`
(the step that evicted each position, -1 never). Position p is admitted at step p (step t
reads token t), and query t sees the cache left after step t-1, so p is held for query t
when p < t and (evicted_at[p] == -1 or evicted_at[p] >= t), the rule of
kvviz.core.replay.held_shares. The full cache's attention is query t's row over positions
0..t-1, each row normalised to sum 1 here ("full_mass"), where the rows are known (a
replay's trace; a loop result's full row for its recorded layers and leading tokens); NaN
elsewhere.

Two shapes, `per`:
- "step": one row per step x layer x head x position (query `step`, every position before
  it): `held` (for that query) and `full_mass` (the share of that query's full-cache
  attention on the position: what it received, or would have received had it been held).
  T(T-1)/2 rows a stream, so filter layers and heads on long runs.
- "position": one row per layer x head x position: `full_mass` (summed over the known
  queries after it) and `lost_mass` (the part from queries made after its eviction: what
  the eviction cost it).

Both carry config, policy, budget, layer, head, position, token (None where unknown),
admitted and evicted (pandas Int64, <NA> never). numpy here; pandas is imported inside
`frame`, so the core stays numpy-only at import.
"""
from __future__ import annotations

import numpy as np

NEVER = -1
PER = ("position", "step")
MAX_ROWS = 50_000_000  # a per-step table past this is refused, naming the filters
KEYS = ("config", "policy", "budget", "layer", "head")


def check_per(per) -> None:
    """`per` is one of PER; ValueError naming the parameter otherwise."""
    if per not in PER:
        raise ValueError(f"per must be one of {list(PER)}, got {per!r}")


def size(streams: int, steps: int, per: str) -> int:
    """Rows of a table of `streams` streams of `steps` positions each."""
    return streams * (steps * (steps - 1) // 2 if per == "step" else steps)


def chosen(shape, configs=None, layers=None, heads=None) -> tuple:
    """The config, layer and head indices a table covers, each all of `shape` (C, L, G) when
    None, else checked to be in range (ValueError naming the parameter)."""
    out = []
    for name, given, n in zip(("configs", "layers", "heads"), (configs, layers, heads), shape):
        picked = range(n) if given is None else [int(x) for x in given]
        bad = [x for x in picked if not 0 <= x < n]
        if bad:
            raise ValueError(f"{name} must be in 0..{n - 1}, got {bad[0]}")
        out.append(picked)
    return tuple(out)


def check_size(streams: int, steps: int, per: str) -> None:
    """Refuse a table of more than MAX_ROWS rows, naming the filters that narrow it."""
    n = size(streams, steps, per)
    if n > MAX_ROWS:
        raise ValueError(f"per='step' over {streams} streams of {steps} steps is {n:,} rows (the limit is "
                         f"{MAX_ROWS:,}): choose fewer layers, heads or configs, or per='position'")


def stream(evicted_at, *, row=None, n_rows: int = 0, per: str = "position") -> dict[str, np.ndarray]:
    """One stream's columns (without the keys and the token). `row(t)` gives the full
    cache's weights of query t over positions 0..t-1 for 1 <= t < n_rows (normalised here;
    a row summing to 0 counts as unknown)."""
    check_per(per)
    ev = np.asarray(evicted_at, np.int64)
    T = len(ev)
    n_rows = min(int(n_rows), T) if row is not None else 0
    weights = {}
    for t in range(1, n_rows):
        w = np.asarray(row(t), np.float64)
        if len(w) != t:
            raise ValueError(f"row {t} has {len(w)} weights, expected {t}")
        total = w.sum()
        if total > 0:
            weights[t] = w / total
    if per == "step":
        steps = np.repeat(np.arange(1, T, dtype=np.int64), np.arange(1, T))
        pos = np.concatenate([np.arange(t, dtype=np.int64) for t in range(1, T)]) if T > 1 else np.zeros(0, np.int64)
        e = ev[pos]
        mass = np.full(len(pos), np.nan)
        offsets = np.concatenate([[0], np.cumsum(np.arange(1, T))]) if T > 1 else np.zeros(1, np.int64)
        for t, w in weights.items():
            mass[offsets[t - 1]:offsets[t - 1] + t] = w
        return {"step": steps, "position": pos, "admitted": pos.copy(), "evicted": e,
                "held": (e == NEVER) | (e >= steps), "full_mass": mass}
    pos = np.arange(T, dtype=np.int64)
    full = np.full(T, np.nan)
    lost = np.full(T, np.nan)
    if weights:
        known = np.zeros(T, bool)
        full[:] = 0.0
        lost[:] = 0.0
        for t, w in weights.items():
            full[:t] += w
            gone = (ev[:t] != NEVER) & (ev[:t] < t)
            lost[:t][gone] += w[gone]
            known[:t] = True
        full[~known] = np.nan
        lost[~known] = np.nan
    return {"position": pos, "admitted": pos.copy(), "evicted": ev.copy(), "full_mass": full, "lost_mass": lost}


def frame(blocks, tokens=None, per: str = "position"):
    """A pandas DataFrame from `blocks`: (keys, columns) pairs, keys a dict of KEYS (one
    value per stream; an optional "tokens" list overrides `tokens` for that stream), columns
    from `stream`. `tokens`: position -> text (None unknown)."""
    import pandas as pd

    check_per(per)
    blocks = list(blocks)
    tail = ["step"] if per == "step" else []
    tail += ["position", "token", "admitted", "evicted"]
    tail += ["held", "full_mass"] if per == "step" else ["full_mass", "lost_mass"]
    if not blocks:
        blocks = [({}, {c: np.zeros(0, bool if c == "held" else np.float64 if "mass" in c else np.int64)
                        for c in tail if c != "token"})]
    n = [len(cols["position"]) for _, cols in blocks]
    idx = np.repeat(np.arange(len(blocks)), n)
    types = {"config": "string", "policy": "string", "budget": "Int64", "layer": "Int64", "head": "string"}
    if any(isinstance(keys.get("budget"), str) for keys, _ in blocks):  # a ratio, as given ("0.25x")
        types["budget"] = "string"
    data = {}
    for key in KEYS:
        values = [keys.get(key) for keys, _ in blocks]
        values = [None if v is None else (int(v) if types[key] == "Int64" else str(v)) for v in values]
        data[key] = pd.array(values, dtype=types[key]).take(idx)
    for col in tail:
        if col != "token":
            data[col] = np.concatenate([cols[col] for _, cols in blocks])
    texts = []
    for keys, cols in blocks:  # a block's own "tokens" (a generation's rows differ) or the shared ones
        own = keys.get("tokens", tokens)
        pos = cols["position"]
        if own is None:
            texts.append(np.full(len(pos), None, dtype=object))
        else:
            text = np.asarray([None if t is None else str(t) for t in own] + [None], dtype=object)
            texts.append(text[np.where(pos < len(own), pos, len(own))])
    data["token"] = pd.array(np.concatenate(texts), dtype="string")
    ev = data["evicted"]
    data["evicted"] = pd.arrays.IntegerArray(np.where(ev == NEVER, 0, ev).astype(np.int64), ev == NEVER)
    return pd.DataFrame({c: data[c] for c in (*KEYS, *tail)})
